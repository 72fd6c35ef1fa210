"""What Megatron hands core attention per call, honoured or refused (B34).

* ``attention_mask``: the layers compute their mask from the plan (causal, windows,
  documents), so a mask tensor can only be accepted when it says nothing more: it must
  be Megatron's causal mask (bool, ``True`` = masked, ``[B or 1, 1, Sq, Skv]``, the
  strict upper triangle, as ``get_ltor_masks_and_position_ids`` builds it without
  ``reset_attention_mask``) and the layer's own attention must stay inside it (its
  pattern has right bound 0).  Anything else, a document mask above all, is refused,
  never ignored.  Proving it costs one on-device comparison per distinct mask tensor:
  every layer of a step gets the same tensor object, so a step pays once, and nothing
  is read on the host (on a GPU a failure is a device-side assert with this text).
* ``qkv_format``: one of Megatron's ``sbhd``, ``bshd``, ``thd``; ``bshd`` dense inputs
  are read as ``[B, S, H, D]``.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Tuple

import torch
from torch import Tensor

from ..call.checks import assert_on_device, tensor_version
from ..errors import Reason, UnsupportedInputError

QKV_FORMATS = ("sbhd", "bshd", "thd")
_MASK_ALTERNATIVE = ("pass attention_mask=None (Megatron: --no-create-attention-mask-in-dataloader); the layer "
                     "applies its configured causal / window / document mask itself. For document masks, pack "
                     "batches as THD (packed_seq_params with cu_seqlens).")


def refuse(settings: Tuple[str, ...], reason: str, alternative: str = "") -> UnsupportedInputError:
    return UnsupportedInputError(Reason(settings, reason, alternative, "B34"), context="Megatron core attention")


def qkv_format(packed_seq_params: Any, default: str) -> str:
    """The call's layout: ``packed_seq_params.qkv_format`` (None: the module default, B20)."""
    fmt = getattr(packed_seq_params, "qkv_format", None) if packed_seq_params is not None else None
    fmt = fmt or default
    if fmt not in QKV_FORMATS:
        raise refuse(("packed_seq_params",), f"qkv_format={fmt!r} is not one of Megatron's {QKV_FORMATS}.",
                     "use 'sbhd' (Megatron's default), 'bshd' or 'thd' (packed, with cu_seqlens).")
    return fmt


class MaskCheck:
    """Accepts ``attention_mask`` tensors that are provably Megatron's causal mask."""

    def __init__(self, layer_is_causal: bool, what: str, alternative: str = _MASK_ALTERNATIVE) -> None:
        self.layer_is_causal = layer_is_causal
        self.alternative = alternative
        self.what = what  # the layer's attention, for messages
        # The mask last proven, by weak reference and version: a freed mask's address can be
        # reused by another tensor, so identity, not address, says "the same mask".
        self._seen: Optional[Tuple[Any, int]] = None

    def __call__(self, mask: Optional[Any], q_len: int, kv_len: int,
                 rows: Optional[Callable[[torch.device], Tensor]] = None) -> None:
        """``rows``: the query positions of this context-parallel rank's rows (``get_batch_on_this_cp_rank``
        keeps two chunks of each sequence); ``None``: rows ``0 .. q_len - 1``."""
        if mask is None:
            return
        if not isinstance(mask, Tensor):
            raise refuse(("attention_mask",), f"attention_mask must be a tensor or None, got {type(mask).__name__}.")
        if not self.layer_is_causal:
            raise refuse(("attention_mask",), f"an attention_mask tensor reached a layer whose attention is "
                         f"{self.what}; the layer cannot apply a mask tensor, and it would be ignored.",
                         self.alternative)
        whose = "Megatron's causal mask" if rows is None else "this context-parallel rank's rows of Megatron's causal mask"
        shape = tuple(mask.shape)
        if (mask.dtype != torch.bool or mask.dim() != 4 or shape[1] != 1 or shape[2:] != (q_len, kv_len)):
            settings = ("attention_mask",) if rows is None else ("attention_mask", "context_parallel_size")
            raise refuse(settings, f"attention_mask of dtype {mask.dtype} and shape {shape} is not {whose} "
                         f"(bool [B or 1, 1, {q_len}, {kv_len}]); it would be ignored.", self.alternative)
        why = (f"attention_mask is not {whose} (a document mask from reset_attention_mask, or another mask); "
               "the layer would ignore it (B25, B34)")

        def expected() -> Tensor:  # True = masked: the keys after each row's position
            at = torch.arange(q_len, device=mask.device) if rows is None else rows(mask.device)
            return torch.arange(kv_len, device=mask.device).view(1, -1) > at.view(-1, 1)

        alternative = self.alternative  # a plain string in the closure: Dynamo keeps the refusal as a constant
        refusal = lambda: refuse(("attention_mask", "reset_attention_mask"), why + ".", alternative)  # noqa: E731
        if torch.compiler.is_compiling():  # no memo inside a graph: one fused comparison per call
            assert_on_device((mask == expected()).all(), why, refusal)
            return
        seen, version = self._seen, tensor_version(mask)
        if seen is not None and seen[0]() is mask and seen[1] == version is not None:
            return
        assert_on_device((mask == expected()).all(), why, refusal)
        self._seen = (weakref.ref(mask), version)


__all__ = ["MaskCheck", "QKV_FORMATS", "qkv_format", "refuse"]
