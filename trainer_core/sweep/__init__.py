"""Sweeps: many trials of a run spec, each a relaytrain run with every guarantee, searched and
pruned by Optuna.

- ``spec``: the sweep spec (a run spec with a ``sweep:`` section), refused whole at setup.
- ``space``: its search space, as Optuna's distributions.
- ``sampling``: each trial's values, drawn by its number.
- ``pruning``: which trials go on, decided at points their numbers fix.
- ``trials``: where each trial stands, read from its run directory alone.
- ``schedule``: what the sweep runs next, a function of where its trials stand.
- ``result``: the SweepResult; ``plot``: its picture.
- ``directory``: the sweep's own directory (its spec, its result, the study's journal).

May import: ``errors``, ``numbers``, ``spec``, ``storage``, ``checkpoint``, ``run``,
``tracking``.
"""
