"""No key the docs name is dropped silently: each one reaches the plan, the same way for ``check``,
the demo and the Megatron modules.

Keys are collected from every YAML the project shows a user: the ```yaml blocks of the README and
docs/, the example and module configs, and the two key tables of docs/yaml_reference.md.  Each
must be a Turbo setting, a Megatron key the plan reads, a model-shape key, or the demo's own
mapping; and for each Turbo setting and each Megatron key the plan reads, changing it in a YAML
mapping changes what the plan is built from.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from primus_ext.megatron.args import add_turbo_attention_args
from primus_ext.megatron.facts import layer_facts
from primus_ext.settings import SETTING_KEYS, TurboAttentionSettings

ROOT = Path(__file__).resolve().parent.parent
BASE = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2, "seq_length": 32}
MEGATRON_READ = {
    # key: a value that differs from the base (the fact it must change is checked below)
    "num_attention_heads": 8, "num_query_groups": 4, "kv_channels": 32, "tensor_model_parallel_size": 2,
    "hidden_size": 128, "window_size": [4, 0], "window_attn_skip_freq": 2, "attention_dropout": 0.1,
    "context_parallel_size": 2, "cp_comm_type": "p2p", "position_embedding_type": "rope",
    "softmax_type": "learnable", "seq_length": 64, "softmax_scale": 0.5, "bf16": True, "fp16": True,
    "params_dtype": "fp16", "packed_sequences": True, "group_query_attention": False,
    "multi_latent_attention": True, "qk_head_dim": 24, "qk_pos_emb_head_dim": 16, "v_head_dim": 24,
}
"""Megatron keys `layer_facts` reads (a YAML in ``check``, a ``TransformerConfig`` in the modules)."""
SHAPE_ONLY = {"num_layers"}  # read by ``check`` and the demo for the layer count, not per layer
MLA = {"multi_latent_attention": True, "qk_head_dim": 16, "qk_pos_emb_head_dim": 8, "v_head_dim": 16}
VALIDATED = {"pipeline_model_parallel_size": 3}
"""Keys ``check`` reads only to refuse a model megatron-core would not build (not a layer fact): each value here
is one megatron-core refuses with the base shape."""
OTHER = {"demo"}  # the demo's own mapping, ignored by the Turbo settings
MEGATRON_OWN = {"spec"}
PRIMUS_READ = {"enable_primus_turbo"}  # Primus's switch, read by the Primus patch's condition  # Megatron-LM's own argument (the layer spec it imports), shown in docs/primus.md


def _mapping_keys(data: dict) -> list[str]:
    """A YAML's keys: the top level, or for a Primus experiment (``modules:``) the keys of each
    module's ``overrides``, which Primus merges into Megatron's arguments."""
    if "modules" not in data:
        return list(data)
    return [key for module in data["modules"].values() for key in (module.get("overrides") or {})]


def yaml_keys() -> dict[str, str]:
    """Every top-level key of every YAML the project shows, with where it was seen."""
    found: dict[str, str] = {}
    texts = [(p, p.read_text()) for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]]
    for path, text in texts:
        for block in re.findall(r"```yaml\n(.*?)```", text, flags=re.S):
            for key in _mapping_keys(yaml.safe_load(block) or {}):
                found.setdefault(key, str(path.relative_to(ROOT)))
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        for key in yaml.safe_load(path.read_text()) or {}:
            found.setdefault(key, str(path.relative_to(ROOT)))
    reference = (ROOT / "docs" / "yaml_reference.md").read_text()
    for row in re.findall(r"^\| (`[^|]+`) \|", reference, flags=re.M):
        for key in re.findall(r"`(\w+)`", row):
            found.setdefault(key, "docs/yaml_reference.md")
    return found


def test_every_key_the_docs_name_is_one_the_plan_reads():
    known = set(SETTING_KEYS) | set(MEGATRON_READ) | set(VALIDATED) | {"sequence_parallel"} | SHAPE_ONLY | OTHER | MEGATRON_OWN | PRIMUS_READ
    unknown = {key: where for key, where in yaml_keys().items() if key not in known}
    assert not unknown, f"keys shown to users that nothing reads: {unknown}"


@pytest.mark.parametrize("key", sorted(MEGATRON_READ))
def test_each_megatron_key_changes_the_layer_facts(key):
    # window_attn_skip_freq decides which layers get window_size: layer 2 of every 2nd has none
    context, layer = ({"window_size": [4, 0]}, 2) if key == "window_attn_skip_freq" else ({}, 1)
    if key in MLA:  # MLA's head dims are read only under MLA, and MLA needs them
        context = {k: v for k, v in MLA.items() if k != key or key != "multi_latent_attention"}
    base = layer_facts({**BASE, **context}, layer)
    changed = layer_facts({**BASE, **context, key: MEGATRON_READ[key]}, layer)
    assert changed != base, key


@pytest.mark.parametrize("key", sorted(VALIDATED))
def test_each_validated_key_is_checked_as_megatron_core_checks_it(key):
    from primus_ext.megatron.validate import transformer_config_problems

    assert not transformer_config_problems(BASE)
    problems = transformer_config_problems({**BASE, key: VALIDATED[key]})
    assert problems and key in str(problems[0]), problems


def test_sequence_parallel_at_tp_1_is_turned_off_as_megatron_lm_does():
    """Primus's language_model.yaml sets sequence_parallel: true; Megatron-LM's validate_args (and Primus's
    sequence_parallel_tp1 patch) turn it off at TP 1, so a TP-1 experiment must not be refused for it."""
    from primus_ext.megatron.validate import transformer_config_problems

    assert not transformer_config_problems({**BASE, "sequence_parallel": True})
    assert not transformer_config_problems({**BASE, "sequence_parallel": True, "tensor_model_parallel_size": 2})


def _other_value(key: str) -> Any:
    default = TurboAttentionSettings().to_dict()[key]
    values = {bool: not default, int: 7, str: {"auto": "reference", "reference": "turbo"}.get(default, "true")}
    if key == "turbo_arch":
        return "gfx950"
    if key == "turbo_selftest":
        return "false"
    if key == "turbo_flex_attention_call_flags":
        return "drop_in"
    if key == "turbo_flex_attention_owner":
        return "primus_ext"
    if key == "packed_sequences":
        return True
    if key == "reset_attention_mask_max_documents":
        return 7
    if key.endswith("_kwargs"):
        return {"k": 1}
    if key.endswith(("_mask_mod", "_score_mod")):
        return "tests.hook_examples:alibi"
    return values[type(default)]


@pytest.mark.parametrize("key", SETTING_KEYS)
def test_each_turbo_key_reaches_the_settings_from_a_yaml_mapping_and_the_command_line(key):
    value = _other_value(key)
    mapping = {**BASE, key: value}
    hooked = key.endswith(("_mod", "_mod_kwargs"))  # a hook is refused with flex off (setting-hook-unused)
    if key.endswith("_kwargs"):
        mapping[key.removesuffix("_kwargs")] = "tests.hook_examples:alibi"
    if hooked:
        mapping.update(use_turbo_attention=True, use_turbo_flex_attention=True)
    from_yaml = TurboAttentionSettings.from_dict(mapping)
    assert getattr(from_yaml, key) == value
    parser = add_turbo_attention_args(argparse.ArgumentParser())
    flag = "--" + key.replace("_", "-")
    if isinstance(value, bool) and key != "packed_sequences":
        argv = [flag] if value else ["--no-" + flag[2:]]  # a switch (off: one on by default)
    else:
        text = json.dumps(value) if isinstance(value, (dict, bool)) else str(value)
        argv = [flag, text]
    if key.endswith("_kwargs"):
        argv += ["--" + key.removesuffix("_kwargs").replace("_", "-"), "tests.hook_examples:alibi"]
    if hooked:
        argv += ["--use-turbo-attention", "--use-turbo-flex-attention"]
    args = parser.parse_args(argv)
    assert getattr(TurboAttentionSettings.from_args(args), key) == value, (key, argv)


def test_packed_sequences_reaches_check_the_demo_and_the_modules_alike(tmp_path):
    """One YAML, three readers: ``check``'s plan, the demo's TransformerConfig, and a module."""
    from megatron.core.transformer.enums import AttnMaskType

    from primus_ext.cli.check import _plans
    from primus_ext.cli.demo_model import transformer_config
    from primus_ext.megatron import PrimusTurboLocalAttention
    from primus_ext.testing import fake_primus_turbo

    mapping = {**BASE, "use_turbo_attention": True, "use_turbo_flex_attention": True, "packed_sequences": True}
    settings = TurboAttentionSettings.from_dict(mapping)
    with fake_primus_turbo():
        (_, checked), _ = _plans(settings, mapping)
        layer = PrimusTurboLocalAttention(transformer_config(mapping), 1, AttnMaskType.causal, "self",
                                          settings=settings)
    assert checked.packed is True and layer.plan.packed is True
