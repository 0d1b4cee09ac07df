"""Write examples/data/pydoc_bytes.parquet: a real English text corpus as byte-level token rows.

The corpus is the documentation CPython ships for ``help()`` (``pydoc_data.topics``: 79 topics
of the language reference, about 466 KB; Python Software Foundation License). Its UTF-8 bytes
are the tokens (a vocabulary of 256), packed end to end into rows of ``--seq-len`` tokens: one
fixed-size list column ``tokens`` of uint8, and ``topic`` (the topic the row starts in, a
string), written as pyarrow writes by default (one row group: the reader slices it).

    python tools/make_text_parquet.py [--seq-len 128] [--out examples/data/pydoc_bytes.parquet]
"""

from __future__ import annotations

import argparse
import pydoc_data.topics
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def rows(seq_len: int) -> pa.Table:
    names = sorted(pydoc_data.topics.topics)
    parts = [pydoc_data.topics.topics[name].encode("utf-8") + b"\n\n" for name in names]
    starts = np.cumsum([0, *(len(p) for p in parts)])
    tokens = np.frombuffer(b"".join(parts), dtype=np.uint8)
    count = len(tokens) // seq_len
    packed = tokens[: count * seq_len]
    first_topic = np.searchsorted(starts, np.arange(count) * seq_len, side="right") - 1
    return pa.table(
        {
            "tokens": pa.FixedSizeListArray.from_arrays(pa.array(packed), seq_len),
            "topic": pa.array([names[i] for i in first_topic]),
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", default="examples/data/pydoc_bytes.parquet")
    args = parser.parse_args()
    table = rows(args.seq_len)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, args.out)
    print(f"{args.out}: {table.num_rows} rows of {args.seq_len} byte tokens")


if __name__ == "__main__":
    main()
