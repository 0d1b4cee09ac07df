"""A run directory as its files, local or in S3, read and damaged through pyarrow's
filesystems, by the layout docs/failure-and-resume.md gives (``checkpoint-NNNNNNNNN/`` with
``manifest.json`` and ``COMMITTED``, ``attempts.jsonl``, ``summary.json``, ``metrics/``):
what a user, a backup or a failing disk sees, not relaytrain's reader of it."""

from __future__ import annotations

import hashlib
import io
import json
import re
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs
import torch
import xxhash

CHECKPOINT = re.compile(r"checkpoint-(\d{9})")


@dataclass
class RunFiles:
    fs: pafs.FileSystem
    base: str  # the run directory's path in ``fs``

    @staticmethod
    def at(uri: str, credentials: dict[str, str] | None = None) -> RunFiles:
        """The run directory at ``uri`` (a local path, or an ``s3://`` URI with its endpoint in
        the query, as the scenarios' storage is)."""
        if uri.startswith("s3://"):
            path, _, query = uri[len("s3://") :].partition("?")
            options = dict(part.split("=", 1) for part in query.split("&") if part)
            creds = credentials or {}
            fs = pafs.S3FileSystem(
                access_key=creds.get("AWS_ACCESS_KEY_ID"),
                secret_key=creds.get("AWS_SECRET_ACCESS_KEY"),
                region=creds.get("AWS_DEFAULT_REGION", "us-east-1"),
                endpoint_override=options.get("endpoint_override"),
                scheme=options.get("scheme", "https"),
            )
            return RunFiles(fs, path.rstrip("/"))
        return RunFiles(pafs.LocalFileSystem(), uri.rstrip("/"))

    def _path(self, relative: str) -> str:
        return f"{self.base}/{relative}" if relative else self.base

    def exists(self, relative: str = "") -> bool:
        return self.fs.get_file_info(self._path(relative)).type != pafs.FileType.NotFound

    def names(self, relative: str = "") -> list[str]:
        if not self.exists(relative):
            return []
        infos = self.fs.get_file_info(pafs.FileSelector(self._path(relative)))
        return sorted(info.base_name for info in infos)

    def read(self, relative: str) -> bytes:
        with self.fs.open_input_stream(self._path(relative)) as stream:
            return bytes(stream.read())

    def write(self, relative: str, data: bytes) -> None:
        with self.fs.open_output_stream(self._path(relative)) as stream:
            stream.write(data)

    def every_file(self) -> list[str]:
        """Every file under the run directory, relative to it."""
        if not self.exists():
            return []
        infos = self.fs.get_file_info(pafs.FileSelector(self.base, recursive=True))
        return sorted(
            info.path[len(self.base) + 1 :] for info in infos if info.type == pafs.FileType.File
        )

    # -- the documented layout ----------------------------------------------------------------

    def committed_steps(self) -> list[int]:
        """The steps of checkpoint directories holding a ``COMMITTED`` marker."""
        steps = []
        for name in self.names():
            match = CHECKPOINT.fullmatch(name)
            if match and self.exists(f"{name}/COMMITTED"):
                steps.append(int(match.group(1)))
        return sorted(steps)

    def verified(self, step: int) -> bool:
        """The checkpoint's marker names its manifest's sha256, and every file the manifest
        lists has its size and XXH3-128 digest."""
        folder = f"checkpoint-{step:09d}"
        try:
            manifest_bytes = self.read(f"{folder}/manifest.json")
            marker = self.read(f"{folder}/COMMITTED").decode()
        except OSError:
            return False
        if hashlib.sha256(manifest_bytes).hexdigest() not in marker:
            return False
        manifest = json.loads(manifest_bytes)
        for name, entry in manifest["files"].items():
            if name == "manifest.json":
                continue
            data = self.read(f"{folder}/{name}")
            if len(data) != entry["size"] or xxhash.xxh3_128_hexdigest(data) != entry["xxh3_128"]:
                return False
        return True

    def manifest(self, step: int) -> dict[str, Any]:
        return dict(json.loads(self.read(f"checkpoint-{step:09d}/manifest.json")))

    def tensors(self, step: int, name: str) -> Any:
        data = self.read(f"checkpoint-{step:09d}/{name}")
        return torch.load(io.BytesIO(data), weights_only=True)

    def attempts(self) -> list[dict[str, Any]]:
        if not self.exists("attempts.jsonl"):
            return []
        text = self.read("attempts.jsonl").decode()
        records: dict[int, dict[str, Any]] = {}
        for line in text.splitlines():
            if line.strip():
                record = json.loads(line)
                records[record["attempt"]] = record  # a record is written again as it goes
        return [records[a] for a in sorted(records)]

    def summary(self) -> dict[str, Any] | None:
        if not self.exists("summary.json"):
            return None
        return dict(json.loads(self.read("summary.json")))
