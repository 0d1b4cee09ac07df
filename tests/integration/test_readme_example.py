"""The README's pytest-plugin example, run as the README prints it.

The code block under "Testing your own flows" is read from README.md and compiled here, so the
test it defines runs with the plugin's real fixtures (the session's Ray cluster, Prefect's test
harness, ``relaytrain_spec``) and fails if the README's example stops working.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
README = Path(__file__).resolve().parents[2] / "README.md"


def readme_example() -> str:
    section = README.read_text().split("## Testing your own flows", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match, "README's 'Testing your own flows' has no python block"
    return match.group(1)


_namespace: dict = {}
exec(compile(readme_example(), str(README), "exec"), _namespace)
(_name,) = [name for name in _namespace if name.startswith("test_")]
test_the_readme_example = _namespace[_name]


def test_the_example_uses_every_fixture_the_readme_names():
    source = readme_example()
    for fixture in ("relaytrain_ray", "relaytrain_prefect", "relaytrain_spec", "with_fault"):
        assert fixture in source
