"""Workloads for tests that need training to last long enough to be interrupted."""

import json
import os
import time
from pathlib import Path

from torch import nn

from trainer_core.train.workloads import MLP


class SlowMLP(MLP):
    """The MLP, each training forward pass ``delay_s`` slower, and held while the file
    ``hold_while`` exists in a worker of a process group, once ``hold_after`` training forward
    passes have run in it (a test's gate: the job waits on its nodes until the test removes it,
    while setup's checks and the commits of steps already reported go on; the weights are
    those of the MLP whatever the timing)."""

    def __init__(
        self,
        num_inputs: int,
        num_outputs: int,
        delay_s: float = 0.02,
        hold_while: str = "",
        hold_after: int = 0,
        **kwargs,
    ):
        super().__init__(num_inputs, num_outputs, **kwargs)
        self.delay_s = delay_s
        self.hold_while = hold_while
        self.hold_after = hold_after
        self.forwards = 0

    def forward(self, x):
        import torch.distributed as dist

        if self.training:
            time.sleep(self.delay_s)
            held = self.hold_while and dist.is_initialized() and self.forwards >= self.hold_after
            while held and os.path.exists(self.hold_while):
                time.sleep(0.1)
            self.forwards += 1
        return super().forward(x)


def slow_mlp(num_inputs: int, num_outputs: int, **kwargs) -> nn.Module:
    return SlowMLP(num_inputs, num_outputs, **kwargs)


class RecordingMLP(MLP):
    """An MLP over features 1.. that records feature 0, each row's id, of every training
    forward pass in a worker: one JSON line ``{"rank", "world_size", "ids", "time"}`` a
    micro-batch, in ``log_dir/<pid>.jsonl`` (what a rank trained on, in order); each training
    forward pass first sleeps ``delay_s``."""

    def __init__(
        self, num_inputs: int, num_outputs: int, log_dir: str = "", delay_s: float = 0, **kwargs
    ):
        super().__init__(num_inputs - 1, num_outputs, **kwargs)
        self.log_dir = log_dir
        self.delay_s = delay_s

    def forward(self, x):
        import torch.distributed as dist

        if self.training and dist.is_initialized():
            time.sleep(self.delay_s)
            line = {
                "rank": dist.get_rank(),
                "world_size": dist.get_world_size(),
                "ids": [int(i) for i in x[:, 0].tolist()],
                "time": time.time(),
            }
            with open(Path(self.log_dir) / f"{os.getpid()}.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
        return super().forward(x[:, 1:])


def recording_mlp(num_inputs: int, num_outputs: int, **kwargs) -> nn.Module:
    return RecordingMLP(num_inputs, num_outputs, **kwargs)


class OverflowingMLP(MLP):
    """An MLP whose training forward passes number ``at_forward`` to ``at_forward + times - 1``
    (counted from 1 in each worker process) on rank ``rank`` add 1e5 to its output: under fp16
    autocast that is beyond fp16's range (65504), so the output and the loss are inf, while the
    same sum in fp32 is finite."""

    def __init__(
        self,
        num_inputs: int,
        num_outputs: int,
        at_forward: int = 1,
        times: int = 1,
        rank: int = 0,
        **kwargs,
    ):
        super().__init__(num_inputs, num_outputs, **kwargs)
        self.at_forward, self.times, self.rank = at_forward, times, rank
        self.forwards = 0

    def forward(self, x):
        import torch.distributed as dist

        output = super().forward(x)
        if self.training and dist.is_initialized() and dist.get_rank() == self.rank:
            self.forwards += 1
            if self.at_forward <= self.forwards < self.at_forward + self.times:
                output = output + 1e5
        return output


def overflowing_mlp(num_inputs: int, num_outputs: int, **kwargs) -> nn.Module:
    return OverflowingMLP(num_inputs, num_outputs, **kwargs)


class BatchNormMLP(nn.Module):
    """Linear, BatchNorm1d, ReLU, Linear: running statistics that each rank's training forward
    passes update from its own slice of the batch."""

    def __init__(self, num_inputs: int, num_outputs: int, hidden: int = 16):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(num_inputs, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_outputs),
        )

    def forward(self, x):
        return self.net(x)


