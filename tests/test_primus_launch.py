"""`primus_ext.settings.primus_launch`: the environment Primus's patches run in, predicted before
Primus starts, against the stand-in's literal copy of Primus's ``_apply_config_env`` (which sets
``os.environ`` and expands with ``os.path.expandvars``, as train_runtime.py:307-358 does)."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from primus_ext.settings.primus_launch import (PATCH_ID, PRIMUS_PROVIDER_PATCH, config_argument, experiment_env,
                                               patch_environment, patch_filter_reasons)
from primus_ext.testing.fake_primus import apply_config_env


def primus_applies(path, monkeypatch, environ: dict[str, str]) -> dict[str, str]:
    """What Primus leaves in os.environ, run for real in this process (restored after, every key)."""
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(environ)
        apply_config_env(str(path))
        return dict(os.environ)
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.parametrize("argv, expected", [
    (["primus/cli/main.py", "train", "pretrain", "--config", "exp.yaml"], "exp.yaml"),
    (["primus/cli/main.py", "train", "pretrain", "--config=exp.yaml"], "exp.yaml"),
    (["-m", "primus.cli.main", "train", "pretrain", "--conf", "exp.yaml"], "exp.yaml"),
    (["primus/cli/main.py", "train", "pretrain", "--exp", "exp.yaml"], "exp.yaml"),
    (["primus/cli/main.py", "train", "pretrain", "--c", "exp.yaml"], "exp.yaml"),
    (["primus/cli/main.py", "train", "pretrain", "--config", "a.yaml", "--config=b.yaml"], "b.yaml"),
    (["primus/cli/main.py", "train", "pretrain", "--export_config", "out.yaml"], None),
    (["primus/cli/main.py", "train", "pretrain"], None),
])
def test_the_experiment_is_found_on_primus_s_command_line(argv, expected):
    assert config_argument(argv) == expected


BLOCKS = [
    "env:\n  PRIMUS_PATCHES: megatron.turbo.te_spec_provider\n",
    "env:\n  A: one\n  B: $A-${A}-$MISSING-${MISSING:x}\n  FLAG: true\n  N: 3\n",
    "env:\n  HOME: $HOME/sub\n",
    "env: [PRIMUS_PATCHES]\n",  # no mapping: ignored
    "env:\n",
    "env: {}\n",
    "modules: {}\n",
    "env:\n  A: [unclosed\n",  # not YAML: Primus prints and goes on
    "env:\n  A: one\n  B=C: two\n  PRIMUS_PATCHES: none\n",  # os.environ refuses B=C: Primus stops there
    "env:\n  A: one\n  '': two\n  PRIMUS_PATCHES: none\n",
]


@pytest.mark.parametrize("block", BLOCKS)
def test_the_predicted_environment_is_what_primus_sets(tmp_path, monkeypatch, block):
    path = tmp_path / "exp.yaml"
    path.write_text(block)
    shell = {"HOME": "/root", "PRIMUS_PATCHES": "all"}
    assert patch_environment(config_argument(["--config", str(path)]), shell)[0] == primus_applies(path, monkeypatch, shell)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["A", "B", "PRIMUS_PATCHES", "X_1"]),
                          st.lists(st.sampled_from(["$A", "${B}", "$X_1", "${PRIMUS_PATCHES}", "$", "{", "}", "a",
                                                    "-", "$$", "${", " "]), max_size=6).map("".join)),
                min_size=1, max_size=5))
def test_expansion_in_order_matches_os_path_expandvars(tmp_path_factory, entries):
    import yaml

    path = tmp_path_factory.mktemp("env") / "exp.yaml"
    path.write_text(yaml.safe_dump({"env": dict(entries)}))
    shell = {"A": "shell-a"}
    with pytest.MonkeyPatch.context() as monkeypatch:
        assert patch_environment(config_argument(["--config", str(path)]), shell)[0] == primus_applies(path, monkeypatch, shell)


def test_a_missing_experiment_sets_nothing(tmp_path):
    assert experiment_env(str(tmp_path / "absent.yaml"), {}) == {}
    assert experiment_env(None, {}) == {}


@pytest.mark.parametrize("value, missing", [
    ("", ()), ("all", ()), ("ALL", ()),
    ("none", (PRIMUS_PROVIDER_PATCH, PATCH_ID)),
    (PRIMUS_PROVIDER_PATCH, (PATCH_ID,)),
    (f" {PATCH_ID} , {PRIMUS_PROVIDER_PATCH} ", ()),
    (PATCH_ID, (PRIMUS_PROVIDER_PATCH,)),
])
def test_the_filter_is_read_as_primus_reads_it(value, missing):
    reasons = patch_filter_reasons({"PRIMUS_PATCHES": value}, "here")
    assert bool(reasons) == bool(missing)
    for pid in missing:
        assert pid in reasons[0].reason
    assert patch_filter_reasons({"PRIMUS_PATCHES": value}, ids=()) == []


def test_primus_s_own_flex_path_is_found_by_its_file_or_by_its_key(tmp_path):
    from primus_ext.settings.primus_owner import gives_key_to_primus, primus_flex_path

    assert primus_flex_path(str(tmp_path)) is None
    keys = tmp_path / "configs" / "modules" / "megatron" / "primus_turbo.yaml"
    keys.parent.mkdir(parents=True)
    keys.write_text("use_turbo_attention: false\n")
    assert primus_flex_path(str(tmp_path)) is None
    keys.write_text("use_turbo_attention: false\nuse_turbo_flex_attention: false\n")
    assert primus_flex_path(str(tmp_path)) == str(keys)
    own = tmp_path / "backends" / "megatron" / "core" / "extensions" / "turbo_flex_attention.py"
    own.parent.mkdir(parents=True)
    own.write_text("")
    assert primus_flex_path(str(tmp_path)) == str(own)
    assert gives_key_to_primus("primus", str(own)) and not gives_key_to_primus("primus", None)
    assert not gives_key_to_primus("primus_ext", str(own))
