"""What an attacker who can write a run directory plants there: pickles that touch a sentinel
file when unpickled, written into committed checkpoints with their manifest entry and commit
marker made again (a digest is no signature), and a ``run.json`` whose spec names code.

Written here with the attacker's own tools (xxhash, hashlib, json), not relaytrain's writers."""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path
from typing import Any

import xxhash

#: The module a tampered run.json names for every code field (tests/evil_import.py).
EVIL_MODULE = "tests.evil_import"
#: The environment variable that tells tests/evil_import.py which sentinel to touch.
SENTINEL_ENV = "RELAYTRAIN_TEST_SENTINEL"


class RunsCode:
    """A pickle payload that creates ``path`` when unpickled."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def replant(checkpoint_dir: Path, name: str, data: bytes) -> None:
    """Write ``data`` as file ``name`` of the committed checkpoint in ``checkpoint_dir``, and
    the manifest's entry and the commit marker again to match, as an attacker would."""
    (checkpoint_dir / name).write_bytes(data)
    manifest_path = checkpoint_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][name] = {"size": len(data), "xxh3_128": xxhash.xxh3_128_hexdigest(data)}
    manifest_bytes = json.dumps(manifest, indent=2, sort_keys=True).encode()
    manifest_path.write_bytes(manifest_bytes)
    marker = json.loads((checkpoint_dir / "COMMITTED").read_text())
    marker["manifest_sha256"] = hashlib.sha256(manifest_bytes).hexdigest()
    (checkpoint_dir / "COMMITTED").write_text(json.dumps(marker))


def planted_dcp_metadata(checkpoint_dir: Path, sentinel: Path) -> bytes:
    """The checkpoint's own DCP ``.metadata`` with a payload riding in its planner data: an
    unsafe load runs the payload and still loads the checkpoint. Planted in place; returned."""
    metadata: Any = pickle.loads((checkpoint_dir / ".metadata").read_bytes())  # ours: trusted
    metadata.planner_data = {**(metadata.planner_data or {}), "payload": RunsCode(sentinel)}
    data = pickle.dumps(metadata)
    replant(checkpoint_dir, ".metadata", data)
    return data


def tamper_spec(run_dir: Path) -> dict[str, Any]:
    """Point every field of the stored spec (``run.json``) that names code at
    tests/evil_import.py, as someone with write access to a shared bucket could; returns the
    tampered spec."""
    path = run_dir / "run.json"
    record = json.loads(path.read_text())
    spec = record["spec"]
    spec["model"]["name"] = f"{EVIL_MODULE}:build"
    for key in ("loss",):
        spec[key] = f"{EVIL_MODULE}:loss"
    spec["metrics"] = [f"{EVIL_MODULE}:metric"]
    path.write_text(json.dumps(record))
    return spec
