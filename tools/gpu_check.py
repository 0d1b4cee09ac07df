"""The built-in loop on one GPU, by hand (CI has no GPU):
``python tools/gpu_check.py [STORAGE] [ddp|fsdp|lm ...]`` (ddp and fsdp when none is named).

Needs a machine with a CUDA GPU, PyTorch with CUDA, and relaytrain's Python dependencies (Ray
2.60, pydantic, pyarrow, xxhash, numpy, pyyaml) importable; run it from the checkout's root. It
trains the default example (examples/digits_cnn.yaml) with 1 worker and ``scaling.use_gpu``
(nccl), 4 epochs, for each strategy (``scaling.strategy``; NCCL cannot put two ranks on one
GPU, so FSDP runs as one unit over a group of one, through FSDP2 and DCP all the same), and
prints what it saw:

1. two uninterrupted GPU runs, and the largest parameter difference between them (how
   deterministic the GPU kernels are);
2. a run with a raised fault at step 50 (attempt 1) and a killed worker at step 75 (attempt 2),
   resumed each time, and its largest difference from the first uninterrupted run;
3. that run's GPU checkpoint continued on the CPU (``use_gpu`` false, gloo) for 2 more epochs,
   by 2 workers under fsdp (DCP reshards the GPU's one shard over them);
4. the GPU processes ``nvidia-smi`` listed while training.

``lm`` trains the language model of examples/lm_gpt.yaml at the size of nanoGPT's
``shakespeare_char`` config (6 layers, 6 heads, 384 wide; 96-token crops of the pydoc rows
here, where nanoGPT's blocks are 256) on one GPU in bf16 and prints its tokens/s and its model
FLOPs utilization (nanoGPT's ``estimate_mfu``: 6N + 12·L·d·T FLOPs a token, against the GPU's
dense bf16 peak). nanoGPT's README trains ``shakespeare_char`` (5,000 iterations of 64 x 256
tokens) in about 3 minutes on one A100: about 450k tokens/s. A figure to report; no target.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from typing import Any

import ray
import torch

from trainer_core import storage
from trainer_core.checkpoint.exports import read_model_weights
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.errors import RelaytrainError
from trainer_core.run.engine import run_attempt
from trainer_core.spec.overrides import load_spec
from trainer_core.spec.run_spec import RunSpec

FAULTS = (
    '[{"kind": "raise", "at_step": 50, "rank": 0, "attempt": 1},'
    ' {"kind": "kill", "at_step": 75, "rank": 0, "attempt": 2}]'
)


def spec_for(
    root: str, name: str, *overrides: str, gpu: bool = True, epochs: int = 4, workers: int = 1
) -> RunSpec:
    return load_spec(
        "examples/digits_cnn.yaml",
        [
            f"run.name={name}",
            f"run.storage={root}",
            f"scaling.num_workers={workers}",
            f"scaling.use_gpu={'true' if gpu else 'false'}",
            f"schedule.epochs={epochs}",
            "checkpoint.every=20",  # 23 steps an epoch: both faults lose work, and resume
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
    return newest.step, read_model_weights(newest.uri)  # a DCP checkpoint's gathered whole


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def watch_gpu(seen: set[str], stop: threading.Event) -> None:
    query = ["nvidia-smi", "--query-compute-apps=pid,process_name", "--format=csv,noheader"]
    while not stop.is_set():
        seen.update(subprocess.run(query, capture_output=True, text=True).stdout.splitlines())
        time.sleep(0.5)


def check(root: str, strategy: str) -> None:
    print(f"-- scaling.strategy={strategy}")
    use = f"scaling.strategy={strategy}"
    for name in ("clean-a", "clean-b"):
        attempts_until_done(spec_for(root, f"{strategy}-{name}", use), f"1 uninterrupted {name}")
    faults = f"{strategy}-faults"
    attempts_until_done(spec_for(root, faults, use, f"faults={FAULTS}"), "2 faults")
    _, a = final_model(root, f"{strategy}-clean-a")
    _, b = final_model(root, f"{strategy}-clean-b")
    step, resumed = final_model(root, faults)
    print(f"largest |clean-a - clean-b| {largest_difference(a, b):.3g}")
    print(f"largest |clean-a - faults| {largest_difference(a, resumed):.3g}")
    workers = 2 if strategy == "fsdp" else 1
    cpu = spec_for(root, faults, use, gpu=False, epochs=6, workers=workers)
    attempts_until_done(cpu, f"3 continued on CPU from step {step}, {workers} worker(s)")


#: Dense bf16 peak FLOP/s by GPU name (the vendors' data sheets, without sparsity).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12}
#: The LM check's model: nanoGPT's shakespeare_char size.
LM_SIZE = {"layers": 6, "heads": 6, "width": 384}


def lm_spec(root: str, gpu: bool = True, size: dict[str, int] | None = None) -> RunSpec:
    kwargs = [f"model.kwargs.{k}={v}" for k, v in (size or LM_SIZE).items()]
    return load_spec(
        "examples/lm_gpt.yaml",
        [
            f"run.name=lm-{'gpu' if gpu else 'cpu'}",
            f"run.storage={root}",
            "scaling.num_workers=1",
            f"scaling.use_gpu={'true' if gpu else 'false'}",
            f"precision={'bf16' if gpu else 'fp32'}",
            "data.batch_size=64",
            "model.kwargs.dropout=0.0",
            *kwargs,
        ],
    )


def lm_check(root: str, gpu: bool = True, size: dict[str, int] | None = None) -> dict[str, float]:
    """Tokens/s of the training steps (``timings.step_s``) and the model FLOPs utilization."""
    from examples.lm_gpt import build

    spec = lm_spec(root, gpu, size)
    assert spec.model is not None and spec.data is not None
    result = run_attempt(spec)
    tokens = 96  # examples.lm_gpt:crop keeps 3/4 of each 128-token row
    per_s = result.timings["num_steps"] * spec.data.batch_size * tokens / result.timings["step_s"]
    kwargs = spec.model.kwargs
    params = sum(p.numel() for p in build(**kwargs).parameters())
    flops = 6 * params + 12 * kwargs["layers"] * kwargs["width"] * tokens
    name = torch.cuda.get_device_name(0) if gpu else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    found = {"tokens_per_s": per_s, "params": params, "steps": result.timings["num_steps"]}
    if peak is not None:
        found["mfu"] = per_s * flops / peak
    print(f"-- lm on {name}: {found}")
    return found


def main() -> None:
    root = sys.argv[1] if len(sys.argv) > 1 else "/tmp/relaytrain-gpu-check"
    strategies = sys.argv[2:] or ["ddp", "fsdp"]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    ray.init(num_cpus=8, num_gpus=1, include_dashboard=False, log_to_driver=False)
    seen: set[str] = set()
    stop = threading.Event()
    threading.Thread(target=watch_gpu, args=(seen, stop), daemon=True).start()
    for strategy in strategies:
        if strategy == "lm":
            lm_check(root)
        else:
            check(root, strategy)
    stop.set()
    print("GPU processes seen while training:", sorted(seen))
    ray.shutdown()


if __name__ == "__main__":
    main()
