"""scripts/setup.sh installs once per pyproject.toml, torch pin and script: a later run installs nothing, and a
changed pyproject.toml installs again (its dependencies may have changed)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tree(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    bin_ = tmp_path / ".venv" / "bin"
    bin_.mkdir(parents=True)
    # this venv's python, logging each call; pip is refused so that an install shows as a failed run
    (bin_ / "python").write_text(f'#!/bin/sh\necho "$*" >> "{tmp_path}/calls"\n'
                                 f'[ "$1 $2" = "-m pip" ] && exit 3\nexec "{sys.executable}" "$@"\n')
    (bin_ / "python").chmod(0o755)
    return tmp_path


def _setup(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/setup.sh"], cwd=tree, capture_output=True, text=True)


def _stamp(tree: Path) -> None:
    """Run the script with pip allowed to "succeed" (a no-op), so that it writes its stamp."""
    python = tree / ".venv" / "bin" / "python"
    python.write_text(python.read_text().replace("exit 3", "exit 0"))
    assert _setup(tree).returncode == 0
    python.write_text(python.read_text().replace("exit 0", "exit 3"))
    (tree / "calls").unlink()


def test_a_later_run_installs_nothing(tmp_path):
    tree = _tree(tmp_path)
    _stamp(tree)
    run = _setup(tree)
    assert run.returncode == 0, run.stderr
    assert "already installed" in run.stderr and "ready: torch 2.13.0" in run.stderr
    assert "-m pip" not in (tree / "calls").read_text()


def test_a_changed_pyproject_installs_again(tmp_path):
    tree = _tree(tmp_path)
    _stamp(tree)
    with open(tree / "pyproject.toml", "a") as f:
        f.write("\n# a dependency changed\n")
    run = _setup(tree)
    assert run.returncode == 3 and "-m pip install" in (tree / "calls").read_text()
    assert not (tree / ".venv" / ".primus-ext-setup").exists()


def test_a_first_run_that_fails_leaves_no_stamp(tmp_path):
    tree = _tree(tmp_path)
    assert _setup(tree).returncode == 3
    assert not (tree / ".venv" / ".primus-ext-setup").exists()
