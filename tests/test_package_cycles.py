"""No package of primus_ext imports itself in a circle: each folder reads bottom up, as the
layers between folders do (the import-linter contract in pyproject.toml, tests/test_layers.py).

Imports inside functions count too (grimp sees them): a lazy import only hides a cycle."""

from __future__ import annotations

import grimp
import pytest

GRAPH = grimp.build_graph("primus_ext", include_external_packages=False)
PACKAGES = sorted({m.split(".")[1] for m in GRAPH.modules if m.count(".") >= 2})


def _cycle(package: str) -> list[str]:
    """One import cycle among the modules of ``package`` (their imports of each other only), or []."""
    prefix = f"primus_ext.{package}."
    inside = {m for m in GRAPH.modules if m.startswith(prefix)}
    edges = {m: {n for n in GRAPH.find_modules_directly_imported_by(m) if n in inside} for m in inside}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        path.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        state[m] = 2
        path.pop()
        return []

    for m in sorted(inside):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return []


def test_the_packages_are_found():
    assert {"attention", "backends", "call", "hooks", "megatron", "plan", "settings", "testing"} <= set(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_inside(package):
    assert _cycle(package) == [], " -> ".join(_cycle(package))
