"""How many lines of the outside script each way of bringing it in changed: a line-by-line diff
(difflib) of each brought-in file against the original as ray installs it, less the header
each brought-in file starts with (its comment lines up to the first blank one).

``python -m tests.scripts.changed_lines`` prints, for each way, the lines added and removed,
and what the spec adds (the built-in loop's YAML file; the other two ways' specs are a few
lines each, in the test).
"""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: The outside script, inside the ray wheel relaytrain pins (never imported: it imports
#: torchvision at its top).
ORIGINAL = ("ray.train.examples.pytorch", "torch_fashion_mnist_example.py")
WAYS = {
    "built-in loop, Dataset form": HERE / "fashion_mnist_builtin.py",
    "own loop (relaytrain API)": HERE / "fashion_mnist_own_loop.py",
    "Ray-API loop": HERE / "fashion_mnist_ray_loop.py",
}
SPEC = HERE / "fashion_mnist_builtin.yaml"


def original_path() -> Path:
    """Where the installed ray keeps the outside script."""
    package, name = ORIGINAL
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{package} is not installed: install ray (pyproject.toml)")
    return Path(next(iter(spec.submodule_search_locations))) / name


def without_header(lines: list[str]) -> list[str]:
    """``lines`` less the leading comment block and the blank line that ends it."""
    if not lines or not lines[0].startswith("#"):
        return lines
    end = next(i for i, line in enumerate(lines) if not line.strip())
    return lines[end + 1 :]


def diff(path: Path) -> list[str]:
    """The unified diff of the original and ``path`` (its header left out)."""
    original = original_path().read_text().splitlines()
    brought = without_header(path.read_text().splitlines())
    return list(difflib.unified_diff(original, brought, "original", path.name, lineterm=""))


def changed(path: Path) -> tuple[int, int]:
    """(lines added, lines removed) against the original."""
    lines = [line for line in diff(path) if not line.startswith(("+++", "---"))]
    return sum(line.startswith("+") for line in lines), sum(line.startswith("-") for line in lines)


def spec_lines(path: Path) -> int:
    """A spec file's lines that are neither blank nor only a comment."""
    lines = path.read_text().splitlines()
    return sum(bool(line.strip()) and not line.lstrip().startswith("#") for line in lines)


def main() -> None:
    print(f"against {original_path()}")
    for way, path in WAYS.items():
        added, removed = changed(path)
        print(f"{way:30} {path.name:28} +{added} -{removed}")
    print(f"{'':30} {SPEC.name:28} {spec_lines(SPEC)} lines of spec")


if __name__ == "__main__":
    main()
