"""Sweeps: many trials of a run spec, each a relaytrain run with every guarantee, searched and
pruned by Optuna (``spec``: the sweep spec; ``space``: its search space)."""
