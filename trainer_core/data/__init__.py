"""The built-in loop's data: Parquet read a row group at a time, in a worker-count-independent
order, from a pinned snapshot; numbers as they are (the tabular form) or any columns through a
transform (the columns form).

- ``arrays``: the tabular form's rows (features and labels as typed arrays from Arrow tables),
  the built-in datasets, the cursor.
- ``table_rows``: the columns form's rows (``data.columns``: an Arrow table of any types).
- ``transform``: the columns form's batches: each row through ``data.transform`` with its own
  generator keyed by (seed, epoch, row id), in a pool off the training thread, collated.
- ``footers``: a dataset's layout from its Parquet footers (files, row groups, columns).
- ``stream``: the rows of a layout, read a row group (or slice) at a time (``Reader``), and
  ``describe``: features, outputs and label statistics.
- ``rank_stream``: what one rank reads: each epoch's batches, read ahead, and its validation
  rows.
- ``row_slices``: row groups read in slices of bounded size (``data.memory_mb``).
- ``sample_order``: which sample each rank trains on at each step.
- ``dataset_snapshot``: the run's pinned snapshot of its files (``dataset.json``).
- ``damage``: a file whose pages fail their checksums or do not decode, named (not retried).

May import: ``errors``, ``storage``, ``spec``.
"""
