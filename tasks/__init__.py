"""Thin Prefect tasks over trainer_core: setup, train, finalize."""

from tasks.finalize import finalize
from tasks.setup import Prepared, setup
from tasks.train import train

__all__ = ["Prepared", "finalize", "setup", "train"]
