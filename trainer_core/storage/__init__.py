"""Storage: where a run lives, on any store pyarrow or fsspec can reach.

- ``locations``: a place in storage (``Location``): reads and writes with their failures
  classified and retried (``call``), the credentials the environment carries.
- ``torn_reads``: a small file another process rewrites in place, read whole (``untorn``).
- ``uris``: a URI to a ``Location`` (``resolve``): the one place that parses storage URIs.
- ``failures``: what a failed call means for the run (``storage_error``).
- ``lazyfs``: a filesystem Ray Train can carry to its processes before they have credentials.
- ``conditional_write``: compare-and-swap writes of a small record (the run lease).

The package's face: ``from trainer_core import storage`` gives the names of ``locations``,
``torn_reads``, ``uris`` and ``failures``.

May import: ``errors``.
"""

from trainer_core.storage.failures import *  # noqa: F403
from trainer_core.storage.locations import *  # noqa: F403
from trainer_core.storage.torn_reads import *  # noqa: F403
from trainer_core.storage.uris import *  # noqa: F403
