"""A sweep's search space, as users write it under ``sweep.space``: one entry per dotted key of
the run spec, each a distribution Optuna samples.

    optimizer.lr:        {log_uniform: [1.0e-4, 1.0e-1]}
    optimizer.weight_decay: {uniform: [0.0, 0.1]}
    data.batch_size:     {int: [32, 128, 32]}          # low, high, step (step 1 if left out)
    model.kwargs.hidden: {choice: [[32], [64, 64]]}    # any values the key takes

Each becomes an ``optuna.distributions`` distribution. A choice among values Optuna cannot
store as categories (lists, mappings) is stored as their JSON text and decoded back
(``Dimension.value``), so the study and the trial's spec say the same thing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from trainer_core.errors import SpecError

KINDS = ("uniform", "log_uniform", "int", "log_int", "choice")
#: What Optuna stores as a category as it is; anything else goes as JSON text.
_PLAIN = (type(None), bool, int, float, str)


@dataclass(frozen=True)
class Dimension:
    """One key of the space: the dotted key, what the user wrote, and Optuna's distribution."""

    key: str
    kind: str
    distribution: BaseDistribution
    #: Whether the choice's values go to Optuna as JSON text (``value`` decodes them).
    encoded: bool = False

    def value(self, sampled: Any) -> Any:
        """The value a trial's spec gets for what Optuna sampled."""
        return json.loads(sampled) if self.encoded else sampled

    def stored(self, value: Any) -> Any:
        """What Optuna stores for the value a trial's spec got (``value``'s inverse)."""
        return json.dumps(value, sort_keys=True) if self.encoded else value

    def corners(self) -> list[Any]:
        """The values a trial may get at the space's edges, each a spec must accept: the
        bounds of a range (an ``int``'s highest reachable one), every choice."""
        d = self.distribution
        if isinstance(d, CategoricalDistribution):
            return [self.value(c) for c in d.choices]
        if isinstance(d, IntDistribution):
            return [d.low, d.low + (d.high - d.low) // d.step * d.step]
        assert isinstance(d, FloatDistribution)
        return [d.low, d.high]

    def grid(self) -> list[Any] | None:
        """Every value Optuna may sample, as it stores them (a grid's axis); None for a
        continuous range or a log-spaced int."""
        d = self.distribution
        if isinstance(d, CategoricalDistribution):
            return list(d.choices)
        if isinstance(d, IntDistribution) and not d.log:
            return list(range(d.low, d.high + 1, d.step))
        return None


def parse_space(raw: Any) -> tuple[Dimension, ...]:
    """``sweep.space`` as dimensions, in the order written; a bad entry raises SpecError naming
    ``sweep.space.<key>``, the value seen and how to write it."""
    if not isinstance(raw, Mapping) or not raw:
        raise SpecError(
            "sweep.space must map dotted keys of the run spec to distributions, e.g. "
            "{optimizer.lr: {log_uniform: [1.0e-4, 1.0e-1]}}",
            field="sweep.space",
        )
    return tuple(_dimension(str(key), entry) for key, entry in raw.items())


def _dimension(key: str, entry: Any) -> Dimension:
    field = f"sweep.space.{key}"
    if not key or any(not part for part in key.split(".")):
        raise SpecError(f"{field}: {key!r} is not a dotted key of the run spec", field=field)
    if not isinstance(entry, Mapping) or len(entry) != 1 or next(iter(entry)) not in KINDS:
        raise SpecError(
            f"{field} {entry!r} is not a distribution: write one of "
            f"{{uniform: [low, high]}}, {{log_uniform: [low, high]}}, {{int: [low, high, step]}}, "
            f"{{log_int: [low, high]}}, {{choice: [value, ...]}}",
            field=field,
        )
    kind, args = next(iter(entry.items()))
    if kind == "choice":
        return _choice(key, field, args)
    return _range(key, field, kind, args)


def _choice(key: str, field: str, args: Any) -> Dimension:
    if not isinstance(args, list) or not args:
        raise SpecError(
            f"{field}: choice needs a non-empty list of values, got {args!r}", field=field
        )
    encoded = not all(isinstance(v, _PLAIN) for v in args)
    choices = [json.dumps(v, sort_keys=True) for v in args] if encoded else list(args)
    if len({json.dumps(c, sort_keys=True) for c in choices}) != len(choices):
        raise SpecError(f"{field}: choice lists a value twice: {args!r}", field=field)
    return Dimension(key, "choice", CategoricalDistribution(choices), encoded)


def _range(key: str, field: str, kind: str, args: Any) -> Dimension:
    integral = kind in ("int", "log_int")
    size = (2, 3) if kind == "int" else (2,)
    number = int if integral else (int, float)
    if (
        not isinstance(args, list)
        or len(args) not in size
        or not all(isinstance(v, number) and not isinstance(v, bool) for v in args)
        or not all(math.isfinite(v) for v in args)
    ):
        shape = "[low, high, step]" if kind == "int" else "[low, high]"
        what = "integers" if integral else "numbers"
        raise SpecError(f"{field}: {kind} takes {shape}, {what}; got {args!r}", field=field)
    low, high = args[0], args[1]
    if not low < high:
        raise SpecError(
            f"{field}: {kind} [{low}, {high}] is empty or one point: give low < high "
            f"(a fixed value belongs in the run spec, not the space)",
            field=field,
        )
    log = kind.startswith("log")
    if log and low <= 0:
        raise SpecError(
            f"{field}: {kind} needs low > 0 (a log scale has no 0 or negatives), got {low}: "
            f"use uniform or int for a range that reaches {low}",
            field=field,
        )
    if integral:
        step = args[2] if len(args) == 3 else 1
        if step <= 0 or (high - low) % step:
            raise SpecError(
                f"{field}: int [{low}, {high}, {step}]: high - low ({high - low}) must be a "
                f"multiple of the step (> 0), so both ends can be sampled",
                field=field,
            )
        return Dimension(key, kind, IntDistribution(low, high, log=log, step=step))
    return Dimension(key, kind, FloatDistribution(float(low), float(high), log=log))
