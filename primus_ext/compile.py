"""torch.compile support: the op namespace and a selective-checkpointing save policy.

Under ``torch.compile`` every attention call of primus_ext is one custom op
(``torch.ops.primus_ext.dense_attention`` / ``varlen_attention``, see
`primus_ext.call.ops`; a shared-prefix row's ``shared_prefix_attention``), so a compiled transformer block keeps one graph.  With
selective activation checkpointing, `attention_save_policy` saves the op's outputs
so that backward does not run attention's forward again::

    from torch.utils.checkpoint import checkpoint
    from primus_ext.compile import selective_checkpoint_context

    out = checkpoint(block, x, use_reentrant=False, context_fn=selective_checkpoint_context)
"""

from __future__ import annotations

from typing import Any

from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .call.ops import FORWARD_OPS as _CALL_OPS
from .call.ops import NAMESPACE
from .call.shared_prefix_ops import shared_prefix_attention

FORWARD_OPS = _CALL_OPS + (shared_prefix_attention._opoverload,)
"""Every attention forward op: a call's, and a shared-prefix row's merged one (whose backward also needs its
``out`` and ``lse``, so selective checkpointing saves it as the others)."""

OP_NAMESPACE = NAMESPACE


def attention_save_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Save primus_ext attention outputs; let everything else be recomputed."""
    if op in FORWARD_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_checkpoint_context() -> Any:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint`` using `attention_save_policy`."""
    return create_selective_checkpoint_contexts(attention_save_policy)


__all__ = ["FORWARD_OPS", "OP_NAMESPACE", "attention_save_policy", "selective_checkpoint_context"]
