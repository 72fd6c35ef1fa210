"""Context parallelism of one Turbo core-attention layer: Ulysses around its per-rank attention.

At ``context_parallel_size`` > 1 each rank's core attention receives its part of every
sequence as megatron-core's ``get_batch_on_this_cp_rank`` cut it (chunks ``r`` and
``2 * CP - 1 - r`` of ``2 * CP``).  `primus_ext.backends.context_parallel.Ulysses` turns
that into the whole sequence, in order, with this rank's share of the heads, and back.
This module binds it to Megatron, on both paths:

* the group: ``pg_collection.cp``, else megatron-core's parallel state.  Its size must be
  the config's ``context_parallel_size``.  A layer planned for one split that gets another
  would attend over the wrong tokens, so a mismatch is refused when the layer is built (B22);
* the plan the per-rank attention runs: this rank's heads (``H_tp / CP`` query and
  ``Hkv_tp / CP`` key/value heads), its ALiBi slopes, and mask and score hooks that see
  the model's head numbers (``tp_rank * H_tp + cp_rank * H_tp / CP + local index``,
  `primus_ext.attention.heads`), exactly those they see at CP 1 and TP 1;
* the learned sink: the parameter keeps one entry per head of the tensor-parallel rank
  (`primus_ext.megatron.sink`), and each call takes this CP rank's slice.  A CP rank's sink
  gradient is therefore non-zero on its own heads only, and carries the whole sequence's
  contribution to them.  Megatron's gradient reduction over the CP ranks sums these into
  the CP-1 gradient, as it does for every other weight;
* Megatron's ``attention_mask``, which ``get_batch_on_this_cp_rank`` splits along its
  query rows: accepted only as those rows of the causal mask.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from .. import refusals as R
from ..attention.heads import mask_on_heads, score_on_heads
from ..backends.context_parallel import Ulysses
from ..errors import UnsupportedConfigError, UnsupportedInputError
from .call_contract import CONTEXT, MaskCheck, MaskRules

CP_MASK = MaskRules(R.CP_MASK_ON_LAYER, R.CP_MASK_SHAPE, R.CP_MASK_VALUES)
"""This rank's rows of the causal mask, as ``get_batch_on_this_cp_rank`` splits it."""


def cp_process_group(pg_collection: Any) -> Any:
    """The context-parallel group of this layer: ``pg_collection.cp``, else megatron-core's (or None)."""
    group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if group is not None:
        return group
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group(check_initialized=False)


def _group_size(group: Any) -> int:
    if group is None or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group)


def _mismatch(configured: int, actual: int) -> UnsupportedConfigError:
    if configured > actual:
        why = (f"context_parallel_size={configured} in the model config, but this rank's context-parallel process "
               f"group has {actual} rank(s): the layer would be planned for a sequence split {configured} ways that "
               "the process groups do not make.")
    else:
        why = (f"context_parallel_size={configured} in the model config, but this rank's context-parallel process "
               f"group has {actual} ranks: megatron-core splits each sequence across them, so the layer would "
               "attend only over this rank's chunks, silently.")
    return R.refuse_build(R.CP_GROUP, "Megatron core attention", why=why)


class LayerContextParallel:
    """One layer's Ulysses binding: the group's exchange, the rank's plan, sink and mask rows."""

    def __init__(self, ulysses: Ulysses, layer_is_causal: bool, what: str) -> None:
        self.ulysses = ulysses
        self._mask = MaskCheck(layer_is_causal, what, CP_MASK)

    def local_plan(self, plan: Any) -> Any:
        """``plan`` for this rank's heads of the whole sequence (what the per-rank kernel call gets)."""
        n = self.ulysses.size
        offset = self.ulysses.head_offset(plan.num_heads)  # within the tensor-parallel rank's heads
        slopes = self.ulysses.head_slice(plan.alibi_slopes) if plan.alibi_slopes is not None else None
        return dataclasses.replace(plan, num_heads=self.ulysses.local_heads(plan.num_heads),
                                   num_kv_heads=plan.num_kv_heads // n, alibi_slopes=slopes,
                                   head_offset=plan.head_offset + offset,
                                   mask_mod=mask_on_heads(plan.mask_mod, offset),
                                   score_mod=score_on_heads(plan.score_mod, offset))

    def scatter(self, query: Tensor, key: Tensor, value: Tensor, fmt: str) -> Tuple[Tensor, Tensor, Tensor]:
        """This rank's sequence part (``sbhd`` or ``bshd``, all heads) -> the whole sequence, its heads.
        Every length is checked before the first exchange, so all ranks refuse alike or none does."""
        parts = [t if fmt == "sbhd" else t.transpose(0, 1) for t in (query, key, value)]
        for t, what in zip(parts, ("query", "key", "value")):
            self.ulysses.check_length(t.shape[0], what)
        out = [self.ulysses.scatter_heads(t) for t in parts]
        return tuple(t if fmt == "sbhd" else t.transpose(0, 1) for t in out)  # type: ignore[return-value]

    def gather(self, out: Tensor, fmt: str) -> Tensor:
        """The per-rank output (``[S, B, H/CP, Dv]`` or bshd) -> this rank's rows with all heads."""
        sbhd = out if fmt == "sbhd" else out.transpose(0, 1)
        local = self.ulysses.gather_heads(sbhd)
        return local if fmt == "sbhd" else local.transpose(0, 1)

    def sink(self, sink: Optional[Tensor]) -> Optional[Tensor]:
        """This rank's entries of the layer's sink (one per head of the tensor-parallel rank)."""
        return None if sink is None else self.ulysses.head_slice(sink)

    def packed_refusal(self) -> UnsupportedInputError:
        """A packed (thd) call: megatron-core's THD split is per document, which Ulysses does not reorder."""
        return R.refuse(R.CP_PACKED, CONTEXT, cp=self.ulysses.size)

    def check_mask(self, mask: Optional[Any], q_local: int, kv_local: int) -> None:
        """Megatron's causal mask, split along its query rows by ``get_batch_on_this_cp_rank``, or None."""
        self._mask(mask, q_local, kv_local * self.ulysses.size,
                   rows=lambda device: self.ulysses.positions(q_local, device),
                   rows_key=(self.ulysses.size, self.ulysses.rank))


def layer_context_parallel(configured: int, pg_collection: Any, layer_is_causal: bool,
                           what: str) -> Optional[LayerContextParallel]:
    """The layer's binding at ``context_parallel_size=configured`` (None at 1); refuses a group
    of another size (B22)."""
    group = cp_process_group(pg_collection)
    size = _group_size(group)
    if size != configured:
        raise _mismatch(configured, size)
    return LayerContextParallel(Ulysses.over(group), layer_is_causal, what) if size > 1 else None


__all__ = ["LayerContextParallel", "cp_process_group", "layer_context_parallel"]
