"""The step-time breakdown on one GPU, by hand (CI has no GPU):
``python tools/gpu_step_time.py [STORAGE] [loops|cost|allreduce ...]`` (all three when none is
named). Needs what tools/gpu_check.py needs; run it from the checkout's root. Without a GPU it
runs the same checks on the CPU (a dry run of the script, not of the CUDA path).

What the CPU tests cannot reach is the CUDA-event path of ``train.step_clock``: on a GPU each
part is a pair of CUDA events, resolved once at the report window's end. It prints:

1. ``loops``: the built-in loop (examples/digits_cnn.yaml), a loop of your own
   (examples/own_loop.yaml) and the vision example on PNG files (examples/vision_resnet.yaml),
   each on one GPU: ``relaytrain show --time``, and over every report window the parts it
   measured (all but ``other``, the remainder) against the window's wall time.
2. ``cost``: the built-in loop's steps with the breakdown and with ``report.step_time: false``,
   alternated, twice each: the breakdown's cost per step, against the reporting budget (2% of
   step time, as ``bench.reporting`` holds it on the CPU).
3. ``allreduce``: two processes on the one GPU, DDP over gloo (NCCL cannot put two ranks on one
   GPU), rank 1 sleeping SLEEP_S before each backward. Rank 0's ``allreduce_wait``, timed by
   CUDA events from DDP's communication hook, must hold the sleep; rank 1's must not.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any

import ray
import torch

from flows.cli import main as cli
from trainer_core import storage
from trainer_core.checkpoint.history import read_metrics_history
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.run.engine import run_attempt
from trainer_core.spec.overrides import load_spec
from trainer_core.step_time import PARTS

GPU = torch.cuda.is_available()
#: Rank 1's sleep before each backward in the ``allreduce`` check.
SLEEP_S = 0.05
#: A window's measured parts may exceed its wall time by this share (the events' own spacing).
OVER = 0.02

LOOPS = {
    "built-in loop": ("examples/digits_cnn.yaml", ["schedule.epochs=3"]),
    "own loop": ("examples/own_loop.yaml", ["schedule.epochs=3"]),
    "vision (PNG files)": ("examples/vision_resnet.yaml", ["schedule.epochs=2"]),
}


def loop_spec(root: str, path: str, name: str, *overrides: str) -> Any:
    return load_spec(
        path,
        [
            f"run.name={name}",
            f"run.storage={root}",
            "scaling.num_workers=1",
            f"scaling.use_gpu={'true' if GPU else 'false'}",
            *overrides,
        ],
    )


def windows_against_wall(run_uri: str) -> dict[str, float]:
    """Over the run's report windows and ranks: the largest share by which the measured parts
    exceed the window's wall time, and the remainder (``other``) as a share of all the time."""
    history = read_metrics_history(RunDirectory(storage.resolve(run_uri)))
    over, wall, other, count = 0.0, 0.0, 0.0, 0
    for row in history:
        if not isinstance(row.get("step_time"), dict):
            continue
        for figures in row["step_time"]["ranks"]:
            measured = sum(figures[1 + i] for i, name in enumerate(PARTS) if name != "other")
            over = max(over, measured / figures[0] - 1.0)
            wall += figures[0]
            other += figures[1 + PARTS.index("other")]
            count += 1
    return {"windows": count, "largest_over": over, "other_share": other / wall if wall else 0.0}


def loops(root: str) -> None:
    for label, (path, overrides) in LOOPS.items():
        name = "time-" + label.split()[0]
        spec = loop_spec(root, path, name, *overrides)
        started = time.time()
        result = run_attempt(spec)
        print(
            f"\n-- {label}: {result.status} at step {result.steps_completed}, "
            f"{time.time() - started:.1f} s"
        )
        run_uri = storage.resolve(root).child(name).uri
        cli(["show", run_uri, "--time"])
        found = windows_against_wall(run_uri)
        verdict = "ok" if found["windows"] and found["largest_over"] <= OVER else "FAILED"
        print(f"windows against their wall time: {found} ({verdict}: parts over wall <= {OVER})")


