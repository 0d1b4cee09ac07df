"""A run across its attempts, driven from the driver: the attempt, its record, the lease, the
retry decision, the result, and what a storage holds.

- ``engine``: one attempt: the Ray Train fit after the preflight, the attempt's record, its
  result.
- ``preflight``: what the driver checks before an attempt, and the dataset it trains on (the
  run's pinned snapshot).
- ``plan``: the run directory and the attempt's plan: fresh start or resume, and why.
- ``live_state``: what the driver knows of a running attempt, from its workers' events.
- ``jobs``: attempts as Ray jobs on a remote cluster: submitted, followed, re-attached.
- ``job_entry``: the job's side: the attempt's driver inside the cluster.
- ``attempts``: the attempt records (``attempts.jsonl``).
- ``lease``: one live flow drives a run at a time (``lock.json``).
- ``retry``: retry or stop, from the error and the records.
- ``summary``: the typed result, finalize.
- ``time_account``: where the run's time went (goodput, restarts, stragglers, advice).
- ``report``: what a person reads: the per-epoch table and the markdown summary.
- ``epochs``: how epochs are numbered to a person (from 1), whatever the stored indexing.
- ``catalog``: the runs a storage holds, read from their directories alone.

May import: every package below it (all of ``trainer_core`` but ``sweep``).
"""
