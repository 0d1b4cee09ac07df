"""The bad-input catalog's cases (tests/integration/test_bad_input.py runs them): each breaks one
thing in the tiny spec (``tests.conftest.tiny_raw``) or in a command line, and names the field
its message must name, a phrase of the fix, and the stage that refuses it.

- ``world``: what the cases point at, the ``Case`` record, the builders they share;
- ``spec_cases``: refused while the spec is built;
- ``setup_cases``: refused by the setup task, and by the command line that serves retraining.
"""

from __future__ import annotations

from tests.bad_inputs.setup_cases import SERVE_CASES, SETUP_CASES
from tests.bad_inputs.spec_cases import SPEC_CASES
from tests.bad_inputs.world import EXISTING, Case, World

__all__ = ["CASES", "EXISTING", "REQUIRED", "Case", "World"]

CASES = [*SPEC_CASES, *SETUP_CASES, *SERVE_CASES]


#: The cases issue 5 asks for by name (the S3 ones live in test_object_storage.py).
REQUIRED = {
    "workers-zero",
    "workers-negative",
    "workers-beyond-cluster",
    "model-module-missing",
    "model-module-raises-on-import",
    "model-attribute-missing",
    "dataset-missing",
    "label-column-missing",
    "label-strings-for-regression",
    "run-name-empty",
    "run-name-101-chars",
    "run-name-slash",
    "run-name-dotdot",
    "resume-changed-model-shape",
    "run-dir-other-schema",
    "cron-invalid",
    # issue 13: tried as a new user would
    "seed-negative",
    "dataset-csv",
}
