"""The built-in loop's data: Parquet read a row group at a time, in a worker-count-independent
order, from a pinned snapshot.

- ``arrays``: typed arrays from Arrow tables, the built-in datasets, the dataset's layout.
- ``stream``: a dataset's layout from metadata, and the rows one rank reads at each step.
- ``row_slices``: row groups read in slices of bounded size (``data.memory_mb``).
- ``sample_order``: which sample each rank trains on at each step.
- ``dataset_snapshot``: the run's pinned snapshot of its files (``dataset.json``).

May import: ``errors``, ``storage``, ``spec``.
"""
