"""Numbers as a run records them: a metric value is a finite int or float (not a bool, NaN or
infinity); anything else is left out of rankings, tables and trackers."""

from __future__ import annotations

import math
from typing import Any


def is_finite_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
