"""The Parquet forms' validation and test sets of their own (``data.validation``,
``data.test``: a Parquet path or URI each): every row of each is held out, read in the training
set's columns through the same reader; the training set is then trained whole (no rows split
off by hash). Each is pinned in the run's snapshot like the training set (``dataset.json``'s
``held``), so a later attempt reads the files it began with."""

from __future__ import annotations

from trainer_core import storage
from trainer_core.data.dataset_snapshot import Source
from trainer_core.spec.sections import DataSection

#: The held-out sets a spec may name, in the order they are pinned.
HELD = ("validation", "test")


def held_names(data: DataSection) -> list[str]:
    """The Parquet held-out sets ``data`` names (none for the Dataset form, whose sets are
    functions)."""
    if data.torch_dataset:
        return []
    return [name for name in HELD if getattr(data, name) is not None]


def held_view(data: DataSection, name: str) -> DataSection:
    """``data`` as the reader of held-out set ``name`` reads it: its files, every row a
    validation row (no spec says 1.0: the copy is not validated)."""
    uri = getattr(data, name)
    assert uri is not None
    return data.resolved().model_copy(
        update={"dataset": uri, "validation": None, "test": None, "validation_fraction": 1.0}
    )


def source(data: DataSection, name: str) -> Source:
    """Where held-out set ``name`` resolves from this process, for its snapshot."""
    uri = getattr(data, name)
    assert uri is not None
    return Source(f"data.{name}", uri, storage.resolve(uri))
