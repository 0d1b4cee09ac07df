"""What a checkpoint must hold for resume to be exact, as bytes; early stopping's state.

Everything here is plain torch, loadable with ``torch.load(..., weights_only=True)``: storage is
not trusted code, so no pickled Python objects beyond tensors and primitive containers.
"""

from __future__ import annotations

import contextlib
import io
import math
import pickle
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from trainer_core.errors import CheckpointCorruptError
from trainer_core.spec.optimization import EarlyStoppingSection


def save(value: Any, stream: Any) -> None:
    """Serialize ``value`` into a writable stream (the format ``from_bytes`` reads).

    Without the zip records' CRC-32 (a quarter of torch.save's time): the manifest's digest of
    the whole file already proves it intact, and ``torch.load`` does not need it.
    """
    with _no_crc32():
        torch.save(value, stream)


@contextlib.contextmanager
def _no_crc32() -> Iterator[None]:
    from torch.utils.serialization import config

    before = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        yield
    finally:
        config.save.compute_crc32 = before


def to_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes) -> Any:
    """Tensors and plain containers only: a pickle that would build any other object (run
    code) is refused as a corrupt checkpoint, and resume falls back to an older one."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        raise CheckpointCorruptError(
            f"checkpoint file refused: it is not plain tensor data ({str(e).splitlines()[0]})"
        ) from e


def capture_rng() -> dict[str, Any]:
    """The python, numpy and torch RNG states of this process."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, torch.from_numpy(np.asarray(keys).copy()), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current GPU's (dropout on a GPU)
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy(), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    # A GPU run's checkpoint resumed on a CPU has no GPU to restore; the reverse, none saved.
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def rng_to_send(state: Any) -> Any:
    """``capture_rng``'s state with numpy arrays for its tensors, to pickle across ranks
    (``dist.gather_object`` cannot unpickle a tensor's storage in this torch); ``rng_received``
    turns it back."""
    if isinstance(state, torch.Tensor):
        return ("tensor", state.numpy().copy())
    if isinstance(state, dict):
        return {k: rng_to_send(v) for k, v in state.items()}
    if isinstance(state, list):
        return [rng_to_send(v) for v in state]
    return state


def rng_received(state: Any) -> Any:
    if isinstance(state, tuple) and len(state) == 2 and state[0] == "tensor":
        return torch.from_numpy(state[1])
    if isinstance(state, dict):
        return {k: rng_received(v) for k, v in state.items()}
    if isinstance(state, list):
        return [rng_received(v) for v in state]
    return state


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass
class EarlyStopping:
    """Early stopping's state, checkpointed in the manifest so a retry keeps its patience.

    ``update`` is called with the metric measured at the end of each epoch. Pure.
    """

    best: float | None = None
    #: Epochs completed when ``best`` was measured, and since then without improvement.
    best_epoch: int = 0
    bad_epochs: int = 0
    #: Why training stopped (None: it did not).
    stopped: str | None = None

    def update(self, section: EarlyStoppingSection, epochs_done: int, value: float | None) -> bool:
        """Take the metric measured after ``epochs_done`` epochs; True when training stops."""
        if value is None:  # not measured (no validation rows on this split): no verdict
            return False
        if math.isfinite(value) and (self.best is None or _improves(value, self.best, section)):
            self.best, self.best_epoch, self.bad_epochs = value, epochs_done, 0
            return False
        self.bad_epochs += 1  # no improvement, or not a number
        if self.bad_epochs < section.patience:
            return False
        best = (
            "none finite" if self.best is None else f"{self.best:.6g} after epoch {self.best_epoch}"
        )
        self.stopped = (
            f"early stopping after epoch {epochs_done}: {section.metric} has not improved by "
            f"more than {section.min_delta} ({section.mode}) for {self.bad_epochs} epoch(s); "
            f"best {best}"
        )
        return True

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, value: dict[str, Any] | None) -> EarlyStopping:
        return cls(**value) if value else cls()


def _improves(value: float, best: float, section: EarlyStoppingSection) -> bool:
    if section.mode == "min":
        return value < best - section.min_delta
    return value > best + section.min_delta


class NoSchedule:
    """What a loop without a learning-rate schedule checkpoints in its place."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
