"""The mutation check's patches (bench/mutations): each names the fix it reverses and the seeds
that replay it, and still applies to this checkout, so `make adversary-mutations` can run."""

from __future__ import annotations

import subprocess

import pytest

from tools.adversary_mutations import MUTATIONS, REPO, read_patch


@pytest.mark.parametrize("path", sorted(MUTATIONS.glob("*.diff")), ids=lambda p: p.stem)
def test_a_mutation_names_its_seeds_and_applies_to_this_checkout(path):
    mutation = read_patch(path)
    assert mutation["reverses"] == path.stem and mutation["seeds"]
    applied = subprocess.run(
        ["git", "apply", "--check"],
        cwd=REPO,
        input=mutation["diff"],
        text=True,
        capture_output=True,
    )
    assert applied.returncode == 0, f"{path.name} no longer applies: {applied.stderr}"
