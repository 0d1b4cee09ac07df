"""A multi-node local Ray cluster driven through Ray's Jobs API, with the runs on S3.

One head node (no CPUs; the job server on 127.0.0.1) and three one-CPU worker nodes, each its
own raylet (tests/multinode.py), shared by this package's modules (conftest.py). The two DDP
workers are spread across nodes; the train task submits every attempt as a Ray job and follows
it.

- ``test_jobs``: a worker node killed (fault matrix 3), a node drained for preemption and then
  reclaimed (8), the flow process killed while its job runs (re-running attaches to the job
  instead of starting a second one), a cancel through Prefect;
- ``test_resizing_and_chaos`` (named to run after ``test_jobs``, the order these tests have
  always run in on the one cluster): an elastic group that shrinks and grows back, a drain
  notice answered with a checkpoint just in time, and the seeded chaos campaign.
"""