def batchnorm_mlp(num_inputs: int, num_outputs: int, **kwargs) -> nn.Module:
    return BatchNormMLP(num_inputs, num_outputs, **kwargs)


class StepLogMLP(MLP):
    """The built-in MLP (the same parameters and arithmetic, so the same run) that logs every
    training forward pass of a worker, one JSON line ``{"rank", "world_size", "time"}`` in
    ``log_dir/<pid>.jsonl``. On rank ``kill_rank``, at its ``kill_at``-th training forward pass
    (once per ``log_dir``: a ``killed`` marker), it pauses ``pause_s``, so that the other ranks
    are waiting in the step's gradient all-reduce, then SIGKILLs its own process, before logging
    that pass: a rank's lines are the steps it completed (a step's forward pass follows the
    previous step's update)."""

    def __init__(
        self,
        num_inputs: int,
        num_outputs: int,
        log_dir: str = "",
        kill_at: int = 0,
        kill_rank: int = 0,
        pause_s: float = 1.0,
        **kwargs,
    ):
        super().__init__(num_inputs, num_outputs, **kwargs)
        self.log_dir = log_dir
        self.kill_at, self.kill_rank, self.pause_s = kill_at, kill_rank, pause_s
        self.forwards = 0

    def forward(self, x):
        import signal

        import torch.distributed as dist

        if self.training and dist.is_initialized():
            self.forwards += 1
            rank = dist.get_rank()
            marker = Path(self.log_dir) / "killed"
            if rank == self.kill_rank and self.forwards == self.kill_at and not marker.exists():
                marker.write_text(str(os.getpid()))
                time.sleep(self.pause_s)
                os.kill(os.getpid(), signal.SIGKILL)
            line = {"rank": rank, "world_size": dist.get_world_size(), "time": time.time()}
            with open(Path(self.log_dir) / f"{os.getpid()}.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
        return super().forward(x)


def step_log_mlp(num_inputs: int, num_outputs: int, **kwargs) -> nn.Module:
    return StepLogMLP(num_inputs, num_outputs, **kwargs)


def steps_by_process(log_dir: str | Path, rank: int = 0) -> list[int]:
    """What ``StepLogMLP`` logged: the training steps each process of ``rank`` completed, in
    the order the processes started."""
    counts = []
    for path in Path(log_dir).glob("*.jsonl"):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        if lines and lines[0]["rank"] == rank:
            counts.append((lines[0]["time"], len(lines)))
    return [count for _, count in sorted(counts)]


def own_loop_that_returns_at(config: dict) -> None:
    """examples/own_loop.py's loop, which returns after reporting step ``config["stop_at"]``
    the first time through (a marker file says it did), holding one more batch it never
    trains or reports: its ``batches()`` ends there, as a ``break`` out of it would. Every rank
    returns at the same step, as a DDP loop's ranks must."""
    from examples.own_loop import train
    from trainer_core.train import own_loop

    run = own_loop.session()
    stops = not Path(config["marker"]).exists()  # decided before training, alike on every rank
    every_batch = run.batches

    def batches():
        for batch in every_batch():
            if stops and run.step == config["stop_at"]:
                if run.rank == 0:
                    Path(config["marker"]).write_text("returned")
                return
            yield batch

    run.batches = batches  # type: ignore[method-assign]
    train(config)


#: What ``slow_crop`` sleeps per row.
SLOW_TRANSFORM_S = 0.008


def slow_crop(row: dict, rng) -> dict:
    """examples/lm_gpt.py's ``crop`` after a sleep: a transform too slow to keep the step fed."""
    from examples.lm_gpt import crop

    time.sleep(SLOW_TRANSFORM_S)
    return crop(row, rng)
