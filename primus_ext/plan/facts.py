"""`LayerFacts`: what the model (not the Turbo YAML keys) says about one attention layer.

Megatron modules fill it from ``TransformerConfig`` and their constructor
arguments; the CLI fills it from a Megatron-style YAML.  Field names follow the
Megatron setting they come from, because refusals quote them to the user.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass(frozen=True)
class LayerFacts:
    """Model-side facts of one attention layer (heads are those on this rank)."""

    num_heads: int
    head_dim: int
    num_kv_heads: Optional[int] = None
    head_dim_v: Optional[int] = None
    layer_number: int = 1
    causal: bool = True
    window_size: Optional[Tuple[int, int]] = None
    softmax_scale: Optional[float] = None
    attention_dropout: float = 0.0
    seq_length: Optional[int] = None
    context_parallel_size: int = 1
    tensor_model_parallel_size: int = 1
    rng_tracker: bool = True
    """megatron-core's model-parallel RNG tracker is seeded where the layer runs (Megatron's own
    initialisation seeds it before the model is built); a module built in a process without it says
    False, and dropout at tensor or context parallel size > 1 is then refused (``B30-rng``)."""
    position_embedding_type: str = "learned_absolute"
    has_attention_bias: bool = False
    return_attn_probs: bool = False
    skip_freq_unused: object = None
    """Megatron's ``window_attn_skip_freq`` as given where ``window_size`` is not set: megatron-core applies it
    to ``window_size`` only, so it picks no layer (rule skip-freq-window)."""
    window_unused: Optional[Tuple[int, int]] = None
    """Megatron's ``window_size`` where ``window_attn_skip_freq`` gives it to none of the model's layers (rule
    window-unused)."""
    softmax_type: str = "vanilla"
    """Megatron's ``softmax_type``: ``learnable`` / ``off-by-one`` are sinks (learned / fixed 0)."""
    attn_mask_type: str = "causal"
    cp_comm_type: Optional[str] = None
    packed: Optional[bool] = None
    """``True``: only thd calls; ``False``: only dense calls; ``None``: either may come."""
    dtype: Optional[str] = None
    """Attention input dtype: ``bf16``, ``fp16``, ``fp32`` (Megatron's bf16 / fp16 / params_dtype);
    None when not known (then the kernel dispatch model assumes bf16)."""
    turbo_module: bool = False
    """Built by a Primus-Turbo attention module, so some Turbo path runs whatever the switches say."""
    megatron_mask: bool = False
    """The layer is Megatron's core attention, whose dense calls carry Megatron's ``attention_mask``:
    with ``reset_attention_mask`` the documents are read from it (`AttentionPlan.mask_documents`).
    A bare flash-style call has no mask argument, so there the documents would be lost (B25)."""
    runs_here: bool = False
    """The layer is built to run in this process (a Megatron module), not planned for another machine
    (`primus-ext check --arch`): ``auto`` then plans torch's FlexAttention only where this process has a GPU."""
    head_offset: int = 0
    """The model's (global) index of this rank's first query head: ``tp_rank * num_heads`` under tensor
    parallelism.  Hooks see global heads and are proven for ``head_offset .. head_offset + num_heads - 1``
    (`primus_ext.attention.heads`)."""

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def v_dim(self) -> int:
        return self.head_dim_v or self.head_dim


__all__ = ["LayerFacts"]
