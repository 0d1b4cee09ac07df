"""One-off conversion of scikit-learn's digits.csv.gz into trainer_core/builtin_data/digits.parquet.

Usage: python tools/make_digits_parquet.py PATH/TO/digits.csv.gz
(the file is inside the scikit-learn wheel at sklearn/datasets/data/digits.csv.gz).
"""

import gzip
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

with gzip.open(sys.argv[1]) as source:
    raw = np.loadtxt(source, delimiter=",")
pixels = raw[:, :64].astype(np.float32)
labels = raw[:, 64].astype(np.int64)
table = pa.table(
    {
        "pixels": pa.FixedSizeListArray.from_arrays(pa.array(pixels.ravel()), 64),
        "label": pa.array(labels),
    }
)
pq.write_table(table, "trainer_core/builtin_data/digits.parquet", compression="zstd")
