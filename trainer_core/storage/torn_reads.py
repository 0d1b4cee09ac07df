"""Reading a small file that another process rewrites whole, in place (the lease every second,
the attempt records at each attempt's end): a store that overwrites an object in place (NFS,
S3 emulators) can be read mid-write, so what does not parse is read again until it does."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

from trainer_core.errors import StorageUnavailableError
from trainer_core.storage.locations import Location

__all__ = ["TORN_READ_PATIENCE_S", "read_whole", "read_whole_json", "untorn"]

T = TypeVar("T")

#: How long a reader waits for a small record that does not parse to be whole again.
TORN_READ_PATIENCE_S = 2.0


def read_whole_json(location: Location, patience_s: float | None = None) -> Any:
    """A small JSON record that another process rewrites in place (the lease, every second),
    or None when there is none: see ``read_whole``."""
    return read_whole(location, json.loads, patience_s)


def read_whole(
    location: Location, parse: Callable[[bytes], Any], patience_s: float | None = None
) -> Any:
    """``parse`` of a small file that another process rewrites whole (the lease every second,
    the attempt records at each attempt's end), or None when there is none; see ``untorn``."""

    def read() -> Any:
        try:
            return parse(location.read_bytes())
        except FileNotFoundError:  # none (asking first would cost a request per read)
            return None

    return untorn(location, read, patience_s)


def untorn(location: Location, read: Callable[[], T], patience_s: float | None = None) -> T:
    """``read()`` of ``location`` once what it reads parses. A store that overwrites an object
    in place (NFS, S3 emulators) can be read mid-write: what does not parse (a ValueError) is
    read again, and what still does not after ``patience_s`` is a StorageUnavailableError
    (retried), not the reader's own error."""
    patience_s = TORN_READ_PATIENCE_S if patience_s is None else patience_s
    deadline = time.monotonic() + patience_s
    while True:
        try:
            return read()
        except ValueError as e:  # torn: JSONDecodeError, or bytes cut inside a character
            if time.monotonic() >= deadline:
                raise StorageUnavailableError(
                    f"{location.uri} stayed unreadable for {patience_s:.0f} s ({e}): a store "
                    "that overwrites it in place is being written, or it is damaged"
                ) from e
            time.sleep(0.05)
