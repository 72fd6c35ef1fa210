"""Fixtures shared by the test modules."""

from __future__ import annotations

import itertools
import sys
import textwrap
from pathlib import Path
from typing import Callable, Iterator

import pytest

_counter = itertools.count()


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], str]]:
    """Write ``source`` as a fresh, uniquely named module on sys.path; return its name."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written: list[str] = []

    def write(source: str) -> str:
        name = f"user_hooks_{next(_counter)}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        written.append(name)
        return name

    yield write
    for name in written:
        sys.modules.pop(name, None)
