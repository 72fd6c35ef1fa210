"""TurboAttentionSettings: every key validated, look-alikes refused, foreign keys left alone.

The settings are the first thing a user's YAML meets, so each refusal must name the
offending key, and a whole config's mistakes must come back in one exception.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings as hyp_settings, strategies as st

from primus_ext.errors import UnsupportedConfigError
from primus_ext.settings import SETTING_KEYS, TurboAttentionSettings, describe_keys
from primus_ext.settings.settings import FOREIGN_KEYS, looks_like_ours

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "modules" / "megatron" / "primus_ext_attention.yaml"
FLEX_ON = {"use_turbo_attention": True, "use_turbo_flex_attention": True}


def refusal(mapping: Any) -> UnsupportedConfigError:
    with pytest.raises(UnsupportedConfigError) as info:
        TurboAttentionSettings.from_dict(mapping)
    return info.value


# ------------------------------------------------------------------ defaults/keys
def test_defaults_leave_everything_off() -> None:
    s = TurboAttentionSettings()
    assert s.use_turbo_attention is False and s.use_turbo_flex_attention is False
    assert s.turbo_flex_attention_mask_mod is None and s.turbo_flex_attention_score_mod is None
    assert s.turbo_flex_attention_backend == "auto"
    assert s.sink_sliding_window == 0
    assert TurboAttentionSettings.from_dict({}) == s


def test_setting_keys_and_describe_keys_follow_the_dataclass() -> None:
    names = tuple(f.name for f in dataclasses.fields(TurboAttentionSettings))
    assert SETTING_KEYS == names
    rows = describe_keys()
    assert [r[0] for r in rows] == list(names)
    defaults = TurboAttentionSettings().to_dict()
    for key, type_text, default, doc in rows:
        assert default == defaults[key]
        assert type_text and doc and "\n" not in doc


def test_to_dict_round_trips_and_is_yaml_dumpable() -> None:
    s = TurboAttentionSettings.from_dict({
        **FLEX_ON,
        "turbo_flex_attention_mask_mod": "primus_ext.attention.masks:prefix_lm",
        "turbo_flex_attention_mask_mod_kwargs": {"prefix_length": 64},
        "sink_sliding_window": 128,
    })
    again = TurboAttentionSettings.from_dict(yaml.safe_load(yaml.safe_dump(s.to_dict())))
    assert again == s and hash(again) == hash(s)


def test_settings_are_frozen_and_do_not_share_the_callers_kwargs() -> None:
    kwargs = {"prefix_length": 8}
    s = TurboAttentionSettings(**FLEX_ON, turbo_flex_attention_mask_mod="pkg.mod:factory",
                               turbo_flex_attention_mask_mod_kwargs=kwargs)
    kwargs["prefix_length"] = 99
    assert s.turbo_flex_attention_mask_mod_kwargs == {"prefix_length": 8}
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.use_turbo_attention = False  # type: ignore[misc]


# ------------------------------------------------------------- per-key refusals
@pytest.mark.parametrize("key", [k for k in SETTING_KEYS if isinstance(getattr(TurboAttentionSettings(), k), bool)])
@pytest.mark.parametrize("value", ["true", "false", 1, 0, None])
def test_bools_must_be_real_bools(key: str, value: Any) -> None:
    err = refusal({key: value})
    assert err.settings == (key,)
    assert key in str(err)


@pytest.mark.parametrize("value", [-1, "128", 1.5, True, None])
def test_sink_sliding_window_must_be_a_non_negative_int(value: Any) -> None:
    err = refusal({"sink_sliding_window": value})
    assert err.settings == ("sink_sliding_window",)
    assert "sink_sliding_window" in str(err)


@pytest.mark.parametrize("value", ["Turbo", "Flex", "", None, 1])
def test_backend_must_be_a_listed_choice(value: Any) -> None:
    err = refusal({**FLEX_ON, "turbo_flex_attention_backend": value})
    assert err.settings == ("turbo_flex_attention_backend",)
    assert "auto, turbo, reference, flex" in str(err)


@pytest.mark.parametrize("hook", ["turbo_flex_attention_mask_mod", "turbo_flex_attention_score_mod"])
@pytest.mark.parametrize("value", ["no_colon", "pkg.mod:", ":attr", "pkg mod:attr", "pkg.mod:a(1)",
                                   "os:system('x')", "pkg.mod:attr:more", 3, ["pkg.mod:attr"]])
def test_hook_strings_must_be_module_colon_attr(hook: str, value: Any) -> None:
    err = refusal({**FLEX_ON, hook: value})
    assert err.settings == (hook,)
    assert hook in str(err) and "package.module:attr" in str(err)


@pytest.mark.parametrize("value", ["a.b:c", "a:b.c.d", "_private.mod:_attr", "primus_ext.attention.masks:causal"])
def test_well_formed_hook_strings_are_accepted(value: str) -> None:
    s = TurboAttentionSettings.from_dict({**FLEX_ON, "turbo_flex_attention_mask_mod": value})
    assert s.turbo_flex_attention_mask_mod == value


@pytest.mark.parametrize("value", [[1, 2], "prefix_length=64", 64, {1: 2}, {"not an identifier": 1}])
def test_kwargs_must_be_a_mapping_of_keyword_names(value: Any) -> None:
    key = "turbo_flex_attention_score_mod_kwargs"
    err = refusal({**FLEX_ON, "turbo_flex_attention_score_mod": "pkg.mod:factory", key: value})
    assert err.settings == (key,)
    assert key in str(err)


@pytest.mark.parametrize("hook", ["turbo_flex_attention_mask_mod", "turbo_flex_attention_score_mod"])
def test_kwargs_without_their_hook_are_refused(hook: str) -> None:
    err = refusal({**FLEX_ON, f"{hook}_kwargs": {"prefix_length": 4}})
    assert f"{hook}_kwargs" in err.settings and hook in err.settings
    assert "ignored" in str(err)


def test_empty_kwargs_mapping_is_kept_distinct_from_null() -> None:
    s = TurboAttentionSettings.from_dict({**FLEX_ON, "turbo_flex_attention_mask_mod": "pkg.mod:causal",
                                          "turbo_flex_attention_mask_mod_kwargs": {}})
    assert s.turbo_flex_attention_mask_mod_kwargs == {}


def test_flex_keys_are_validated_when_flex_is_off() -> None:
    # the backend key is inert with flex off (B1), but a malformed value is still refused, so turning flex on
    # later cannot surprise ...
    s = TurboAttentionSettings.from_dict({"turbo_flex_attention_backend": "reference"})
    assert s.use_turbo_flex_attention is False
    err = refusal({"turbo_flex_attention_backend": "fast"})
    assert err.settings == ("turbo_flex_attention_backend",)


@pytest.mark.parametrize("hook", ["turbo_flex_attention_mask_mod", "turbo_flex_attention_score_mod"])
def test_a_hook_with_flex_off_is_refused(hook) -> None:
    # ... and a hook is refused: the direct path runs none, so the layers would compute another attention
    err = refusal({hook: "pkg.mod:hook", "use_turbo_attention": True})
    assert err.settings == (hook, "use_turbo_flex_attention") and "runs no hook" in str(err)


def test_flex_without_turbo_attention_is_left_to_the_plan_builder() -> None:
    # B3 is a plan rule (reported together with the other rules); the settings accept the pair.
    s = TurboAttentionSettings.from_dict({"use_turbo_flex_attention": True})
    assert s.use_turbo_flex_attention and not s.use_turbo_attention


# --------------------------------------------------------------- unknown keys
@pytest.mark.parametrize("typo,meant", [
    ("use_turbo_flex_atention", "use_turbo_flex_attention"),
    ("use_turbo_attenton", "use_turbo_attention"),
    ("turbo_flex_attention_maskmod", "turbo_flex_attention_mask_mod"),
    ("turbo_flex_attention_mask_mod_kwarg", "turbo_flex_attention_mask_mod_kwargs"),
    ("turbo_flex_attention_backends", "turbo_flex_attention_backend"),
    ("sink_sliding_windows", "sink_sliding_window"),
    ("sink_window_odd_layers_only", "sink_window_even_layers_only"),
    ("enable_turbo_attention_fp8", "enable_turbo_attention_float8"),
    ("use_sinks_attention", "use_sink_attention"),
])
def test_lookalike_keys_are_refused_with_a_suggestion(typo: str, meant: str) -> None:
    err = refusal({typo: True})
    assert err.settings == (typo,)
    assert f"did you mean `{meant}`?" in str(err)


@pytest.mark.parametrize("key", ["turbo_flex_attention_whatever", "sink_size", "use_turbo_flash_attn"])
def test_keys_with_our_prefixes_are_refused(key: str) -> None:
    err = refusal({key: 1})
    assert err.settings == (key,) and "did you mean" in str(err)


MEGATRON_AND_PRIMUS = {
    "num_layers": 24, "seq_length": 4096, "window_size": [128, 0], "attention_backend": "flash",
    "use_flash_attn": True, "attention_dropout": 0.0, "context_parallel_size": 1,
    "use_kitchen_attention": False, "kitchen_attention_backend": "sdpa",
    "enable_primus_turbo": True, "turbo_gemm_backend": "default", "turbo_deepep_num_cu": 32,
    **{k: True for k in FOREIGN_KEYS},
    "use_turbo_fp4_gemm": True,  # a future Primus switch: not attention, so not ours
}


def test_megatron_and_other_primus_keys_are_ignored() -> None:
    assert not any(looks_like_ours(k) for k in MEGATRON_AND_PRIMUS)
    data = {**MEGATRON_AND_PRIMUS, **FLEX_ON}
    before = dict(data)
    s = TurboAttentionSettings.from_dict(data)
    assert s.use_turbo_flex_attention is True
    assert data == before  # the caller's mapping is not consumed or edited


def test_several_mistakes_come_back_in_one_exception() -> None:
    err = refusal({
        **MEGATRON_AND_PRIMUS,
        "use_turbo_attention": "yes",
        "use_turbo_flex_atention": True,
        "sink_sliding_window": -4,
        "turbo_flex_attention_backend": "fast",
        "turbo_flex_attention_score_mod": "not a hook",
    })
    expected = {"use_turbo_attention", "use_turbo_flex_atention", "sink_sliding_window",
                "turbo_flex_attention_backend", "turbo_flex_attention_score_mod"}
    assert set(err.settings) == expected
    assert len(err.reasons) == 5 and "5 reasons" in str(err)
    assert not set(err.settings) & set(MEGATRON_AND_PRIMUS)


def test_from_dict_refuses_a_non_mapping() -> None:
    with pytest.raises(UnsupportedConfigError, match="mapping"):
        TurboAttentionSettings.from_dict([("use_turbo_attention", True)])  # type: ignore[arg-type]


# ------------------------------------------------------------------ from_yaml
def test_from_yaml_reads_a_flat_mapping_with_foreign_keys(tmp_path: Path) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text("num_layers: 4\nuse_turbo_attention: true\nuse_turbo_flex_attention: true\n"
                    "turbo_flex_attention_mask_mod: primus_ext.attention.masks:prefix_lm\n"
                    "turbo_flex_attention_mask_mod_kwargs: {prefix_length: 64}\n")
    s = TurboAttentionSettings.from_yaml(path)
    assert s.turbo_flex_attention_mask_mod_kwargs == {"prefix_length": 64}


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_from_yaml_refuses_a_non_mapping_file(tmp_path: Path, text: str) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    with pytest.raises(UnsupportedConfigError, match="mapping") as info:
        TurboAttentionSettings.from_yaml(path)
    assert str(path) in str(info.value)


def test_from_yaml_refuses_broken_yaml_and_quoted_bools(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("use_turbo_attention: [true\n")
    with pytest.raises(UnsupportedConfigError, match="not valid YAML"):
        TurboAttentionSettings.from_yaml(broken)
    quoted = tmp_path / "quoted.yaml"
    quoted.write_text('use_turbo_attention: "true"\n')
    with pytest.raises(UnsupportedConfigError, match="use_turbo_attention"):
        TurboAttentionSettings.from_yaml(quoted)


def test_from_yaml_empty_file_means_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing set\n")
    assert TurboAttentionSettings.from_yaml(path) == TurboAttentionSettings()


# ------------------------------------------------------------------ from_args
def test_from_args_reads_an_argparse_namespace() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--use-turbo-attention", action="store_true")
    parser.add_argument("--use-turbo-flex-attention", action="store_true")
    parser.add_argument("--sink-sliding-window", type=int, default=0)
    parser.add_argument("--num-layers", type=int, default=2)
    args = parser.parse_args(["--use-turbo-attention", "--use-turbo-flex-attention",
                              "--sink-sliding-window", "128"])
    s = TurboAttentionSettings.from_args(args)
    assert s.use_turbo_flex_attention is True and s.sink_sliding_window == 128
    assert s.turbo_flex_attention_backend == "auto"  # missing -> default


def test_from_args_validates_and_refuses_lookalikes() -> None:
    args = argparse.Namespace(use_turbo_attention=True, sink_sliding_window=-1,
                              use_turbo_flex_atention=True, num_layers=2)
    with pytest.raises(UnsupportedConfigError) as info:
        TurboAttentionSettings.from_args(args)
    assert set(info.value.settings) == {"sink_sliding_window", "use_turbo_flex_atention"}


def test_from_args_accepts_any_object() -> None:
    class Args:
        __slots__ = ("use_turbo_attention",)

        def __init__(self) -> None:
            self.use_turbo_attention = True

    assert TurboAttentionSettings.from_args(Args()).use_turbo_attention is True
    assert TurboAttentionSettings.from_args(types.SimpleNamespace()) == TurboAttentionSettings()


# -------------------------------------------------------------------- replace
def test_replace_validates_and_refuses_unknown_keys() -> None:
    s = TurboAttentionSettings(**FLEX_ON)
    assert s.replace(sink_sliding_window=64).sink_sliding_window == 64
    with pytest.raises(UnsupportedConfigError, match="sink_sliding_window"):
        s.replace(sink_sliding_window="64")
    with pytest.raises(UnsupportedConfigError, match="did you mean `use_sink_attention`"):
        s.replace(use_sink_atention=True)
    with pytest.raises(UnsupportedConfigError, match="num_layers"):
        s.replace(num_layers=4)  # replace() only takes our keys


@hyp_settings(max_examples=60, deadline=None)
@given(flags=st.fixed_dictionaries({k: st.booleans() for k in (
           "use_sink_attention", "sink_window_even_layers_only", "enable_turbo_attention_float8",
           "deterministic_mode", "reset_attention_mask")}),
       window=st.integers(min_value=0, max_value=1 << 20),
       backend=st.sampled_from(["auto", "turbo", "reference"]))
def test_valid_settings_round_trip(flags: dict[str, bool], window: int, backend: str) -> None:
    s = TurboAttentionSettings.from_dict({**FLEX_ON, **flags, "sink_sliding_window": window,
                                          "turbo_flex_attention_backend": backend})
    assert TurboAttentionSettings.from_dict(s.to_dict()) == s


# --------------------------------------------------------------- module YAML
def test_module_yaml_documents_every_key_with_its_default() -> None:
    data = yaml.safe_load(CONFIG.read_text())
    assert tuple(data) == SETTING_KEYS
    assert data == TurboAttentionSettings().to_dict()
    assert TurboAttentionSettings.from_yaml(CONFIG) == TurboAttentionSettings()


def test_module_yaml_has_a_comment_before_every_key() -> None:
    lines = CONFIG.read_text().splitlines()
    for i, line in enumerate(lines):
        if line and not line.startswith("#"):
            assert lines[i - 1].startswith("#"), f"no comment above {line!r}"
            assert "(B" in "\n".join(lines[max(0, i - 3):i]), f"no spec reference above {line!r}"
