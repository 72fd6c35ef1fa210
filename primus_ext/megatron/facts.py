"""Model-side facts of each attention layer, read with Megatron's own names.

One function serves a ``TransformerConfig`` (the modules) and a Megatron-style YAML
mapping (the CLI), so both decide windows, heads and dropout the same way.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ..plan.facts import LayerFacts


def _get(source: Any, key: str, default: Any = None) -> Any:
    if isinstance(source, Mapping):
        value = source.get(key, default)
    else:
        value = getattr(source, key, default)
    return default if value is None else value


def unused_window(source: Any) -> Optional[tuple[int, int]]:
    """``window_size`` where ``window_attn_skip_freq`` windows none of the ``num_layers`` layers (a frequency of
    1, a list of 0s), else None."""
    window, freq = _get(source, "window_size"), _get(source, "window_attn_skip_freq")
    if not window or freq is None:
        return None
    layers = int(_get(source, "num_layers", 1))
    if any(config_window(source, n) is not None for n in range(1, layers + 1)):
        return None
    return (int(window[0]), int(window[1]))


def config_window(source: Any, layer_number: int) -> Optional[tuple[int, int]]:
    """``window_size`` of this 1-indexed layer after ``window_attn_skip_freq``, or None."""
    window = _get(source, "window_size")
    if not window:
        return None
    from megatron.core.transformer.utils import is_layer_window_attention

    if not is_layer_window_attention(tuple(window), _get(source, "window_attn_skip_freq"), layer_number):
        return None
    return (int(window[0]), int(window[1]))


DTYPE_NAMES = {"torch.bfloat16": "bf16", "bfloat16": "bf16", "bf16": "bf16", "torch.float16": "fp16",
                "float16": "fp16", "fp16": "fp16", "half": "fp16", "torch.float32": "fp32", "float32": "fp32",
                "fp32": "fp32", "float": "fp32"}


def input_dtype(source: Any) -> Optional[str]:
    """What attention computes in: Megatron's ``bf16`` / ``fp16`` switches, else ``params_dtype``.

    A YAML that sets none of them trains in Megatron's default, fp32.
    """
    if _get(source, "bf16"):
        return "bf16"
    if _get(source, "fp16"):
        return "fp16"
    return DTYPE_NAMES.get(str(_get(source, "params_dtype", "fp32")))


def _layer_value(value: Any, layer_number: int) -> Any:
    """A Megatron setting given once or per layer (``cp_comm_type`` may be a list)."""
    if isinstance(value, (list, tuple)):
        return value[layer_number - 1] if layer_number - 1 < len(value) else None
    return value


def layer_facts(source: Any, layer_number: int, *, tp_rank: int = 0, **overrides: Any) -> LayerFacts:
    """`LayerFacts` of one layer from a ``TransformerConfig`` or a YAML mapping.

    Heads are divided by ``tensor_model_parallel_size``: each rank sees its own, and
    tensor-parallel rank ``tp_rank`` holds the model's heads from ``head_offset = tp_rank *
    num_heads`` on (megatron-core's column-parallel QKV), the global index its hooks see.
    ``packed_sequences`` (true / false / absent) says whether batches arrive packed as
    THD, so packed-only capabilities are checked at build time.
    """
    heads = int(_get(source, "num_attention_heads"))
    # Megatron-LM passes num_query_groups on only with group_query_attention (a YAML may keep the number)
    gqa_off = isinstance(source, Mapping) and source.get("group_query_attention") is False
    # MLA's core attention gets keys and values up-projected to every query head: no groups there
    mla = bool(_get(source, "multi_latent_attention", False))
    groups = heads if gqa_off or mla else int(_get(source, "num_query_groups", heads))
    tp = int(_get(source, "tensor_model_parallel_size", 1))
    head_dim = _get(source, "kv_channels")
    if head_dim is None:
        head_dim = int(_get(source, "hidden_size")) // heads
    head_dim_v = None
    if mla:  # MLA's core attention: q/k and v dims of its own
        head_dim = int(_get(source, "qk_head_dim")) + int(_get(source, "qk_pos_emb_head_dim"))
        head_dim_v = int(_get(source, "v_head_dim"))
    facts = dict(
        num_heads=heads // tp,
        num_kv_heads=max(groups // tp, 1),
        head_dim=int(head_dim),
        head_dim_v=head_dim_v,
        layer_number=layer_number,
        window_size=config_window(source, layer_number),
        skip_freq_unused=None if _get(source, "window_size") else _get(source, "window_attn_skip_freq"),
        window_unused=unused_window(source),
        softmax_scale=_get(source, "softmax_scale"),
        attention_dropout=float(_get(source, "attention_dropout", 0.0)),
        seq_length=_get(source, "seq_length"),
        context_parallel_size=int(_get(source, "context_parallel_size", 1)),
        tensor_model_parallel_size=tp,
        position_embedding_type=str(_get(source, "position_embedding_type", "learned_absolute")),
        softmax_type=str(_get(source, "softmax_type", "vanilla")),
        cp_comm_type=_layer_value(_get(source, "cp_comm_type"), layer_number),
        packed=_get(source, "packed_sequences"),
        dtype=input_dtype(source),
        megatron_mask=True,  # Megatron's core attention: its dense calls carry attention_mask
    )
    facts.update(overrides)
    facts.setdefault("head_offset", tp_rank * facts["num_heads"])
    return LayerFacts(**facts)


__all__ = ["DTYPE_NAMES", "config_window", "input_dtype", "layer_facts"]
