"""The run specification: what a run is, validated once at the edge, frozen.

- ``run_spec``: ``RunSpec`` and its sections, ``build_spec`` (YAML, ``--set``, flow
  parameters), the identity that decides whether a run directory can be resumed.

May import: ``errors``.
"""
