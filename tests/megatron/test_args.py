"""Settings from Megatron's command line: the flags, the round trip, and the ``get_args()`` fallback.

megatron-core's wheel has no ``megatron.training`` (so no ``get_args()``); the tests
that need one put a fake module into ``sys.modules`` with pytest's ``monkeypatch``,
which restores the previous state afterwards (checked by the ``clean_modules`` fixture).
"""

from __future__ import annotations

import argparse
import sys
import types

import pytest
from megatron.core.transformer.enums import AttnMaskType

from primus_ext.errors import UnsupportedConfigError
from primus_ext.megatron import PrimusTurboLocalAttention, add_turbo_attention_args, settings_or_megatron_args
from primus_ext.megatron.args import megatron_arg
from primus_ext.settings import SETTING_KEYS, TurboAttentionSettings
from tests.megatron import gpt

ARGV = ["--use-turbo-attention", "--use-turbo-flex-attention",
        "--turbo-flex-attention-mask-mod", "pkg.mod:fn",
        "--turbo-flex-attention-mask-mod-kwargs", '{"prefix_length": 4}',
        "--sink-sliding-window", "128"]


def flag(key: str) -> str:
    return "--" + key.replace("_", "-")


@pytest.fixture(autouse=True)
def clean_modules():
    before = sys.modules.get("megatron.training", "absent")
    yield
    assert sys.modules.get("megatron.training", "absent") is before


def fake_megatron_training(monkeypatch, get_args) -> types.ModuleType:
    module = types.ModuleType("megatron.training")
    module.get_args = get_args  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "megatron.training", module)
    return module


def megatron_lm_namespace(**ours) -> argparse.Namespace:
    """What Megatron-LM's parse_args returns: its own arguments mixed with ours."""
    return argparse.Namespace(num_layers=2, hidden_size=64, seq_length=16, position_embedding_type="learned_absolute",
                              tensor_model_parallel_size=1, use_flash_attn=False, **ours)


# --------------------------------------------------------------------------- flags
def test_every_settings_key_becomes_a_flag_with_its_own_dest():
    parser = add_turbo_attention_args(argparse.ArgumentParser())
    actions = parser._option_string_actions  # argparse's own flag -> action table
    for key in SETTING_KEYS:
        assert flag(key) in actions, key
        assert actions[flag(key)].dest == key
    defaults = vars(parser.parse_args([]))
    assert defaults == TurboAttentionSettings().to_dict()


def test_parsed_flags_round_trip_through_settings():
    ns = add_turbo_attention_args(argparse.ArgumentParser()).parse_args(ARGV)
    settings = TurboAttentionSettings.from_args(ns)
    assert settings == TurboAttentionSettings.from_dict(dict(
        use_turbo_attention=True, use_turbo_flex_attention=True, turbo_flex_attention_mask_mod="pkg.mod:fn",
        turbo_flex_attention_mask_mod_kwargs={"prefix_length": 4}, sink_sliding_window=128))
    assert settings.sink_sliding_window == 128 and isinstance(settings.sink_sliding_window, int)
    assert settings.turbo_flex_attention_mask_mod_kwargs == {"prefix_length": 4}
    assert TurboAttentionSettings.from_args(argparse.Namespace(**settings.to_dict())) == settings
    # The flags also work next to Megatron-LM's own arguments in one namespace.
    assert TurboAttentionSettings.from_args(megatron_lm_namespace(**vars(ns))) == settings


@pytest.mark.parametrize("argv", [["--sink-sliding-window", "wide"],
                                  ["--turbo-flex-attention-mask-mod-kwargs", "{prefix_length: 4}"]],
                         ids=["int", "json"])
def test_malformed_flag_values_stop_the_parser(argv, capsys):
    with pytest.raises(SystemExit):
        add_turbo_attention_args(argparse.ArgumentParser()).parse_args(argv)
    assert flag(argv[0][2:].replace("-", "_")) in capsys.readouterr().err


def test_invalid_values_parsed_from_flags_are_refused_by_settings():
    ns = add_turbo_attention_args(argparse.ArgumentParser()).parse_args(
        ["--turbo-flex-attention-backend", "cuda", "--turbo-flex-attention-mask-mod-kwargs", "[1]"])
    with pytest.raises(UnsupportedConfigError) as info:
        TurboAttentionSettings.from_args(ns)
    assert {"turbo_flex_attention_backend", "turbo_flex_attention_mask_mod_kwargs"} <= set(info.value.settings)


