"""Storage: where a run lives, on any store pyarrow or fsspec can reach.

- ``locations``: URI -> filesystem + path (``resolve``, ``Location``), reads and writes with
  their failures classified and retried (``call``), the credentials the environment carries.
  This package's face: ``from trainer_core import storage`` gives its names.
- ``lazyfs``: a filesystem Ray Train can carry to its processes before they have credentials.
- ``conditional_write``: compare-and-swap writes of a small record (the run lease).

May import: ``errors``.
"""

from trainer_core.storage.locations import *  # noqa: F403  (the package's face)
