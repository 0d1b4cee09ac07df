"""A committed checkpoint's files: their digests, the manifest's entries, a writer that hashes
what it writes, and what discovery knows of a checkpoint (``CheckpointInfo``, ``Scan``)."""

from __future__ import annotations

import hashlib
import io
import re
from dataclasses import dataclass, field
from typing import Any

import xxhash

#: A committed checkpoint's last file: it names its manifest's sha256 (``run_directory``).
MARKER_FILE = "COMMITTED"


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


#: The digest a manifest records for each file: xxHash's XXH3-128, about 20 GB/s here, so
#: hashing costs a checkpoint write almost nothing (sha256 runs at about 1.5 GB/s, slower than
#: the write itself). It detects corruption; the commit marker still names the manifest's sha256.
#: Manifests written before it carry "sha256", which is still verified.
FILE_DIGEST = "xxh3_128"


def file_digest(data: Any) -> str:
    return xxhash.xxh3_128_hexdigest(data)


@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    xxh3_128: str

    def manifest_entry(self) -> dict[str, Any]:
        return {"size": self.size, FILE_DIGEST: self.xxh3_128}


def matches(entry: dict[str, Any], data: bytes) -> bool:
    """Whether ``data`` is what a manifest entry describes (size and digest)."""
    if len(data) != entry.get("size"):
        return False
    if FILE_DIGEST in entry:
        return file_digest(data) == entry[FILE_DIGEST]
    return sha256_hex(data) == entry.get("sha256")


def size_mismatches(manifest: dict[str, Any], sizes: dict[str, int]) -> dict[str, int | None]:
    """The files ``manifest`` lists that storage (``sizes``: name -> bytes) lacks or holds at
    another size, with the size found (None: missing)."""
    return {
        name: sizes.get(name)
        for name, entry in manifest["files"].items()
        if sizes.get(name) != entry["size"]
    }


class HashingWriter(io.RawIOBase):
    """A write-only stream that forwards to ``stream`` and digests what passes through, so the
    bytes are never held whole in memory, nor read twice."""

    def __init__(self, stream: Any):
        super().__init__()
        self.stream = stream
        self.digest = xxhash.xxh3_128()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, chunk: Any) -> int:
        view = memoryview(chunk).cast("B")
        self.digest.update(view)
        self.stream.write(view)
        self.size += len(view)
        return len(view)

    def entry(self, name: str) -> FileEntry:
        return FileEntry(name=name, size=self.size, xxh3_128=self.digest.hexdigest())


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint as its manifest describes it."""

    step: int
    name: str
    uri: str
    manifest: dict[str, Any] = field(repr=False)

    @property
    def metrics(self) -> dict[str, Any]:
        return dict(self.manifest.get("metrics") or {})

    @property
    def files(self) -> dict[str, dict[str, Any]]:
        return dict(self.manifest["files"])


@dataclass(frozen=True)
class Scan:
    """What a listing of the run directory found, oldest first."""

    committed: list[CheckpointInfo]
    #: Checkpoint directories without a valid marker (partial, or a marker that does not match).
    uncommitted: list[str]
    #: Committed by marker, but a file is missing or has the wrong size.
    damaged: list[str]

    @property
    def newest(self) -> CheckpointInfo | None:
        return self.committed[-1] if self.committed else None


CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d{9})$")


def checkpoint_dir_name(step: int) -> str:
    return f"checkpoint-{step:09d}"


def checkpoint_step(name: str) -> int | None:
    match = CHECKPOINT_PATTERN.fullmatch(name)
    return int(match.group(1)) if match else None


def file_names(sharded: bool, rank: int) -> dict[str, str]:
    """The file each state key of ``rank`` is saved under (``rng``: every rank's own)."""
    suffix = f"-rank{rank}" if sharded else ""
    return {
        "model": f"model{suffix}.pt",
        "optimizer": f"optimizer{suffix}.pt",
        "scheduler": "scheduler.pt",
        "scaler": "scaler.pt",
        "rng": f"rng-rank{rank}.pt",
    }