def test_flags_megatron_lm_already_defines_are_shared_not_duplicated():
    """Megatron-LM's parse_args defines --reset-attention-mask and --deterministic-mode before it
    calls the extra_args_provider; adding them again would make argparse raise."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--reset-attention-mask", action="store_true")
    parser.add_argument("--deterministic-mode", action="store_true")
    add_turbo_attention_args(parser)
    for key in SETTING_KEYS:
        assert flag(key) in parser._option_string_actions
    ns = parser.parse_args(["--use-turbo-attention", "--reset-attention-mask", "--deterministic-mode"])
    settings = TurboAttentionSettings.from_args(ns)
    assert settings.reset_attention_mask and settings.deterministic_mode and settings.use_turbo_attention


def test_a_clashing_flag_with_another_meaning_is_still_an_error():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sink-sliding-window", dest="something_else", type=int)
    with pytest.raises(argparse.ArgumentError):
        add_turbo_attention_args(parser)


# ------------------------------------------------------------------ get_args() fallback
def test_no_settings_reads_megatron_lm_args(monkeypatch):
    ns = add_turbo_attention_args(argparse.ArgumentParser()).parse_args(ARGV)
    fake_megatron_training(monkeypatch, lambda: megatron_lm_namespace(**vars(ns)))
    assert settings_or_megatron_args(None) == TurboAttentionSettings.from_args(ns)
    assert megatron_arg("seq_length") == 16 and megatron_arg("not_an_arg", "dflt") == "dflt"


def test_explicit_settings_win_over_megatron_lm_args(monkeypatch):
    fake_megatron_training(monkeypatch, lambda: megatron_lm_namespace(use_turbo_attention=True))
    given = TurboAttentionSettings()
    assert settings_or_megatron_args(given) is given


def test_defaults_when_megatron_training_is_absent(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron.training", None)  # import now raises ImportError
    with pytest.raises(ImportError):
        import megatron.training  # noqa: F401
    assert settings_or_megatron_args(None) == TurboAttentionSettings()
    assert megatron_arg("position_embedding_type", "learned_absolute") == "learned_absolute"


def test_defaults_when_megatron_args_are_not_parsed_yet(monkeypatch):
    def get_args():
        raise AssertionError("args is not initialized.")  # what Megatron-LM's get_args does then

    fake_megatron_training(monkeypatch, get_args)
    assert settings_or_megatron_args(None) == TurboAttentionSettings()


def test_megatron_lm_args_reach_a_module_built_without_settings(monkeypatch):
    """Primus builds core attention from Megatron's global args: the module reads them."""
    keys = dict(use_turbo_attention=True, use_turbo_flex_attention=True, turbo_flex_attention_backend="reference",
                sink_sliding_window=4)
    fake_megatron_training(monkeypatch, lambda: megatron_lm_namespace(**keys))
    module = PrimusTurboLocalAttention(gpt.config(), 1, AttnMaskType.causal, "self")
    assert module.plan.path == "flex" and module.plan.window == (4, 0)
    assert module.core.settings == TurboAttentionSettings.from_dict(keys)

    # Megatron-LM's own position_embedding_type is read too: ALiBi there is refused at build time.
    alibi = megatron_lm_namespace(**keys)
    alibi.position_embedding_type = "alibi"
    fake_megatron_training(monkeypatch, lambda: alibi)
    with pytest.raises(UnsupportedConfigError) as info:
        PrimusTurboLocalAttention(gpt.config(), 1, AttnMaskType.causal, "self")
    assert "position_embedding_type" in info.value.settings


def test_megatron_reset_attention_mask_is_seen_even_with_explicit_settings(monkeypatch):
    """B25: Megatron-LM's own --reset-attention-mask cannot be hidden by explicit Turbo settings: the
    layer reads the documents from Megatron's mask, or refuses where it cannot (here: a hook)."""
    explicit = TurboAttentionSettings.from_dict(dict(use_turbo_attention=True, use_turbo_flex_attention=True,
                                                     turbo_flex_attention_backend="reference"))
    hooked = TurboAttentionSettings.from_dict(dict(
        use_turbo_attention=True, use_turbo_flex_attention=True, turbo_flex_attention_backend="reference",
        turbo_flex_attention_mask_mod="primus_ext.attention.masks:causal", turbo_flex_attention_mask_mod_kwargs={}))
    assert not PrimusTurboLocalAttention(gpt.config(), 1, AttnMaskType.causal, "self",
                                         settings=explicit).core.plan.mask_documents
    PrimusTurboLocalAttention(gpt.config(), 1, AttnMaskType.causal, "self", settings=hooked)
    fake_megatron_training(monkeypatch, lambda: megatron_lm_namespace(reset_attention_mask=True))
    assert PrimusTurboLocalAttention(gpt.config(), 1, AttnMaskType.causal, "self",
                                     settings=explicit).core.plan.mask_documents
    with pytest.raises(UnsupportedConfigError) as info:
        PrimusTurboLocalAttention(gpt.config(), 1, AttnMaskType.causal, "self", settings=hooked)
    assert "reset_attention_mask" in info.value.settings and "B25-layer" in info.value.codes


def test_config_deterministic_mode_reaches_the_plan():
    """B24: TransformerConfig.deterministic_mode counts like the Turbo key, and reaches the kernel."""
    from primus_ext.testing import fake_primus_turbo

    explicit = TurboAttentionSettings.from_dict(dict(use_turbo_attention=True, use_turbo_flex_attention=True,
                                                     turbo_flex_attention_backend="turbo", sink_sliding_window=4))
    with fake_primus_turbo() as fake:
        for mode in (False, True):
            fake.reset()
            model = gpt.build_gpt(explicit, gpt.config(deterministic_mode=mode))
            assert all(m.plan.deterministic is mode for m in gpt.attention_modules(model))
            gpt.logits(model, gpt.batches(1)[0])
            assert [c.args["deterministic"] for c in fake.calls] == [mode] * len(fake.calls) and fake.calls
