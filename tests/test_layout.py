"""The tree is the architecture: which package may import which, checked on the source (no imports run).

conductor (settings, models, batching)   the bottom layer: imports no runtime package
subagents -> tool_server -> main_agent -> training   each imports only packages before it, and the bottom
conductor.cli, conductor.display         the top (the command and its terminal view): nothing imports them
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ORDER = ("subagents", "tool_server", "main_agent", "training")
BOTTOM = ("conductor.settings", "conductor.models", "conductor.batching", "conductor.cluster")
TOP = ("conductor.cli", "conductor.display")


def imported(path: Path) -> set[str]:
    """Every module a file imports, top level or inside functions, as dotted names."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def first_party(names: set[str]) -> set[str]:
    return {n for n in names if n.split(".")[0] in (*ORDER, "conductor")}


def test_the_bottom_layer_imports_no_runtime_package():
    """settings, models and batching are shared machinery: they may not reach into the packages that use them."""
    for module in BOTTOM:
        path = REPO / (module.replace(".", "/") + ".py")
        reached = {n for n in first_party(imported(path)) if n.split(".")[0] in ORDER}
        assert not reached, f"{module} imports {sorted(reached)}"


def test_runtime_packages_import_only_packages_below_them_and_the_bottom_layer():
    """subagents < tool_server < main_agent < training; none imports the CLI, its view or a package above it."""
    for rank, package in enumerate(ORDER):
        allowed = (*ORDER[: rank + 1], *BOTTOM, "conductor")
        for path in sorted((REPO / package).rglob("*.py")):
            for name in first_party(imported(path)):
                assert not any(name == t or name.startswith(t + ".") for t in TOP), (path, name)
                top = name.split(".")[0]
                ok = top in ORDER[: rank + 1] or any(name == b or name.startswith(b + ".") for b in BOTTOM)
                ok = ok or name == "conductor"  # `from conductor import models`
                assert ok, f"{path.relative_to(REPO)} imports {name}; {package} may use {allowed}"
