"""Rows of the columns form (``data.columns``): an Arrow table of any column types, carried as
it is from the Parquet files to ``data.transform``.

It has the tabular form's ``Arrays`` interface, which the reader is written against: ``take``
rows, ``take_parts`` of several row groups into their places (a shuffle window's gather),
``slice`` and ``join`` runs of gathered rows (a batch), and ``save``/``load`` a decoded slice to
and from the spill directory (Arrow IPC, memory-mapped when read back).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather

from trainer_core.data.arrays import Arrays
from trainer_core.spec.sections import DataSection


@dataclass(frozen=True)
class TableRows:
    table: pa.Table

    @staticmethod
    def from_table(table: pa.Table, data: DataSection) -> TableRows:
        """``data.columns`` of a table read from the dataset, in their order."""
        assert data.columns is not None
        return TableRows(table.select(data.columns).combine_chunks())

    def __len__(self) -> int:
        return int(self.table.num_rows)

    def take(self, index: np.ndarray) -> TableRows:
        return TableRows(self.table.take(pa.array(np.asarray(index, dtype=np.int64))))

    def slice(self, start: int, stop: int) -> TableRows:
        """Rows ``start..stop - 1`` (no copy)."""
        return TableRows(self.table.slice(start, stop - start))

    @staticmethod
    def join(parts: list[TableRows]) -> TableRows:
        """The parts' rows one after another."""
        return TableRows(pa.concat_tables([p.table for p in parts]).combine_chunks())

    def rows(self) -> list[dict[str, Any]]:
        """Each row as a dict of its columns' Python values (binary as bytes, lists as lists)."""
        return self.table.to_pylist()

    def columns(self) -> dict[str, list[Any]]:
        """The rows as a dict of columns, each a list of Python values."""
        return self.table.to_pydict()

    @staticmethod
    def take_parts(
        parts: list[tuple[np.ndarray, TableRows, np.ndarray]], count: int, into: Any = None
    ) -> TableRows:
        """``count`` rows from ``(positions, rows, index)`` parts: rows ``index`` of each part's
        rows go to its positions (``into`` is not reused: Arrow's arrays are immutable)."""
        return TableRows.gather([(where, rows.take(index)) for where, rows, index in parts], count)

    @staticmethod
    def gather(parts: list[tuple[np.ndarray, TableRows]], count: int) -> TableRows:
        """``count`` rows from ``(positions, rows)`` parts: part rows go to their positions."""
        if not parts:
            return TableRows(pa.table({}))
        table = pa.concat_tables([part.table for _, part in parts])
        positions = np.concatenate([where for where, _ in parts])
        assert len(positions) == count
        return TableRows(table.take(pa.array(np.argsort(positions, kind="stable"))))

    @staticmethod
    def save(rows: TableRows, stem: str) -> None:
        feather.write_feather(rows.table, f"{stem}.arrow", compression="uncompressed")

    @staticmethod
    def load(stem: str) -> TableRows:
        return TableRows(feather.read_table(f"{stem}.arrow", memory_map=True))


#: What the reader holds and hands out: the tabular form's arrays or the columns form's table.
Rows = Arrays | TableRows


def rows_type(data: DataSection) -> type[Arrays] | type[TableRows]:
    """The rows ``data``'s form is read as."""
    return TableRows if data.columns_form else Arrays
