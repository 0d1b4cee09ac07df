"""What an oracle reports: the invariant a played scenario broke, and how."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Violation:
    invariant: str
    what: str

    def as_dict(self) -> dict[str, str]:
        return {"invariant": self.invariant, "what": self.what}
