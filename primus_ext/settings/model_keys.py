"""Megatron's model-shape keys as a YAML gives them: one typed reader per key (`primus-ext check`).

The plans need heads, head dims, windows and parallel sizes from Megatron's own keys.  A YAML can hold
anything there (``window_size: "128,0"``, ``window_attn_skip_freq: 0``, ``attention_dropout: high``), and a
value read loosely turns into a wrong plan or a traceback.  Each key here has one reader: its type, range
and shape, and a message naming the key with an example of a right value.  A string is never parsed into
numbers.  What megatron-core itself refuses of the values together (heads not divisible by
``tensor_model_parallel_size``, ...) is asked of megatron-core (`primus_ext.megatron.validate`).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from .. import refusals as R
from ..errors import Reason
from .settings import type_name

Reader = Callable[[str, Any, Mapping[str, Any]], Optional[str]]
"""``(key, value, the whole config) -> what is wrong (None: nothing)``."""


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


INT32_MAX = 2 ** 31 - 1
"""Lengths, window bounds and sizes past this fit no kernel argument (int32) and no machine."""


def _positive(key: str, value: Any, config: Mapping[str, Any]) -> Optional[str]:
    if _int(value) and 0 < value <= INT32_MAX:
        return None
    return f"{key} must be a positive integer below 2**31 (for example {key}: 8)"


def _window(key: str, value: Any, config: Mapping[str, Any]) -> Optional[str]:
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(_int(v) and -1 <= v <= INT32_MAX for v in value):
        return None
    return (f"{key} must be a list of two integers [left, right], each -1 (unbounded) or 0 to 2**31 - 1, as "
            f"megatron-core takes it (for example {key}: [128, 0])")


def _skip_freq(key: str, value: Any, config: Mapping[str, Any]) -> Optional[str]:
    if _int(value) and value > 0:
        return None
    layers = config.get("num_layers")
    if isinstance(value, list) and all(v in (0, 1) and not isinstance(v, float) for v in value):
        if _int(layers) and len(value) != layers:
            return f"{key} lists {len(value)} layers, but num_layers is {layers}: one 0 or 1 per layer"
        return None
    return (f"{key} must be a positive integer (every N-th layer is full attention, for example {key}: 2) or a "
            "list of 0 / 1, one per layer (1 = windowed)")


def _probability(key: str, value: Any, config: Mapping[str, Any]) -> Optional[str]:
    if _number(value) and 0.0 <= value < 1.0:
        return None
    return f"{key} must be a number in [0, 1) (for example {key}: 0.0)"


def _scale(key: str, value: Any, config: Mapping[str, Any]) -> Optional[str]:
    return None if _number(value) and value > 0 else f"{key} must be a positive number or null (for example {key}: 0.125)"


def _bool(key: str, value: Any, config: Mapping[str, Any]) -> Optional[str]:
    return None if isinstance(value, bool) else f"{key} must be true or false"


def _choice(*choices: str) -> Reader:
    def read(key: str, value: Any, config: Mapping[str, Any]) -> Optional[str]:
        if isinstance(value, str) and value in choices:
            return None
        return f"{key} must be one of {', '.join(choices)}"
    return read


def _comm(key: str, value: Any, config: Mapping[str, Any]) -> Optional[str]:
    if isinstance(value, str):
        return None
    layers = config.get("num_layers")
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        if _int(layers) and len(value) != layers:
            return f"{key} lists {len(value)} layers, but num_layers is {layers}: one string per layer"
        return None
    return f"{key} must be a string (for example {key}: a2a) or a list of strings, one per layer"



READERS: dict[str, Reader] = {
    "num_layers": _positive, "hidden_size": _positive, "num_attention_heads": _positive,
    "num_query_groups": _positive, "kv_channels": _positive, "seq_length": _positive,
    "tensor_model_parallel_size": _positive, "context_parallel_size": _positive,
    "pipeline_model_parallel_size": _positive,
    "window_size": _window, "window_attn_skip_freq": _skip_freq,
    "attention_dropout": _probability, "softmax_scale": _scale,
    "softmax_type": _choice("vanilla", "off-by-one", "learnable"),
    "position_embedding_type": _choice("learned_absolute", "rope", "mrope", "yarn", "relative", "none", "alibi"),
    "cp_comm_type": _comm,
    "bf16": _bool, "fp16": _bool, "sequence_parallel": _bool, "group_query_attention": _bool,
    "multi_latent_attention": _bool, "qk_head_dim": _positive, "qk_pos_emb_head_dim": _positive,
    "v_head_dim": _positive,
    "params_dtype": _choice("fp32", "float32", "torch.float32", "float", "bf16", "bfloat16", "torch.bfloat16",
                            "fp16", "float16", "torch.float16", "half"),
}
"""Every model key `check` reads, with its reader; null (or absent) means Megatron's default."""

REQUIRED = ("num_attention_heads",)


def model_key_problems(config: Mapping[str, Any]) -> list[Reason]:
    """Every malformed model key of ``config``, each naming the key and its value; empty when all read."""
    reasons = []
    for key in REQUIRED:
        if config.get(key) is None:
            reasons.append(R.MODEL_KEY_MISSING.reason_for(key=key))
    if config.get("multi_latent_attention") is True and any(
            config.get(key) is None for key in ("qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")):
        reasons.append(R.MODEL_KEY_MLA.reason_for())
    if config.get("kv_channels") is None and config.get("hidden_size") is None:
        reasons.append(R.MODEL_KEY_HEAD_DIM.reason_for())
    for key, read in READERS.items():
        value = config.get(key)
        if value is None:
            continue
        why = read(key, value, config)
        if why is not None:
            reasons.append(R.MODEL_KEY_VALUE.reason_for(key=key, why=why, got=type_name(value)))
    return reasons


__all__ = ["READERS", "model_key_problems"]
