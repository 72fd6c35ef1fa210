"""One regression test per finding of the front door's third newcomer review (issue: the front door, round two).

Each test is a mistake a user made that ``check`` / ``selftest`` / ``demo`` accepted as a plan other than the
one the config asked for, or answered without naming the user's key; each failed on the commit reviewed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from primus_ext.cli import main

ROOT = Path(__file__).resolve().parents[1]
GPT_OSS = ROOT / "configs" / "examples" / "gpt_oss_sinks.yaml"


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def _yaml(tmp_path: Path, drop: tuple[str, ...] = (), **keys) -> str:
    data = {k: v for k, v in yaml.safe_load(GPT_OSS.read_text()).items() if k not in drop}
    data.update(keys)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize("command", [["check"], ["selftest"], ["demo", "--steps", "1"]])
def test_a_learned_sink_and_an_off_by_one_softmax_are_two_sources_for_one_sink(tmp_path, capsys, command):
    """megatron-core's off-by-one softmax made the sink a fixed zero buffer: use_sink_attention trained nothing."""
    path = _yaml(tmp_path, softmax_type="off-by-one")
    code, _, err = _run(capsys, command[0], path, *command[1:])
    assert code == 2 and "[use_sink_attention, softmax_type]" in err and "two sources for one sink" in err, err


@pytest.mark.parametrize("softmax_type", ["vanilla", "learnable"])
def test_a_learned_sink_with_a_learned_softmax_is_planned(tmp_path, capsys, softmax_type):
    code, _, err = _run(capsys, "check", _yaml(tmp_path, softmax_type=softmax_type))
    assert code == 0, err
