"""The built-in loop's data: Parquet read a row group at a time, in a worker-count-independent
order, from a pinned snapshot.

- ``arrays``: typed arrays from Arrow tables, the built-in datasets, the dataset's layout.
- ``footers``: a dataset's layout from its Parquet footers (files, row groups, columns).
- ``stream``: the rows of a layout, read a row group (or slice) at a time (``Reader``), and
  ``describe``: features, outputs and label statistics.
- ``rank_stream``: what one rank reads: each epoch's batches, read ahead, and its validation
  rows.
- ``row_slices``: row groups read in slices of bounded size (``data.memory_mb``).
- ``sample_order``: which sample each rank trains on at each step.
- ``dataset_snapshot``: the run's pinned snapshot of its files (``dataset.json``).

May import: ``errors``, ``storage``, ``spec``.
"""
