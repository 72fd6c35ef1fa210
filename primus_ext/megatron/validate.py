"""What megatron-core refuses of a YAML's model keys, asked of megatron-core itself (`primus-ext check`).

A model whose ``TransformerConfig`` megatron-core would not build (4 heads at
``tensor_model_parallel_size: 3``) has no layers to plan; ``check`` must refuse it as the build would, not
print head ranges that leave heads on no rank.  So the keys ``check`` reads that are ``TransformerConfig``
fields become one, built by megatron-core with its own validation (``__post_init__``), and its refusal is
ours, naming the keys.  Two checks that building a ``TransformerConfig`` leaves out are added here:
megatron-core's own at block build (layers divisible by pipeline stages, ``transformer_block.
get_num_layers_to_build``) and Megatron-LM's argument check (a hidden size the heads do not divide without
``kv_channels``, which megatron-core silently rounds down).
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from typing import Any, Mapping

import torch

from .. import refusals as R
from ..errors import Reason
from .facts import DTYPE_NAMES

FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
          "tensor_model_parallel_size", "context_parallel_size", "pipeline_model_parallel_size", "sequence_parallel",
          "window_size", "window_attn_skip_freq", "softmax_type", "attention_dropout", "softmax_scale", "bf16",
          "fp16", "cp_comm_type")
"""The ``TransformerConfig`` fields a YAML's keys give one for one (the others keep megatron-core's defaults)."""

UNEVEN_PIPELINE = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
                   "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                   "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
                   "account_for_loss_in_pipeline_split")
"""Keys (megatron-core's and Megatron-LM's names) that split layers over pipeline stages unevenly: megatron-core
checks that split itself when it builds, so an even split is asked for only without them."""


def as_megatron_lm_passes(values: dict[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` (``TransformerConfig`` keyword arguments from a YAML) as Megatron-LM passes them on: no
    ``num_query_groups`` without ``group_query_attention``, ``sequence_parallel`` off at tensor-parallel size 1
    (its validate_args, and Primus).  Shared by ``check`` and the demo's model."""
    if config.get("group_query_attention") is False:
        values.pop("num_query_groups", None)
    if int(values.get("tensor_model_parallel_size") or 1) == 1:
        values.pop("sequence_parallel", None)
    return values


def _dropped_groups(config: Mapping[str, Any]) -> list[Reason]:
    """``num_query_groups`` other than the heads with ``group_query_attention: false`` (MLA aside, which has
    no groups): Megatron-LM passes no num_query_groups then, so every query head gets its own key-value head."""
    groups, heads = config.get("num_query_groups"), config.get("num_attention_heads")
    if config.get("group_query_attention") is False and groups is not None and groups != heads and not config.get(
            "multi_latent_attention"):
        return [R.GQA_OFF.reason_for(groups=groups, heads=heads)]
    return []


