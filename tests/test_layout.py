"""The tree is the architecture: which module may import which, checked on the source (no imports run).

    benchmarks   the studies and performance benches, run with `python -m`: nothing imports them (tests do)
    app          the command line, the live display, `ask`, the trace viewer: nothing imports it
    training     the trainers
    main_agent   the policy's side
    tool_server  hosts the sub-agents
    subagents    the frozen sub-agents
    conductor    the bottom layer: settings, models, batching, cluster (and the shipped default policy)

A module imports only modules on its own floor or below, no two modules import each other, and nothing outside
app imports app (the benchmarks run `conductor` as a user does). Every import counts, at the top of a file, inside
a function or under TYPE_CHECKING; `from package import module` counts as importing that module (not the
package's `__init__`). No exceptions.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FLOORS = ("conductor", "subagents", "tool_server", "main_agent", "training", "app", "benchmarks")


def modules() -> dict[str, Path]:
    """Every first-party module by dotted name (a package by its own name, for its `__init__.py`)."""
    found = {}
    for package in FLOORS:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(path: Path, known: set[str]) -> set[str]:
    """The first-party modules a file imports, anywhere in it: `from a import b` is module a.b when there is
    one, else module a."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & known
            names.update(submodules)
            if len(submodules) < len(node.names):
                names.add(node.module)
    return names & known


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imported(path, set(found)) - {name} for name, path in found.items()}


def floor(module: str) -> int:
    return FLOORS.index(module.split(".")[0])


def test_every_package_is_on_a_floor() -> None:
    """A new top-level package must be placed in FLOORS; the checkout's packages, tests aside, are exactly the
    floors'."""
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests"}
    assert packages == set(FLOORS), f"packages {sorted(packages)} != floors {sorted(FLOORS)}"


def test_no_module_imports_a_module_on_a_higher_floor() -> None:
    """The bottom layer imports no runtime package; subagents < tool_server < main_agent < training < app <
    benchmarks."""
    upward = [
        f"{module} ({FLOORS[floor(module)]}) imports {target} ({FLOORS[floor(target)]})"
        for module, targets in sorted(graph().items())
        for target in sorted(targets)
        if floor(target) > floor(module)
    ]
    assert not upward, "\n".join(upward)


def test_no_two_modules_import_each_other() -> None:
    """A pair that imports each other is one module in two files, or a contract beside its implementation."""
    edges = graph()
    pairs = sorted({tuple(sorted((a, b))) for a, targets in edges.items() for b in targets if a in edges[b]})
    assert not pairs, f"modules that import each other: {pairs}"


def test_only_the_application_imports_it() -> None:
    """The floors put app below the benchmarks, yet they never import it: they import the runtime packages and run
    `conductor` as a user does."""
    importers = [
        f"{module} imports {target}"
        for module, targets in sorted(graph().items())
        for target in sorted(targets)
        if floor(target) == FLOORS.index("app") != floor(module)
    ]
    assert not importers, "\n".join(importers)
