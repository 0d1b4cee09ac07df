"""The checkpoints of a session of relaytrain's own-loop API (``own_loop``) and the steps they
count: the restore at ``setup`` (the newest committed checkpoint every rank can verify, or a
fresh start), the optimizer steps done since, and what the next checkpoint records (the cursor
after its step, the newest metrics, the history's rows since the last one).

A step is an optimizer step, as in the built-in loop: with ``optimizer.grad_accumulation`` it
takes that many global batches, and a checkpoint (every ``checkpoint.every`` steps, at each
epoch's end, at a drain's notice) is taken only when one ends, so none holds half a step's
gradients and the cursor always points at a step's first batch."""

from __future__ import annotations

import time
from typing import Any

from trainer_core.checkpoint.manager import CheckpointManager
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.data import arrays as data_mod
from trainer_core.execution.worker_config import WorkerConfig
from trainer_core.execution.worker_group import Relay, all_reduce, share_peak_rss
from trainer_core.spec.run_spec import RunSpec
from trainer_core.train.group_start import resume_candidates
from trainer_core.train.metric_rows import report_row
from trainer_core.train.own_loop_data import BatchPlace


class StepLedger:
    """One rank's optimizer steps and the checkpoints of them."""

    def __init__(self, spec: RunSpec, attempt: int, batch_size: int):
        self.spec, self.attempt, self.batch_size = spec, attempt, batch_size
        #: The steps done (the last one ended), the step this worker group resumed at.
        self.step = 0
        self.resumed_from = 0
        #: Where this worker group's batches begin (the restored checkpoint's cursor).
        self.cursor = data_mod.Cursor(0, 0)
        #: Where the batch after the last step is: the next checkpoint's cursor.
        self.after = data_mod.Cursor(0, 0)
        #: The last step's row (a checkpoint's metrics), and the rows not yet in a checkpoint.
        self.latest: dict[str, Any] = {}
        self.unsaved: list[dict[str, Any]] = []

    def restore(
        self,
        checkpoints: CheckpointManager,
        config: WorkerConfig,
        relay: Relay,
        run_dir: RunDirectory,
        world_size: int,
    ) -> int:
        """Load the newest committed checkpoint every rank can verify (or, with none,
        ``run.init_from``'s weights) and go on from its step and cursor; returns which worker
        group of the attempt this is."""
        group, candidates = resume_candidates(config, relay, run_dir)
        loaded = checkpoints.load(candidates)
        checkpoint = loaded.checkpoint
        if checkpoint is None:
            if self.spec.run.init_from:
                checkpoints.load_weights(self.spec.run.init_from)
            relay.send(
                "fresh_start",
                skipped=loaded.skipped,
                warm_start=self.spec.run.init_from,
                group=group,
                world_size=world_size,
            )
            return group
        self.step = self.resumed_from = checkpoint.step
        relay.completed(checkpoint.step)  # what a failure before the next step tells the driver
        self.cursor = self.after = data_mod.Cursor.from_json(checkpoint.manifest["cursor"])
        self.latest = dict(checkpoint.manifest.get("metrics") or {})
        relay.send(
            "resumed",
            step=checkpoint.step,
            checkpoint_uri=checkpoint.uri,
            skipped=loaded.skipped,
            bytes_read=int(all_reduce([float(loaded.bytes_read)])[0]),
            restore_s=round(loaded.seconds, 4),
            checkpoint_created_at=checkpoint.manifest.get("created_at"),
            group=group,
            world_size=world_size,
        )
        return group

    def record(self, place: BatchPlace, metrics: dict[str, Any]) -> dict[str, Any]:
        """Step ``step`` ended with the batch at ``place``: its row in the history (``batch``
        is the step's place in its epoch, as the built-in loop's rows say)."""
        self.after = place.cursor_after(self.batch_size)
        row = {"step": self.step, "epoch": place.epoch, "batch": place.step_in_epoch}
        row.update(report_row(metrics))
        self.latest = dict(row)
        return row

    def checkpoint_due(self, place: BatchPlace) -> bool:
        """A checkpoint is due after this step: every ``checkpoint.every`` steps and at each
        epoch's end."""
        return self.step % self.spec.checkpoint.every == 0 or place.end_of_epoch

    def report_due(self, place: BatchPlace) -> bool:
        """A report window ends at this step (and a drain's notice is looked for)."""
        return self.checkpoint_due(place) or self.step % self.spec.report.every == 0

    def keep(self, row: dict[str, Any], timing: dict[str, Any]) -> dict[str, Any]:
        """The history's row of the step (``timing``: its window's fields, if it ends one),
        kept for the next checkpoint."""
        kept = {**row, "attempt": self.attempt, "time": time.time(), **timing}
        self.unsaved.append(kept)
        return kept

    def save(self, checkpoints: CheckpointManager, relay: Relay) -> None:
        """Checkpoint the last step: its cursor (not that of a batch handed out since), the
        newest metrics, the rows since the last checkpoint."""
        meta = {"epoch": self.after.epoch, "cursor": self.after.to_json(), "metrics": self.latest}
        rows, self.unsaved = self.unsaved, []
        checkpoints.save(self.step, meta, rows)
        share_peak_rss(relay)
