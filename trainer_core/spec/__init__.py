"""The run specification: what a run is, validated once at the edge, frozen.

- ``run_spec``: ``RunSpec``, the whole spec, its rules across sections, and the identity
  that decides whether a run directory can be resumed.
- ``sections``: what a run trains (run, model, data) and the rules every section shares.
- ``optimization``: how it is optimized (the optimizer, the LR schedule, early stopping).
- ``operations``: how it is carried out (scaling, checkpoint, report, tracking, retries,
  faults).
- ``loops``: which loop a spec runs (built-in, a Ray Train loop of the user's own, one on
  relaytrain's API) and the sections each needs.
- ``imports``: what the spec names by import path, resolved (``import_object``).
- ``overrides``: a spec from YAML, ``--set`` overrides and flow parameters (``build_spec``,
  ``load_spec``), with errors that name the field.

May import: ``errors``.
"""
