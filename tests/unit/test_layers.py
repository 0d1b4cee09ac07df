"""The import order of relaytrain's packages, read from the source (every import, those inside
functions included): no module imports itself back through others, and each package of
``trainer_core`` imports only the packages its ``__init__`` docstring declares ("May import:"),
which must lie below it in ``LAYERS``. Above the core: ``tasks``, then ``flows``, then
``deployments``; the core imports none of them, nor Prefect."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOP = ("trainer_core", "tasks", "flows", "deployments")
#: Modules of trainer_core that every package may import: the error hierarchy, what a
#: recorded number is, and what a step-time record holds (the workers write it, the driver
#: reads it).
BASE = ("errors", "numbers", "tensors", "step_time")
#: trainer_core's packages, lowest first.
LAYERS = (
    *BASE,
    "storage",
    "spec",
    "data",
    "execution",
    "checkpoint",
    "train",
    "tracking",
    "run",
    "sweep",
)


def modules(roots: Iterable[str] = TOP) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``roots`` (a package by its name)."""
    found: dict[str, Path] = {}
    for root in roots:
        for path in sorted((ROOT / root).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that ``name`` imports, with the packages each import runs
    first (importing ``a.b.c`` runs ``a`` and ``a.b``, unless ``name`` lies inside them: their
    ``__init__`` is already running). ``from p import x`` depends on the module ``p.x`` when
    there is one, else on ``p``'s ``__init__`` (its face)."""
    is_package = path.name == "__init__.py"
    explicit: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            explicit.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, base] if base else package)
            for alias in node.names:
                module = f"{base}.{alias.name}"
                explicit.add(module if module in known else base)
    found: set[str] = set()
    for target in explicit:
        parts = target.split(".")
        found.add(target)
        found.update(
            prefix
            for prefix in (".".join(parts[:i]) for i in range(1, len(parts)))
            if not name.startswith(prefix + ".")
        )
    return {t for t in found if t in known and t != name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def layer(module: str) -> str | None:
    """The ``trainer_core`` package (or base module) that ``module`` belongs to."""
    parts = module.split(".")
    return parts[1] if parts[0] == "trainer_core" and len(parts) > 1 else None


def declared(package: str) -> set[str]:
    """The packages ``trainer_core/<package>/__init__.py`` says it may import."""
    source = (ROOT / "trainer_core" / package / "__init__.py").read_text()
    doc = ast.get_docstring(ast.parse(source))
    match = re.search(r"May import:(.*?)(?:\n\n|$)", doc or "", re.S)
    assert match, f"trainer_core/{package}/__init__.py's docstring declares no 'May import:'"
    if "every package below it" in match.group(1):
        return set(LAYERS[: LAYERS.index(package)])
    return set(BASE) | set(re.findall(r"``(\w+)``", match.group(1)))


def test_no_module_imports_itself_back() -> None:
    assert cycles(graph()) == []


def test_every_package_of_the_core_is_a_layer() -> None:
    packages = {p.name for p in (ROOT / "trainer_core").iterdir() if (p / "__init__.py").exists()}
    assert packages == set(LAYERS) - set(BASE)


@pytest.mark.parametrize("package", [p for p in LAYERS if p not in BASE])
def test_each_package_declares_only_packages_below_it(package: str) -> None:
    below = set(LAYERS[: LAYERS.index(package)])
    assert declared(package) <= below, (package, declared(package) - below)


def test_each_package_imports_only_what_it_declares() -> None:
    wrong = []
    for module, targets in graph().items():
        own = layer(module)
        if own is None or own in BASE:
            assert own is None or not {layer(t) for t in targets} - {None, *BASE}, module
            continue
        allowed = declared(own) | {own}
        for target in sorted(targets):
            other = layer(target)
            outside = target.split(".")[0] != "trainer_core"  # tasks, flows, deployments
            if outside or (other is not None and other not in allowed):
                wrong.append((module, target))
    assert wrong == []


def test_the_layers_above_the_core_import_only_downwards() -> None:
    rank = {top: i for i, top in enumerate(TOP)}
    wrong = [
        (module, target)
        for module, targets in graph().items()
        for target in targets
        if rank[target.split(".")[0]] > rank[module.split(".")[0]]
    ]
    assert wrong == []


def test_the_core_imports_no_prefect() -> None:
    offenders = []
    for name, path in modules(["trainer_core"]).items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            offenders += [(name, n) for n in names if n.split(".")[0] == "prefect"]
    assert offenders == []


def test_the_reader_sees_a_cycle_and_an_upward_import(tmp_path) -> None:
    """The rules can fail: a lazy import of run.summary inside storage is both."""
    edges = graph()
    edges["trainer_core.storage.locations"].add("trainer_core.run.summary")
    assert any("trainer_core.storage.locations" in c for c in cycles(edges))
    lazy = ast.parse("def f():\n    from trainer_core.run import summary\n")
    path = tmp_path / "m.py"
    path.write_text(ast.unparse(lazy))
    found = imports_of("trainer_core.storage.m", path, modules())
    assert "trainer_core.run.summary" in found
    assert layer("trainer_core.run.summary") not in declared("storage")
