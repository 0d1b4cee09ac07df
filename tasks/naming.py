"""Names Prefect shows: artifact keys are lowercase letters, digits and dashes, per run."""

import re


def artifact_key(run_name: str, kind: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", run_name.lower()).strip("-") or "run"
    return f"{slug}-{kind}"[:100]
