"""The built-in loop on one GPU, by hand (CI has no GPU): ``python tools/gpu_check.py [STORAGE]``.

Needs a machine with a CUDA GPU, PyTorch with CUDA, and relaytrain's Python dependencies (Ray
2.60, pydantic, pyarrow, xxhash, numpy, pyyaml) importable; run it from the checkout's root. It
trains the default example (examples/digits_cnn.yaml) with 1 worker and ``scaling.use_gpu``
(nccl), 4 epochs, and prints what it saw:

1. two uninterrupted GPU runs, and the largest parameter difference between them (how
   deterministic the GPU kernels are);
2. a run with a raised fault at step 60 (attempt 1) and a killed worker at step 120 (attempt 2),
   resumed each time, and its largest difference from the first uninterrupted run;
3. that run's GPU checkpoint continued on the CPU (``use_gpu`` false, gloo) for 2 more epochs;
4. the GPU processes ``nvidia-smi`` listed while training.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from typing import Any

import ray
import torch

from trainer_core import storage, training_state
from trainer_core.checkpoints import RunDirectory
from trainer_core.engine import run_attempt
from trainer_core.errors import RelaytrainError
from trainer_core.spec import RunSpec, load_spec

FAULTS = (
    '[{"kind": "raise", "at_step": 60, "rank": 0, "attempt": 1},'
    ' {"kind": "kill", "at_step": 120, "rank": 0, "attempt": 2}]'
)


def spec_for(root: str, name: str, *overrides: str, gpu: bool = True, epochs: int = 4) -> RunSpec:
    return load_spec(
        "examples/digits_cnn.yaml",
        [
            f"run.name={name}",
            f"run.storage={root}",
            "scaling.num_workers=1",
            f"scaling.use_gpu={'true' if gpu else 'false'}",
            f"schedule.epochs={epochs}",
            *overrides,
        ],
    )


def attempts_until_done(spec: RunSpec, label: str, limit: int = 3) -> None:
    for number in range(1, limit + 1):
        events: list[dict[str, Any]] = []
        started = time.time()
        try:
            result = run_attempt(spec, on_event=events.append)
            outcome = f"{result.status} at step {result.steps_completed}"
        except RelaytrainError as e:
            result, outcome = None, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        starts = [(e["kind"], e.get("step")) for e in events if e["kind"] in RESUME_KINDS]
        print(f"{label}, attempt {number}: {outcome} ({time.time() - started:.1f} s) {starts}")
        if result is not None:
            print(f"    final metrics: {result.final_metrics}")
            return
    raise SystemExit(f"{label} did not complete in {limit} attempts")


RESUME_KINDS = ("resumed", "fresh_start")


def final_model(root: str, name: str) -> tuple[int, dict[str, torch.Tensor]]:
    run_dir = RunDirectory(storage.resolve(root).child(name))
    newest = run_dir.scan().newest
    assert newest is not None
    return newest.step, training_state.from_bytes(run_dir.read_verified(newest, "model.pt"))


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def watch_gpu(seen: set[str], stop: threading.Event) -> None:
    query = ["nvidia-smi", "--query-compute-apps=pid,process_name", "--format=csv,noheader"]
    while not stop.is_set():
        seen.update(subprocess.run(query, capture_output=True, text=True).stdout.splitlines())
        time.sleep(0.5)


def main() -> None:
    root = sys.argv[1] if len(sys.argv) > 1 else "/tmp/relaytrain-gpu-check"
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    ray.init(num_cpus=8, num_gpus=1, include_dashboard=False, log_to_driver=False)
    seen: set[str] = set()
    stop = threading.Event()
    threading.Thread(target=watch_gpu, args=(seen, stop), daemon=True).start()
    for name in ("clean-a", "clean-b"):
        attempts_until_done(spec_for(root, name), f"1 uninterrupted {name}")
    attempts_until_done(spec_for(root, "faults", f"faults={FAULTS}"), "2 faults")
    _, a = final_model(root, "clean-a")
    _, b = final_model(root, "clean-b")
    _, resumed = final_model(root, "faults")
    print(f"largest |clean-a - clean-b| {largest_difference(a, b):.3g}")
    print(f"largest |clean-a - faults| {largest_difference(a, resumed):.3g}")
    attempts_until_done(spec_for(root, "faults", gpu=False, epochs=6), "3 continued on CPU")
    stop.set()
    print("GPU processes seen while training:", sorted(seen))
    ray.shutdown()


if __name__ == "__main__":
    main()
