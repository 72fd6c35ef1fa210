"""ARCHITECTURE.md is the map of primus_ext: every package (and top-level module) is in its
folder table, every folder it names exists, and its layer order is the import-linter contract's."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = (ROOT / "ARCHITECTURE.md").read_text()
TABLE = TEXT.split("## Folders")[1].split("\n## ")[0]
ROWS = re.findall(r"^\| `primus_ext/(\w+)` \|", TABLE, flags=re.M)


def _parts() -> set[str]:
    package = ROOT / "primus_ext"
    folders = {p.name for p in package.iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")}
    return folders | modules


def test_every_package_is_on_the_map():
    assert set(ROWS) == _parts(), (sorted(_parts() - set(ROWS)), sorted(set(ROWS) - _parts()))


def test_the_map_lists_the_layers_top_down():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    layers = [[name.strip().split(".")[-1] for name in layer.split("|")] for layer in config["layers"]]
    order = {name: i for i, layer in enumerate(layers) for name in layer}
    ranks = [order[row] for row in ROWS]
    assert ranks == sorted(ranks), "ARCHITECTURE.md's folder table is not in the contract's layer order"


def test_every_file_it_names_exists():
    for path in re.findall(r"`(primus_ext/[\w/]+\.py|tests/[\w/]+\.py|docs/\w+\.md)`", TEXT):
        assert (ROOT / path).exists(), path
