"""What the spec names by import path (``package.module:attribute``), resolved: a model
builder, a transform, a loss, a metric, a loop."""

from __future__ import annotations

import importlib
from typing import Any

from trainer_core.errors import SpecError


def import_object(path: str, field: str) -> Any:
    """Resolve ``package.module:attribute``; SpecError naming ``field`` when it cannot."""
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise SpecError(
            f"{field} {path!r}: module {module_name!r} cannot be imported ({e}). Check the "
            "spelling, and that the package is installed where the Ray workers run.",
            field=field,
        ) from e
    except Exception as e:  # the module itself raised while importing
        raise SpecError(
            f"{field} {path!r}: importing {module_name!r} raised {type(e).__name__}: {e}. Fix "
            f"that module (the driver and every Ray worker import it), or point {field} "
            "elsewhere.",
            field=field,
        ) from e
    try:
        target = getattr(module, attribute)
    except AttributeError as e:
        found = sorted(
            name
            for name, value in vars(module).items()
            if callable(value) and not name.startswith("_")
        )[:20]
        raise SpecError(
            f"{field} {path!r}: module {module_name!r} has no attribute {attribute!r}: fix the "
            f"name after ':' (callables there: {found})",
            field=field,
        ) from e
    if not callable(target):
        raise SpecError(
            f"{field} {path!r} is not callable (it is of type {type(target).__name__}): point "
            f"{field} at a function",
            field=field,
        )
    return target
