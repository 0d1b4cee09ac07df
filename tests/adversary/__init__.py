"""A seeded adversary: whole scenarios of real use, faults and damage drawn from one integer
seed, driven through relaytrain's public surface and judged by oracles that do not share its
rules (after FoundationDB's simulation tests, TigerBeetle's VOPR and Jepsen).

- ``scenario``: the seed's scenario (a spec, its data as a writer makes it, a history of
  operator actions, each with at most one fault or damage), as plain values that print and
  replay;
- ``data``: the Parquet table a scenario trains on, and the damage done to it;
- ``world``: what scenarios share (a Prefect server, a Ray head and a worker node to lose, a
  moto S3 server behind a proxy that plays an outage or a full store);
- ``drive``: the history played against ``relaytrain run/show/export``, as a user's shell
  would, and what each command did (``interrupt``: the faults that come while a command runs);
- ``spec``: the run spec a scenario's commands run, its shape as the YAML a user writes (and
  ``user/adversary_user.py``: the user's own model, transform and loop it names);
- ``reference``: the same history without its faults, once per scenario shape (cached);
- ``oracles``: what must hold after a scenario, each a check of its own (``scoring``: the
  checkpoints' weights scored on a validation file; ``verdict``: what a broken one reports);
- ``shrink``: the smallest history that still breaks a guarantee;
- ``cover``: the seeds `make test` plays, the cheapest that touch every action and fault.

``tools/adversary.py`` runs a campaign (``make adversary``) and replays one seed.
"""
