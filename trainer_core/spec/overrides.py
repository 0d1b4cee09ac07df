"""A run spec from what users write: YAML files, ``--set key=value`` overrides and flow
parameters, with validation errors that name the field and its fix."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    ValidationError,
)

from trainer_core.errors import SpecError
from trainer_core.spec.run_spec import RunSpec


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``dotted.key=value``; the value is JSON where it parses, else a plain string."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise SpecError(
            f"--set {text!r} is not of the form dotted.key=value (e.g. scaling.num_workers=2)",
            field="--set",
        )
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip().split("."), value


def apply_override(raw: dict[str, Any], path: list[str], value: Any) -> None:
    """Set ``value`` at ``path`` inside nested dicts/lists, creating dicts as needed."""
    node: Any = raw
    for i, part in enumerate(path):
        last = i == len(path) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise SpecError(
                    f"override {'.'.join(path)}: {part!r} is not an index of a list of "
                    f"{len(node)} item(s): use an index below {len(node)}, or set the whole "
                    f"list (e.g. --set {'.'.join(path[:i])}='[...]')",
                    field=".".join(path),
                )
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
            continue
        if not isinstance(node, dict):
            raise SpecError(
                f"override {'.'.join(path)}: {'.'.join(path[:i])} is not a section (it holds "
                f"{node!r}): set it whole, e.g. --set {'.'.join(path[:i])}=VALUE",
                field=".".join(path),
            )
        if last:
            node[part] = value
        else:
            if node.get(part) is None:
                if path[i + 1].isdigit():
                    where = ".".join(path[: i + 1])
                    raise SpecError(
                        f"override {'.'.join(path)}: {where} is not set, so it has no item "
                        f"{path[i + 1]}: set the whole list, e.g. --set {where}='[...]'",
                        field=".".join(path),
                    )
                node[part] = {}
            node = node[part]


def format_validation_error(error: ValidationError, section: str = "") -> str:
    """Every problem pydantic found, a line each naming its dotted field (under ``section``,
    for a section validated on its own: ``sweep``)."""
    lines = []
    for item in error.errors():
        loc = error_field(item, section) or section or "spec"
        given = item.get("input")
        # never echo a credential: user:password@ in a URI is masked
        shown = "" if isinstance(given, dict) else f" (got {_masked(repr(given))})"
        message = item["msg"].removeprefix("Value error, ")
        lines.append(f"  {loc}: {message}{shown}")
    return f"invalid {section or 'run'} spec:\n" + "\n".join(lines)


def _masked(text: str) -> str:
    return re.sub(r"//[^/@\s]*@", "//***@", text)


def error_field(item: Any, section: str = "") -> str | None:
    """The dotted field a pydantic error is about (a SpecError raised inside names its own),
    under ``section`` when one is given."""
    loc = ".".join(str(p) for p in item["loc"])
    raised = (item.get("ctx") or {}).get("error")
    named = raised.field if isinstance(raised, SpecError) else None
    if named and loc and named != loc and not named.startswith(f"{loc}."):
        named = f"{loc}.{named}"
    field = named or loc or None
    if section and field is not None and field != section and not field.startswith(section + "."):
        field = f"{section}.{field}"
    return field


def build_spec(raw: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> RunSpec:
    """Validate a raw mapping plus ``--set`` overrides into a frozen RunSpec or raise SpecError."""
    if not isinstance(raw, dict):
        raise SpecError(f"a run spec must be a mapping, got {type(raw).__name__}")
    raw = json.loads(json.dumps(raw))  # deep copy, and proves it is plain data
    for text in overrides:
        path, value = parse_override(text)
        apply_override(raw, path, value)
    try:
        return RunSpec.model_validate(raw)
    except ValidationError as e:
        field = error_field(e.errors()[0]) if e.errors() else None
        raise SpecError(format_validation_error(e), field=field) from e


def read_yaml(path: str | Path, what: str = "spec") -> Any:
    """The plain data of the YAML file at ``path`` (``--config``); a missing or unparsable file
    raises SpecError naming it as a ``what`` file."""
    path = Path(path)
    try:
        return yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError as e:
        raise SpecError(f"{what} file {str(path)!r} does not exist", field="--config") from e
    except yaml.YAMLError as e:
        raise SpecError(
            f"{what} file {str(path)!r} is not valid YAML: {e}", field="--config"
        ) from e


def load_spec(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunSpec:
    """Load a YAML spec file and apply ``--set`` overrides."""
    return build_spec(read_yaml(path), overrides)
