"""Every import the README and docs/ show still runs: ``from primus_ext... import ...`` lines
of their code blocks, and every ``primus_ext.<module>.<name>`` they name in backticks
(earlier homes of moved names stay importable, e.g. ``primus_ext.backends.adapter``)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEXTS = {p.relative_to(ROOT).as_posix(): p.read_text() for p in [ROOT / "README.md", ROOT / "ARCHITECTURE.md",
                                                               *sorted((ROOT / "docs").glob("*.md"))] if p.exists()}
IMPORT = re.compile(r"^\s*(from primus_ext[\w.]* import (?:\([\w, \n]+\)|[\w, ]+)|import primus_ext[\w.]*)", re.M)
NAMED = re.compile(r"`(primus_ext(?:\.\w+)+)`")
OLD_HOMES = ["primus_ext.backends.adapter.TurboFlexAttention"]
NOT_MODULES = {"primus_ext.turbo_flex_attention"}  # the Primus patch's id (`primus_ext.primus.PATCH_ID`)


def _blocks(text: str) -> list[str]:
    """The fenced code blocks of a markdown text."""
    blocks, current = [], None
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append("\n".join(current))
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def _imports() -> list[tuple[str, str]]:
    found = []
    for name, text in TEXTS.items():
        for block in _blocks(text):
            found += [(name, " ".join(m.group(1).split())) for m in IMPORT.finditer(block)]
    return sorted(set(found))


def _names() -> list[tuple[str, str]]:
    return sorted({(name, ref) for name, text in TEXTS.items() for ref in NAMED.findall(text) if ref not in NOT_MODULES}
                  | {("earlier docs", ref) for ref in OLD_HOMES})


def resolve(ref: str) -> object:
    """``primus_ext.a.b.C``: the longest importable module prefix, then attributes."""
    parts = ref.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            try:
                obj = getattr(obj, attr)
            except ImportError as exc:  # a name that needs TransformerEngine, which this machine lacks
                assert "transformer_engine" in str(exc) and attr in getattr(obj, "__all__", ()), exc
                return None
        return obj
    raise ModuleNotFoundError(ref)


def test_the_patch_id_is_what_the_docs_call_it():
    from primus_ext.primus import PATCH_ID

    assert NOT_MODULES == {PATCH_ID}


def test_the_docs_show_imports():
    assert len(_imports()) >= 5 and len(_names()) >= 10


@pytest.mark.parametrize("where,line", _imports())
def test_an_import_in_the_docs_runs(where, line):
    exec(line.replace("(", "").replace(")", ""), {})  # noqa: S102 - the docs' own line


@pytest.mark.parametrize("where,ref", _names())
def test_a_name_in_the_docs_resolves(where, ref):
    resolve(ref)
