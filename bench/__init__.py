"""Benchmarks: relaytrain against bare Ray Train and plain PyTorch, side by side in one run.

Each ``python -m bench.<name> [--quick]`` runs its variants alternately in one process tree and
writes ``bench/results/<YYYY-MM-DD>-<name>.json``; ``python -m bench`` rebuilds the tables in
``bench/README.md`` from the newest result of each. ``make bench`` does both. See README.md here.
"""
