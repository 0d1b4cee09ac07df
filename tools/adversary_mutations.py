"""The adversary's mutation check (``make adversary-mutations``): each fix the adversary found
reversed on a scratch checkout of HEAD (``bench/mutations/<commit>.diff``, never committed to a
branch), and the seeds that found its defect replayed against it. A reverse whose seeds all
pass is a fix the adversary no longer guards. The result in
``bench/results/<date>-adversary-mutations.json``.

    python -m tools.adversary_mutations [--only 14faf8b ...] [--out FILE]

A patch file's first lines say what it reverses, and which seeds replay it::

    Reverses: 14faf8b
    What: a later attempt reads the dataset's footers before its snapshot
    Seeds: 35 44

    diff --git ...
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MUTATIONS = REPO / "bench" / "mutations"


def read_patch(path: Path) -> dict[str, Any]:
    """A patch file's header (``Reverses``, ``What``, ``Seeds``) and its diff."""
    text = path.read_text()
    header, _, diff = text.partition("diff --git")
    fields = dict(
        (key.strip().lower(), value.strip())
        for key, _, value in (line.partition(":") for line in header.splitlines() if ":" in line)
    )
    missing = {"reverses", "what", "seeds"} - set(fields)
    if missing or not diff:
        raise ValueError(f"{path}: a patch needs Reverses, What and Seeds lines, then its diff")
    return {
        "reverses": fields["reverses"],
        "what": fields["what"],
        "seeds": [int(s) for s in fields["seeds"].split()],
        "diff": "diff --git" + diff,
    }


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def check(mutation: dict[str, Any], scratch: Path) -> dict[str, Any]:
    """The mutation applied to a worktree of HEAD and its seeds replayed against it; the
    worktree removed after, whatever happened."""
    tree = scratch / f"mutant-{mutation['reverses']}"
    git("worktree", "add", "--detach", str(tree), "HEAD")
    try:
        subprocess.run(["git", "apply"], cwd=tree, input=mutation["diff"], text=True, check=True)
        out = scratch / f"{mutation['reverses']}.json"
        seeds = [arg for seed in mutation["seeds"] for arg in ("--seed", str(seed))]
        command = [sys.executable, "-m", "tools.adversary", "--target", str(tree), *seeds]
        command += ["--root", str(scratch / f"root-{mutation['reverses']}"), "--out", str(out)]
        print(f"== reverse of {mutation['reverses']}: {mutation['what']}", flush=True)
        subprocess.run(command, cwd=REPO, check=False)
        result = json.loads(out.read_text())
    finally:
        git("worktree", "remove", "--force", str(tree))
    failed = sorted({v["seed"] for v in result["violations"]})
    return {
        **mutation,
        "target_commit": git("rev-parse", "HEAD"),
        "failed": failed,
        "caught": bool(failed),
        "violations": [
            {k: v[k] if k != "what" else v[k][:400] for k in ("seed", "invariant", "what")}
            for v in result["violations"]
        ],
        "errors": result["errors"],
        "scenarios": {str(r["seed"]): r["scenario"] for r in result["records"]},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.adversary_mutations", description=__doc__
    )
    parser.add_argument("--only", nargs="*", help="the commits whose reverses to check")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    patches = sorted(MUTATIONS.glob("*.diff"))
    mutations = [read_patch(p) for p in patches]
    if args.only:
        mutations = [m for m in mutations if m["reverses"] in args.only]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mutants-") as scratch:
        checked = [check(m, Path(scratch)) for m in mutations]
    result = {
        "schema": 1,
        "kind": "adversary-mutations",
        "at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "adversary": git("rev-parse", "HEAD"),
        "how": "each fix's reverse (bench/mutations) applied to a scratch worktree of HEAD, the "
        "seeds that found its defect replayed against it with python -m tools.adversary "
        "--target <worktree> --seed N",
        "seconds": round(time.monotonic() - started),
        "mutations": checked,
    }
    out = (
        args.out
        or REPO / "bench" / "results" / f"{time.strftime('%Y-%m-%d')}-adversary-mutations.json"
    )
    out.write_text(json.dumps(result, indent=1) + "\n")
    missed = [m["reverses"] for m in checked if not m["caught"]]
    for m in checked:
        verdict = f"caught by {m['failed']}" if m["caught"] else "NOT CAUGHT"
        print(f"reverse of {m['reverses']}: seeds {m['seeds']}: {verdict}")
    print(f"result: {out}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
