"""The passes an own loop makes over the run's data, and the order they must come in.

A loop takes the run's batches once, from the cursor to the end of its last epoch, by one of two
shapes: ``batches()``, the whole run as one iterator, or ``epochs()`` with one ``dataloader()``
in each epoch (a script's per-epoch structure kept). Either begins after ``setup()`` (which
restored the cursor) and never twice: a second pass would train the run again. ``Passes``
holds where the loop is in that order and says what was misused; the loop's code, which a
retry would run the same way, so no retry is spent on it (``misuse``: a SpecError naming
``train_loop``).
"""

from __future__ import annotations

from collections.abc import Iterator

from trainer_core.errors import SpecError


def misuse(message: str) -> SpecError:
    """The API used out of order: the loop's code, which a retry would run the same way, so
    no retry is spent on it."""
    return SpecError(f"relaytrain's own-loop API: {message}", field="train_loop")


class Passes:
    """Which pass the loop began, ``epochs()``'s current epoch and whether its ``dataloader()``
    was called."""

    def __init__(self, batch_size: int):
        #: The global batch (``data.batch_size``), which the cursor and checkpoints count.
        self.batch_size = batch_size
        self.began = False
        self.epoch: int | None = None
        self.served = False

    def begin(self, what: str, set_up: bool) -> None:
        """``what`` (``batches()`` or ``epochs()``) begins the run's one pass."""
        if not set_up:
            raise misuse(
                f"{what} before setup(): call setup(model, optimizer, scheduler) first: it "
                "restores the newest checkpoint and the cursor the batches start from"
            )
        if self.began:
            raise misuse(
                f"{what} was called after batches() or epochs() began a pass: either hands "
                "out every batch from the cursor to the end of the run's last epoch, so a second "
                "pass would train the run again. Iterate over one of them for the whole run "
                "(epoch and end_of_epoch say where each batch lies)"
            )
        self.began = True

    def epochs(self, first: int, end: int) -> Iterator[int]:
        """Epochs ``first`` to ``end - 1``, each to be served by one ``dataloader()``."""
        for epoch in range(first, end):
            self.epoch, self.served = epoch, False
            yield epoch
            if not self.served:
                raise misuse(
                    f"epoch {epoch} of epochs() ended without dataloader(): call it once in "
                    "every epoch, for that epoch's batches"
                )

    def serve(self, batch_size: int | None) -> int:
        """``dataloader(batch_size=...)`` in the current epoch: that epoch, once it may."""
        if self.epoch is None:
            raise misuse(
                "dataloader() outside epochs(): iterate `for epoch in run.epochs():` and call "
                "dataloader() in it (or iterate over batches() for the whole run)"
            )
        if self.served:
            raise misuse(
                f"dataloader() was called a second time in epoch {self.epoch}: the first "
                "already hands out every batch of the epoch"
            )
        self.served = True
        if batch_size is not None and batch_size != self.batch_size:
            raise misuse(
                f"dataloader(batch_size={batch_size}): the global batch is data.batch_size "
                f"({self.batch_size}), summed over every worker; the cursor and the checkpoints "
                f"count it. Set data.batch_size: {batch_size} in the spec, or pass none"
            )
        return self.epoch