def cost(root: str) -> None:
    """Seconds per step (``Timings.step_s``: the step's h2d, forward, backward and optimizer)
    with the breakdown and without, alternated."""
    per_step: dict[bool, list[float]] = {True: [], False: []}
    for repetition in range(2):
        for timed in (True, False):
            name = f"cost-{'on' if timed else 'off'}-{repetition}"
            spec = loop_spec(
                root,
                "examples/digits_cnn.yaml",
                name,
                "schedule.epochs=8",
                f"report.step_time={'true' if timed else 'false'}",
            )
            t = run_attempt(spec).timings
            per_step[timed].append(t["step_s"] / t["num_steps"])
            print(f"{name}: {1000 * per_step[timed][-1]:.3f} ms a step over {t['num_steps']}")
    on, off = min(per_step[True]), min(per_step[False])
    print(
        f"\n-- cost: best of 2, {1000 * on:.3f} ms a step timed, {1000 * off:.3f} untimed: "
        f"{on / off - 1:+.2%} (budget: reporting <= 2% of step time)"
    )


def _allreduce_rank(rank: int, port: int, steps: int, queue: Any) -> None:
    import torch.distributed as dist
    from torch import nn

    from trainer_core.execution.worker_group import Timings
    from trainer_core.train.step_clock import StepClock

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    device = torch.device("cuda:0" if GPU else "cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 10)).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[0] if GPU else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    clock = StepClock(device, Timings())
    clock.watch_allreduce(ddp)
    x = torch.randn(256, 512, device=device)
    y = torch.randint(0, 10, (256,), device=device)
    windows = []
    for step in range(1, steps + 1):
        with clock.part("forward_backward"):
            loss = nn.functional.cross_entropy(ddp(x), y)
            if rank == 1:
                time.sleep(SLEEP_S)
            loss.backward()
        with clock.part("optimizer"):
            optimizer.step()
            optimizer.zero_grad()
        if step % 5 == 0 and step > 5:  # the first window holds CUDA's warm-up
            windows.append((5, clock.window()))
        elif step == 5:
            clock.window()
    queue.put((rank, windows))
    dist.barrier()
    dist.destroy_process_group()


def allreduce() -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    ranks = [context.Process(target=_allreduce_rank, args=(r, port, 30, queue)) for r in (0, 1)]
    for p in ranks:
        p.start()
    found = dict(queue.get(timeout=300) for _ in ranks)
    for p in ranks:
        p.join(timeout=60)
    wait = PARTS.index("allreduce_wait") + 1
    print(
        f"\n-- all-reduce wait from DDP's hook on {'cuda' if GPU else 'cpu'}, "
        f"rank 1 sleeping {1000 * SLEEP_S:.0f} ms a step (ms a step, per window)"
    )
    for rank in (0, 1):
        for steps, figures in found[rank]:
            parts = {n: round(1000 * figures[1 + i] / steps, 2) for i, n in enumerate(PARTS)}
            print(f"rank {rank}: step {1000 * figures[0] / steps:.2f} {parts}")
    fast = [f[wait] / s for s, f in found[0]]
    slow = [f[wait] / s for s, f in found[1]]
    ok = min(fast) > 0.8 * SLEEP_S and max(slow) < 0.3 * SLEEP_S
    print(
        f"rank 0 waits {1000 * min(fast):.1f}-{1000 * max(fast):.1f} ms, rank 1 "
        f"{1000 * min(slow):.1f}-{1000 * max(slow):.1f} ms: {'ok' if ok else 'FAILED'} "
        f"(rank 0 over {0.8 * 1000 * SLEEP_S:.0f}, rank 1 under {0.3 * 1000 * SLEEP_S:.0f})"
    )


def main() -> None:
    root = sys.argv[1] if len(sys.argv) > 1 else "/tmp/relaytrain-gpu-step-time"
    checks = sys.argv[2:] or ["loops", "cost", "allreduce"]
    name = torch.cuda.get_device_name(0) if GPU else "no GPU: the CPU path"
    print(f"torch {torch.__version__}, {name}")
    if "allreduce" in checks:
        allreduce()  # before Ray's workers take the GPU
    if {"loops", "cost"} & set(checks):
        ray.init(num_cpus=8, num_gpus=1 if GPU else 0, include_dashboard=False, log_to_driver=False)
        if "loops" in checks:
            loops(root)
        if "cost" in checks:
            cost(root)
        ray.shutdown()


if __name__ == "__main__":
    main()
