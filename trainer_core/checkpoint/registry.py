"""The model registry on storage: a champion pointer per model, with its history.

    {storage}/registry/{model}/champion.json       the current champion (replaced atomically)
    {storage}/registry/{model}/history/NNNNNN.json  every promotion, written before the pointer

``decide_promotion`` is pure: promote only when the challenger beats the champion by a margin.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from trainer_core.checkpoint.run_directory import SCHEMA_VERSION
from trainer_core.spec.sections import validate_run_name
from trainer_core.storage.locations import Location


class Champion(BaseModel):
    model_config = ConfigDict(frozen=True)

    model_name: str
    run_name: str
    checkpoint_uri: str
    metric: str
    metrics: dict[str, float]
    promoted_at: float
    fingerprint: str


@dataclass(frozen=True)
class PromotionDecision:
    promote: bool
    reason: str


def decide_promotion(
    challenger: float | None,
    champion: float | None,
    *,
    metric: str,
    mode: Literal["min", "max"],
    margin: float,
) -> PromotionDecision:
    """Promote when there is no champion, or the challenger is better by more than ``margin``."""
    if challenger is None or not math.isfinite(challenger):
        return PromotionDecision(False, f"challenger has no finite {metric}: not promoted")
    if champion is None or not math.isfinite(champion):
        return PromotionDecision(True, f"no champion yet: challenger {metric}={challenger:.4f}")
    gain = (champion - challenger) if mode == "min" else (challenger - champion)
    verdict = "better" if gain > margin else "not better"
    return PromotionDecision(
        gain > margin,
        f"challenger {metric}={challenger:.4f} vs champion {champion:.4f}: {verdict} by "
        f"{gain:+.4f} (margin {margin})",
    )


class Registry:
    def __init__(self, storage_root: Location, model_name: str):
        validate_run_name(model_name)
        self.model_name = model_name
        self.location = storage_root.child("registry", model_name)

    def champion(self) -> Champion | None:
        pointer = self.location.child("champion.json")
        if not pointer.exists():
            return None
        data = pointer.read_json()
        data.pop("schema", None)
        return Champion.model_validate(data)

    def history(self) -> list[dict[str, Any]]:
        entries = self.location.child("history").list()
        return [self.location.child("history", e.base_name).read_json() for e in entries]

    def promote(self, champion: Champion) -> None:
        """Record the promotion in the history, then move the pointer (one atomic write)."""
        record = {"schema": SCHEMA_VERSION, **champion.model_dump(), "recorded_at": time.time()}
        number = len(self.location.child("history").list()) + 1
        self.location.child("history", f"{number:06d}.json").write_json(record)
        self.location.child("champion.json").write_json(
            {"schema": SCHEMA_VERSION, **champion.model_dump()}
        )
