"""Keys of others never read as misspellings of ours: every top-level key of Primus fd1eeab's
``primus/configs`` YAMLs (listed in primus_config_keys.txt) and every field of megatron-core's
transformer configs passes the look-alike screen, through the readers a Primus run uses."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from primus_ext.settings import SETTING_KEYS, TurboAttentionSettings
from primus_ext.settings.primus_config import args_settings
from primus_ext.settings.settings import looks_like_ours

PRIMUS_KEYS = [line for line in (Path(__file__).with_name("primus_config_keys.txt")).read_text().splitlines()
               if line and not line.startswith("#")]


def test_the_key_list_is_primus_s_whole_config_tree():
    assert len(PRIMUS_KEYS) == 1024 and {"sink_level", "enable_packed_sequences", "attn_sliding_window"} <= set(
        PRIMUS_KEYS)


def test_no_primus_key_is_taken_for_one_of_ours():
    assert [key for key in PRIMUS_KEYS if key not in SETTING_KEYS and looks_like_ours(key)] == []


def test_no_megatron_core_config_field_is_taken_for_one_of_ours():
    fields = {f.name for cls in (TransformerConfig, MLATransformerConfig) for f in dataclasses.fields(cls)}
    assert [key for key in sorted(fields) if key not in SETTING_KEYS and looks_like_ours(key)] == []


def test_megatron_args_holding_every_primus_key_read_as_the_defaults():
    args = types.SimpleNamespace(**{key: None for key in PRIMUS_KEYS if key not in SETTING_KEYS})
    assert args_settings(args) == TurboAttentionSettings()
    assert TurboAttentionSettings.from_args(args) == TurboAttentionSettings()
