"""The head index a hook sees: the model's (global) head, at every tensor and context parallel size.

A hook is written for the model's heads: ``h`` picks a row of a per-head table (ALiBi
slopes, per-head windows).  A rank computes only a slice of them, heads
``offset .. offset + n - 1`` with

    offset = tp_rank * H_tp + cp_rank * H_tp / CP        (H_tp = heads of a TP rank)

(tensor parallelism: megatron-core's column-parallel QKV gives TP rank ``t`` heads
``t * H_tp ..``; Ulysses then gives CP rank ``c`` of those ``c * H_tp / CP ..``).  The
kernel call's own head index is local, ``0 .. n - 1``; `mask_on_heads` / `score_on_heads`
give the hook ``h + offset`` instead, so the model computes the same function whatever
the split.  The TP part of the offset comes from `primus_ext.megatron.facts.layer_facts`
(``LayerFacts.head_offset``), the CP part from
`primus_ext.backends.context_parallel.Ulysses.head_offset`; the proofs cover exactly the
rank's heads (`primus_ext.hooks.proof.prove_mask` with ``head_offset``).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

from torch import Tensor

from .library import library_pattern
from .pattern import MaskMod, ScoreMod

_SHIFTED: "weakref.WeakKeyDictionary[Any, tuple[Any, int]]" = weakref.WeakKeyDictionary()
"""Our wrappers (functions hash by identity) -> (the hook they call, its offset)."""


def _unshifted(hook: Any, offset: int) -> tuple[Any, int]:
    """``(hook, offset)`` with a shift of ours undone: shifts compose into one wrapper."""
    try:
        entry = _SHIFTED.get(hook)
    except TypeError:  # not weakly referenceable: no wrapper of ours
        entry = None
    return (entry[0], entry[1] + offset) if entry is not None else (hook, offset)


def mask_on_heads(mask_mod: Optional[MaskMod], offset: int) -> Optional[MaskMod]:
    """``mask_mod`` called with the global head ``h + offset`` for local head ``h``.

    ``mask_mod`` itself when the offset is 0, and for library masks (they read no head)."""
    if mask_mod is None or library_pattern(mask_mod) is not None:
        return mask_mod
    hook, total = _unshifted(mask_mod, offset)
    if total == 0:
        return hook

    def mask_on_global_heads(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return hook(b, h + total, q_idx, kv_idx)

    _SHIFTED[mask_on_global_heads] = (hook, total)
    return mask_on_global_heads


def score_on_heads(score_mod: Optional[ScoreMod], offset: int) -> Optional[ScoreMod]:
    """``score_mod`` called with the global head ``h + offset``, as `mask_on_heads`."""
    if score_mod is None:
        return None
    hook, total = _unshifted(score_mod, offset)
    if total == 0:
        return hook

    def score_on_global_heads(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return hook(score, b, h + total, q_idx, kv_idx)

    _SHIFTED[score_on_global_heads] = (hook, total)
    return score_on_global_heads


def unshifted(hook: Any) -> tuple[Any, int]:
    """``(the hook a wrapper of ours calls, the head offset it adds)``; ``(hook, 0)`` for any other callable."""
    return _unshifted(hook, 0)


def head_range(offset: int, count: int) -> str:
    """``heads 2-3`` (global numbers), for messages."""
    return f"head {offset}" if count == 1 else f"heads {offset}-{offset + count - 1}"


__all__ = ["head_range", "mask_on_heads", "score_on_heads", "unshifted"]