def transformer_config_problems(config: Mapping[str, Any]) -> list[Reason]:
    """megatron-core's refusal of these keys as a ``TransformerConfig`` (empty: it builds); the keys must have
    passed their typed readers (`primus_ext.settings.model_keys`)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dropped = _dropped_groups(config)
    if dropped:
        return dropped
    values = as_megatron_lm_passes({key: config[key] for key in FIELDS if config.get(key) is not None}, config)
    heads = values["num_attention_heads"]
    layers_given = "num_layers" in values
    values.setdefault("num_layers", 1)
    if "hidden_size" not in values:
        values["hidden_size"] = values["kv_channels"] * heads
    elif "kv_channels" not in values and values["hidden_size"] % heads:
        return [R.HIDDEN_NOT_DIVISIBLE.reason_for(hidden=values['hidden_size'], heads=heads,
                                                  rounded=values['hidden_size'] // heads)]
    stages = values.get("pipeline_model_parallel_size", 1)
    uneven = any(config.get(key) for key in UNEVEN_PIPELINE)
    if layers_given and values["num_layers"] % stages and not uneven:
        return [R.PIPELINE_LAYERS.reason_for(layers=values["num_layers"], stages=stages)]
    if values.get("bf16") and values.get("fp16"):
        return [R.BOTH_PRECISIONS.reason_for()]
    derived = "bf16" if values.get("bf16") else "fp16" if values.get("fp16") else "fp32"
    given = config.get("params_dtype")
    if given is not None and DTYPE_NAMES.get(str(given)) != derived:  # Megatron-LM's validate_args overwrites it
        return [R.PARAMS_DTYPE.reason_for(given=given, derived=derived)]
    if "window_size" in values:
        values["window_size"] = tuple(values["window_size"])
    dtype = torch.bfloat16 if values.get("bf16") else torch.float16 if values.get("fp16") else torch.float32
    values.update(params_dtype=dtype, pipeline_dtype=dtype, use_cpu_initialization=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            TransformerConfig(**values)
    except (ValueError, AssertionError, TypeError) as exc:
        text = str(exc).lower()
        # the keys megatron-core's message names ("sequence parallelism" names sequence_parallel), else every key
        named = tuple(k for k in FIELDS if k in values and config.get(k) is not None and (
            k in text or k.replace("_", " ").removesuffix(" size") in text)) or tuple(
            k for k in FIELDS if config.get(k) is not None)
        return [R.MEGATRON_CONFIG.reason_for(named=named, error=exc)]
    return []


LOOKALIKE_CUTOFF = 0.9
"""How alike (difflib's ratio, the lower of both directions) an unknown key must be to a model key to be taken for
its typo: none of the 1,027 top-level keys of Primus fd1eeab's configs is this close to one it is not."""


ALIASES = {
    "num_key_value_heads": "num_query_groups", "num_kv_heads": "num_query_groups", "n_kv_heads": "num_query_groups",
    "head_dim": "kv_channels", "head_size": "kv_channels",
    "attn_dropout": "attention_dropout", "attention_probs_dropout_prob": "attention_dropout",
    "num_heads": "num_attention_heads", "n_heads": "num_attention_heads",
    "num_hidden_layers": "num_layers", "n_layers": "num_layers",
    "hidden_dim": "hidden_size", "d_model": "hidden_size",
    "seq_len": "seq_length", "max_seq_len": "seq_length", "sequence_length": "seq_length",
    "tp_size": "tensor_model_parallel_size", "cp_size": "context_parallel_size",
    "pp_size": "pipeline_model_parallel_size",
    "turbo_owner": "turbo_flex_attention_owner", "use_flex_attention": "use_turbo_flex_attention",
    "mask_mod": "turbo_flex_attention_mask_mod", "score_mod": "turbo_flex_attention_score_mod",
    "use_sink": "use_sink_attention", "use_sinks": "use_sink_attention", "attention_sinks": "use_sink_attention",
    "attention_window": "window_size", "window": "window_size", "local_window": "window_size",
    "n_layer": "num_layers", "n_head": "num_attention_heads", "n_embd": "hidden_size", "n_kv_head": "num_query_groups",
}
"""Other frameworks' names (Hugging Face, MaxText, torchtitan) and short forms for keys the plans read: too unlike
Megatron's name for the look-alike screen, and ignored by Megatron as written."""


def lookalike_model_keys(config: Mapping[str, Any]) -> list[Reason]:
    """A "did you mean" reason per key of ``config`` that neither megatron-core nor primus_ext reads and that is
    nearly a key the plans read (``num_query_group``) or another framework's name for one (`ALIASES`): as written
    the plan would keep the default."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from ..settings.model_keys import READERS
    from ..settings.settings import SETTING_KEYS
    from ..settings.yaml_file import MODEL_KEYS

    known = {f.name for f in dataclasses.fields(MLATransformerConfig)} | set(SETTING_KEYS) | set(READERS)
    targets = set(READERS) | set(MODEL_KEYS)
    reasons = []
    for key in config:
        if not isinstance(key, str) or key in known:
            continue
        best = ALIASES.get(key)
        if best is None:
            alike = {t: min(difflib.SequenceMatcher(None, key, t).ratio(),
                            difflib.SequenceMatcher(None, t, key).ratio()) for t in targets}
            best = max(alike, key=alike.__getitem__)
            if alike[best] < LOOKALIKE_CUTOFF:
                continue
        value = config.get(best)
        reasons.append(R.MODEL_KEY_LOOKALIKE.reason_for(key=key, suggestion=best, value=(
            f"its value {value!r}" if value is not None else "its default")))
    return reasons


__all__ = ["ALIASES", "FIELDS", "as_megatron_lm_passes", "lookalike_model_keys", "transformer_config_problems"]
