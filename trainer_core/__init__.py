"""relaytrain's core: what a training run is and how it survives failure (no Prefect here)."""

__version__ = "0.1.0"
