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
  the layer's head numbers (``cp_rank * H_tp / CP + local index``), exactly those they see at
  CP 1;
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
import weakref
from typing import Any, Callable, Optional, Tuple

import torch
from torch import Tensor

from ..attention.library import library_pattern
from ..backends.call_checks import assert_on_device, tensor_version
from ..backends.context_parallel import Ulysses
from ..errors import Reason, UnsupportedConfigError, UnsupportedInputError
from .call_contract import refuse

_MASK_ALTERNATIVE = ("pass attention_mask=None (Megatron: --no-create-attention-mask-in-dataloader), or the causal "
                     "mask split by get_batch_on_this_cp_rank; the layer applies its own causal / window mask.")


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
    return UnsupportedConfigError(Reason(
        ("context_parallel_size",), why,
        "initialise megatron-core's parallel state with the config's context_parallel_size "
        "(parallel_state.initialize_model_parallel(..., context_parallel_size=N)), or pass a pg_collection "
        "whose cp group has that many ranks.", "B22"), context="Megatron core attention")


def _mask_on_layer_heads(mask_mod: Optional[Callable], offset: int) -> Optional[Callable]:
    """``mask_mod`` seeing the layer's head numbers: local head ``h`` is head ``h + offset``."""
    if mask_mod is None or offset == 0 or library_pattern(mask_mod) is not None:  # library masks read no head
        return mask_mod

    def mask_on_layer_heads(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return mask_mod(b, h + offset, q_idx, kv_idx)

    return mask_on_layer_heads


def _score_on_layer_heads(score_mod: Optional[Callable], offset: int) -> Optional[Callable]:
    """``score_mod`` seeing the layer's head numbers, as `_mask_on_layer_heads`."""
    if score_mod is None or offset == 0:
        return score_mod

    def score_on_layer_heads(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score_mod(score, b, h + offset, q_idx, kv_idx)

    return score_on_layer_heads


class LayerContextParallel:
    """One layer's Ulysses binding: the group's exchange, the rank's plan, sink and mask rows."""

    def __init__(self, ulysses: Ulysses, layer_is_causal: bool, what: str) -> None:
        self.ulysses = ulysses
        self.layer_is_causal = layer_is_causal
        self.what = what  # the layer's attention, for messages
        self._seen: Optional[Tuple[Any, int]] = None  # the mask last proven (as `MaskCheck` keeps it)

    def local_plan(self, plan: Any) -> Any:
        """``plan`` for this rank's heads of the whole sequence (what the per-rank kernel call gets)."""
        n = self.ulysses.size
        offset = self.ulysses.head_offset(plan.num_heads)
        heads = plan.num_heads // n
        slopes = plan.alibi_slopes[offset:offset + heads] if plan.alibi_slopes is not None else None
        return dataclasses.replace(plan, num_heads=heads, num_kv_heads=plan.num_kv_heads // n, alibi_slopes=slopes,
                                   mask_mod=_mask_on_layer_heads(plan.mask_mod, offset),
                                   score_mod=_score_on_layer_heads(plan.score_mod, offset))

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
        return UnsupportedInputError(Reason(
            ("packed_seq_params", "context_parallel_size"),
            f"a packed (thd) call at context_parallel_size={self.ulysses.size}: megatron-core splits THD batches "
            "per document (each padded and cut into 2 * CP chunks, cu_seqlens_*_padded), which this layer's "
            "Ulysses exchange does not put back in order; the documents would be attended in the wrong order.",
            "train unpacked (sbhd) with context parallelism, or packed at context_parallel_size: 1.",
            "cp-packed"), context="Megatron core attention")

    def check_mask(self, mask: Optional[Any], q_local: int, kv_local: int) -> None:
        """Megatron's causal mask, split along its query rows by ``get_batch_on_this_cp_rank``, or None."""
        if mask is None:
            return
        if not isinstance(mask, Tensor):
            raise refuse(("attention_mask",), f"attention_mask must be a tensor or None, got {type(mask).__name__}.")
        if not self.layer_is_causal:
            raise refuse(("attention_mask",), f"an attention_mask tensor reached a layer whose attention is "
                         f"{self.what}; the layer cannot apply a mask tensor, and it would be ignored.",
                         _MASK_ALTERNATIVE)
        kv_len = kv_local * self.ulysses.size
        shape = tuple(mask.shape)
        if mask.dtype != torch.bool or mask.dim() != 4 or shape[1] != 1 or shape[2:] != (q_local, kv_len):
            raise refuse(("attention_mask", "context_parallel_size"), f"attention_mask of dtype {mask.dtype} and "
                         f"shape {shape} is not this context-parallel rank's rows of Megatron's causal mask (bool "
                         f"[B or 1, 1, {q_local}, {kv_len}]); it would be ignored.", _MASK_ALTERNATIVE)
        compiling, seen, version = torch.compiler.is_compiling(), self._seen, tensor_version(mask)
        if not compiling and seen is not None and seen[0]() is mask and version is not None and seen[1] == version:
            return
        rows = self.ulysses.positions(q_local, mask.device).view(-1, 1)
        expected = torch.arange(kv_len, device=mask.device).view(1, -1) > rows  # True = masked, as Megatron's
        why = ("attention_mask is not this context-parallel rank's rows of Megatron's causal mask (a document mask "
               "from reset_attention_mask, or another mask); the layer would ignore it (B25, B34)")
        assert_on_device((mask == expected).all(), why,
                         lambda: refuse(("attention_mask", "reset_attention_mask"), why + ".", _MASK_ALTERNATIVE))
        if not compiling:  # no memo inside a graph: one fused comparison per call
            self._seen = (weakref.ref(mask), version)


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
