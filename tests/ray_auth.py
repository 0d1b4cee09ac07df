"""Ray's token auth, as every cluster the tests and the adversary start uses it: what Ray 2.60
turns on for a new local cluster (``ray.init`` sets ``RAY_AUTH_MODE=token`` in its own process
and makes ``~/.ray/auth_token`` if missing; children inherit both). Ray reads the mode when it is
first imported, so this module imports Ray only inside ``ensure_token``."""

from __future__ import annotations

import os


def token_mode() -> None:
    """Token auth for this process and its children, unless the environment says otherwise."""
    os.environ.setdefault("RAY_AUTH_MODE", "token")


def ensure_token() -> None:
    """The token file every cluster and client reads, made once if missing (by one process: two
    writing it at once could leave them disagreeing)."""
    from ray._private.authentication.authentication_token_setup import (
        ensure_token_if_auth_enabled,
    )

    ensure_token_if_auth_enabled()
