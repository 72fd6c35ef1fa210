"""What Megatron hands core attention per call, honoured or refused (B34).

* ``attention_mask``: the layers compute their mask from the plan (causal, windows,
  documents), so a mask tensor can only be accepted when it says nothing more: it must
  be Megatron's causal mask (bool, ``True`` = masked, ``[B or 1, 1, Sq, Skv]``, the
  strict upper triangle, as ``get_ltor_masks_and_position_ids`` builds it without
  ``reset_attention_mask``) and the layer's own attention must stay inside it (its
  pattern has right bound 0).  Anything else, a document mask above all, is refused,
  never ignored.  Proving it costs one on-device comparison per distinct mask tensor:
  every layer of a step gets the same tensor object, and a mask proven by one layer is
  known to every layer (`primus_ext.call.facts.FACTS`), so a step pays once, and nothing
  is read on the host (on a GPU a failure is a device-side assert with this text).
* ``qkv_format``: one of Megatron's ``sbhd``, ``bshd``, ``thd``; ``bshd`` dense inputs
  are read as ``[B, S, H, D]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional

import torch
from torch import Tensor

from .. import refusals as R
from ..call.checks import assert_on_device
from ..call.facts import FACTS

QKV_FORMATS = ("sbhd", "bshd", "thd")
CONTEXT = "Megatron core attention"


def qkv_format(packed_seq_params: Any, default: str) -> str:
    """The call's layout: ``packed_seq_params.qkv_format`` (None: the module default, B20)."""
    fmt = getattr(packed_seq_params, "qkv_format", None) if packed_seq_params is not None else None
    fmt = fmt or default
    if fmt not in QKV_FORMATS:
        raise R.refuse(R.QKV_FORMAT, CONTEXT, fmt=fmt, formats=QKV_FORMATS)
    return fmt


@dataclass(frozen=True)
class MaskRules:
    """The refusals of one kind of layer's masks: on a layer that is not causal, of the wrong
    shape or dtype, of other values."""

    on_layer: R.Refusal
    shape: R.Refusal
    values: R.Refusal


CAUSAL_MASK = MaskRules(R.MASK_ON_LAYER, R.MASK_SHAPE, R.MASK_VALUES)
"""A layer's whole causal mask (``get_ltor_masks_and_position_ids``)."""


class MaskCheck:
    """Accepts ``attention_mask`` tensors that are provably Megatron's causal mask."""

    def __init__(self, layer_is_causal: bool, what: str, rules: MaskRules = CAUSAL_MASK) -> None:
        self.layer_is_causal = layer_is_causal
        self.rules = rules
        self.what = what  # the layer's attention, for messages
        # The device assert's text and the rule's code: plain strings, which a compiled graph
        # keeps as constants (the refusal is built only when the check fails).
        self._why = rules.values.reason_for().reason.removesuffix(".")
        self._values_code = rules.values.code

    def __call__(self, mask: Optional[Any], q_len: int, kv_len: int,
                 rows: Optional[Callable[[torch.device], Tensor]] = None, rows_key: Optional[Hashable] = None) -> None:
        """``rows``: the query positions of this context-parallel rank's rows (``get_batch_on_this_cp_rank``
        keeps two chunks of each sequence), ``rows_key`` a hashable name of them (e.g. ``(cp_size,
        cp_rank)``: a mask is known proven only for the same rows); ``None``: rows ``0 .. q_len - 1``."""
        if mask is None:
            return
        if not isinstance(mask, Tensor):
            raise R.refuse(R.MASK_OBJECT, CONTEXT, kind=type(mask).__name__)
        if not self.layer_is_causal:
            raise R.refuse(self.rules.on_layer, CONTEXT, what=self.what)
        shape = tuple(mask.shape)
        if (mask.dtype != torch.bool or mask.dim() != 4 or shape[1] != 1 or shape[2:] != (q_len, kv_len)):
            raise R.refuse(self.rules.shape, CONTEXT, dtype=mask.dtype, shape=shape, q_len=q_len, kv_len=kv_len)

        def expected() -> Tensor:  # True = masked: the keys after each row's position
            at = torch.arange(q_len, device=mask.device) if rows is None else rows(mask.device)
            return torch.arange(kv_len, device=mask.device).view(1, -1) > at.view(-1, 1)

        why, code = self._why, self._values_code
        refusal = lambda: R.refuse(R.CALL_RULES[code], CONTEXT)  # noqa: E731
        if torch.compiler.is_compiling():  # no memo inside a graph: one fused comparison per call
            assert_on_device((mask == expected()).all(), why, refusal)
            return
        # A fact of the tensor, not of this layer: every layer of a step gets the same mask.
        claim = None if rows is not None and rows_key is None else ("causal-mask", q_len, kv_len, rows_key)
        if claim is not None and FACTS.known(mask, claim):
            return
        assert_on_device((mask == expected()).all(), why, refusal)
        if claim is not None:
            FACTS.learn(mask, claim)


__all__ = ["CAUSAL_MASK", "CONTEXT", "MaskCheck", "MaskRules", "QKV_FORMATS", "qkv_format"]
