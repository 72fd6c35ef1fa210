"""Every documented key, given a wrong-typed, out-of-range or malformed value, is refused alike by ``check``,
``demo`` and ``selftest``: exit 2, our message naming the key, no traceback.

The keys and their types are read from docs/yaml_reference.md (the Turbo keys' table and the Megatron keys'
table), so a key documented later is covered without editing this file, and a type this file cannot make
wrong values for fails the test.  The same values are also given through a Primus experiment's
``overrides`` (``check`` only: the merge is the same for all three commands).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from primus_ext.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "yaml_reference.md"
TREE = ROOT / "tests" / "megatron" / "primus_tree"
EXP = TREE / "examples" / "megatron" / "configs" / "tiny_gpt-pretrain.yaml"

BASE = {"use_turbo_attention": True, "use_turbo_flex_attention": True, "turbo_flex_attention_backend": "reference",
        "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2, "seq_length": 64}

INT_POSITIVE = ["8", 2.5, 0, -3, True, [8], 2 ** 31]
WRONG_BY_TYPE: dict[str, list[Any]] = {
    "bool": ["yes please", 2, [True], {"a": 1}, 0.5],
    "bool or null": ["sometimes", 2, [True]],
    "int >= 0": ["12", 1.5, -1, True, [1]],
    "int or null": ["3", 1.5, True, [1]],
    "int > 0": INT_POSITIVE,
    "int > 0 (required)": INT_POSITIVE,
    "int > 0 or null": INT_POSITIVE,
    "str or null": [5, ["a"], {"a": 1}, True],
    "mapping or null": ["x", [1], 3],
    "str": [5, True, ["rope"]],
    "str, or a list of str per layer": [2, [1], True],
    "[left, right] of int >= -1": ["128,0", [128, 0, 5], [12.5, 0], 128, ["a", "b"], [-2, 0], [], {"left": 4}],
    "int > 0, or a list of 0 / 1 per layer": [0, "x", [2, 2], 1.5, [1], {"a": 1}],
    "number in [0, 1)": ["high", 1.0, -0.1, True, [0.1]],
    "number > 0 or null": ["0.1", 0, -1.0, True],
}
CHOICE = re.compile(r"^[\w-]+( or [\w-]+)+( \(or torch's names\))?$")


def documented() -> list[tuple[str, str]]:
    """``(key, type)`` of every row of the two key tables."""
    rows = []
    for line in DOC.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and re.fullmatch(r"`\w+`", cells[0]):
            rows.append((cells[0].strip("`"), cells[1]))
    return rows


def wrong_values(kind: str) -> list[Any]:
    if kind in WRONG_BY_TYPE:
        return WRONG_BY_TYPE[kind]
    if CHOICE.fullmatch(kind):  # a choice: a misspelling, a number, a list
        return ["bogus", 3, [kind.split(" or ")[0]], True] if "true" not in kind else ["bogus", 3, ["auto"]]
    raise AssertionError(f"docs/yaml_reference.md gives a type this test cannot make wrong values for: {kind!r}")


CASES = [pytest.param(key, value, id=f"{key}={value!r}"[:80]) for key, kind in documented()
         for value in wrong_values(kind)]


def test_both_tables_are_read():
    keys = {key for key, _ in documented()}
    assert {"use_turbo_flex_attention", "packed_sequences", "window_size", "tensor_model_parallel_size"} <= keys
    assert len(CASES) > 150


def _write(tmp_path: Path, config: dict) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return str(path)


def _run(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("key,value", CASES)
def test_every_command_refuses_a_wrong_value_with_our_message(tmp_path, capsys, key, value):
    path = _write(tmp_path, {**BASE, key: value})
    for command in (["check", path], ["selftest", path], ["demo", path, "--steps", "1"]):
        code, out, err = _run(capsys, command)
        assert code == 2, (command, out, err)
        assert "Traceback" not in out + err
        assert key in err, (command, err)
        assert ("Alternative:" in err) or ("for example" in err), (command, err)
        assert "loss=" not in out, "the demo trained on a config it should have refused"


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("primus")
    shutil.copytree(TREE, root, dirs_exist_ok=True)
    return root


@pytest.mark.parametrize("key,value", CASES[::3])
def test_an_experiment_s_overrides_are_read_by_the_same_readers(tree, capsys, monkeypatch, key, value):
    for name in ("PRIMUS_SEQ_LENGTH", "PRIMUS_TP", "PRIMUS_MODEL", "TOKENIZED_DATA_PATH", "PRIMUS_PATCHES"):
        monkeypatch.delenv(name, raising=False)
    experiment = tree / EXP.relative_to(TREE)
    data = yaml.safe_load(EXP.read_text())
    data["modules"]["pre_trainer"]["overrides"][key] = value
    experiment.write_text(yaml.safe_dump(data))
    code, out, err = _run(capsys, ["check", str(experiment), "--primus-root", str(tree)])
    assert code == 2 and "Traceback" not in out + err and key in err, (out, err)
