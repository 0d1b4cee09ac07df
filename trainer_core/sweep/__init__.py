"""Sweeps: many trials of a run spec, each a relaytrain run with every guarantee, searched and
pruned by Optuna.

- ``spec``: the sweep spec (a run spec with a ``sweep:`` section), refused whole at setup.
- ``space``: its search space, as Optuna's distributions.
- ``sampling``: each trial's values, drawn by its number.
- ``pruning``: which trials go on, decided at points their numbers fix.

May import: ``errors``, ``spec``.
"""
