"""Whether a committed checkpoint's bytes are still the ones its manifest describes.

A listing proves a checkpoint committed and its files of the right sizes; only reading them
proves their digests. A checkpoint is verified once, by whoever reads it whole (a resume that
loads it, finalize), and the verdict is kept beside it (``verdict.json``), keyed by its commit
marker's digest: a checkpoint written again under the same step has a new marker, and its old
verdict no longer counts. A checkpoint whose verdict says damaged is no longer committed for
anyone (``RunDirectory.read_committed`` raises): retention neither keeps it as the newest nor
lets it push sound checkpoints out, and the result, exports and resume skip it. Nothing is
deleted for being damaged: the directory stays for a person to look at.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from trainer_core.checkpoint.files import (
    MARKER_FILE,
    CheckpointInfo,
    file_digest,
    matches,
    sha256_hex,
)
from trainer_core.storage.locations import Location

logger = logging.getLogger("relaytrain.checkpoints")

#: Beside the manifest and marker: what the last whole read of the checkpoint found.
VERDICT_FILE = "verdict.json"
SCHEMA_VERSION = 1


def marker_digest(location: Location) -> str:
    return sha256_hex(location.child(MARKER_FILE).read_bytes())


def stored_verdict(location: Location) -> dict[str, Any] | None:
    """The checkpoint's verdict if it is about its present commit (its marker's digest), else
    None (never verified, or written again since)."""
    try:
        verdict = location.child(VERDICT_FILE).read_json()
        marker = marker_digest(location)
    except (ValueError, FileNotFoundError):
        return None
    if not isinstance(verdict, dict) or verdict.get("marker_sha256") != marker:
        return None
    return verdict


def damage(checkpoint: CheckpointInfo, read: Any) -> str | None:
    """What is wrong with ``checkpoint``'s files (``read(name)``: a file's bytes), or None when
    every file matches its manifest entry."""
    for name, entry in sorted(checkpoint.files.items()):
        try:
            data = read(name)
        except FileNotFoundError:
            return f"{name} is gone"
        if not matches(entry, data):
            return (
                f"{name} does not match its manifest ({len(data)} bytes, digest "
                f"{file_digest(data)[:12]}...)"
            )
    return None


def record(location: Location, ok: bool, reason: str | None = None) -> None:
    """Keep the verdict of a whole read beside the checkpoint (best effort: the next reader
    verifies again if it is lost)."""
    try:
        location.child(VERDICT_FILE).write_json(
            {
                "schema": SCHEMA_VERSION,
                "marker_sha256": marker_digest(location),
                "ok": ok,
                "reason": reason,
                "at": time.time(),
            }
        )
    except (OSError, FileNotFoundError) as e:
        logger.warning("verdict for %s not written: %s", location.uri, e)


def condemn(location: Location, reason: str) -> None:
    """A reader found the checkpoint damaged (``reason`` names the file): say so beside it."""
    logger.warning("checkpoint %s is damaged: %s", location.uri, reason)
    record(location, False, reason)


def verify(
    location: Location, checkpoint: CheckpointInfo, keep: bool = True, again: bool = False
) -> str | None:
    """Read ``checkpoint`` (in ``location``) whole unless its verdict is kept: None when
    sound, else what is damaged. ``keep``: record the verdict (the run's holder; a reader that
    holds no lease only reads). ``again``: read it whole whatever its verdict says (bytes can
    rot after they were verified)."""
    verdict = None if again else stored_verdict(location)
    if verdict is not None:
        return None if verdict.get("ok") else str(verdict.get("reason"))
    found = damage(checkpoint, lambda name: location.child(name).read_bytes())
    if keep:
        record(location, found is None, found)
    return found


def sound(
    locate: Callable[[int], Location], committed: list[CheckpointInfo], keep: bool = True
) -> list[CheckpointInfo]:
    """The checkpoints of ``committed`` whose digests are verified (each read once in its
    life, then by its kept verdict); ``locate(step)``: a checkpoint's directory
    (``RunDirectory.checkpoint_location``)."""
    kept = []
    for checkpoint in committed:
        found = verify(locate(checkpoint.step), checkpoint, keep)
        if found is None:
            kept.append(checkpoint)
        else:
            logger.warning("checkpoint %s is damaged (%s): not counted", checkpoint.uri, found)
    return kept


def damage_found(location: Location) -> str | None:
    """What the kept verdict of the checkpoint at ``location`` found damaged; None when it is
    sound, or the verdict is not about its present commit."""
    verdict = stored_verdict(location)
    if verdict is None or verdict.get("ok"):
        return None
    return str(verdict.get("reason"))


def read_again(
    locate: Callable[[int], Location], committed: list[CheckpointInfo], uris: list[str]
) -> list[str]:
    """The checkpoints named by ``uris`` (a finished run's best and latest, before its stored
    result is handed out again) read whole again, whatever their verdicts say: what is wrong
    with each that is damaged (its new verdict kept) or no longer committed."""
    by_uri = {c.uri: c for c in committed}
    found = []
    for uri in dict.fromkeys(uris):
        checkpoint = by_uri.get(uri)
        if checkpoint is None:
            found.append(f"{uri} is no longer committed")
        elif (damaged := verify(locate(checkpoint.step), checkpoint, again=True)) is not None:
            found.append(f"{uri}: {damaged}")
    return found
