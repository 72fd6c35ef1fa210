"""EOD-separated documents in ordinary ``[B, S]`` micro-batches, as packed THD (``reset_attention_mask``).

Megatron expresses ``reset_attention_mask`` as a dense ``[B, 1, S, S]`` mask that no
Primus-Turbo entry takes.  The kernels need only the document boundaries, which is what
``flash_attn_varlen_func`` reads, so a micro-batch is flattened to one THD sequence of
``T = B * S`` tokens with ``cu_seqlens`` at every row start and after every EOD token.

Megatron's convention (``megatron.core.datasets.gpt_dataset._get_ltor_masks_and_position_ids``):
the EOD token belongs to the document it closes (the next document starts right after
it); with ``reset_position_ids`` positions restart at 0 after each EOD; with
``eod_mask_loss`` the EOD positions get loss weight 0.  Rows are independent samples,
so a row start is always a document start.

Everything is computed on the device with fixed shapes: ``cu_seqlens`` always holds
``max_documents + 1`` entries, the unused tail repeating ``T`` (zero-length documents,
which the varlen kernels accept), so micro-batches with different document counts share
one compiled graph.  More documents than ``max_documents`` would merge documents, so they
are refused: at once on CPU, as a device-side assert on a GPU (no host sync either way).
``max_seqlen`` is ``S``: no document crosses a row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from .. import refusals as R
from ..call.checks import assert_on_device


@dataclass(frozen=True)
class PackedMicroBatch:
    """A micro-batch in THD form: ``[1, T]`` tensors and Megatron's `PackedSeqParams`."""

    tokens: Tensor
    labels: Optional[Tensor]
    loss_mask: Tensor
    position_ids: Tensor
    packed_seq_params: Any


CONTEXT = "EOD packing"


def document_starts(tokens: Tensor, eod_token: int) -> Tensor:
    """``[B * S]`` bool: True where a document starts (a row start, or right after an EOD)."""
    batch, seq = tokens.shape
    after_eod = torch.zeros_like(tokens, dtype=torch.bool)
    after_eod[:, 1:] = tokens[:, :-1] == eod_token
    after_eod[:, 0] = True
    return after_eod.reshape(batch * seq)


def pack_eod_micro_batch(tokens: Tensor, *, eod_token: int, max_documents: int, labels: Optional[Tensor] = None,
                         loss_mask: Optional[Tensor] = None, reset_position_ids: bool = True,
                         eod_mask_loss: bool = False) -> PackedMicroBatch:
    """The THD form of a ``[B, S]`` micro-batch whose documents are separated by ``eod_token``.

    ``max_documents`` bounds the documents of the whole micro-batch (at least ``B``); it
    fixes the shape of ``cu_seqlens``.  ``loss_mask`` (default ones) is multiplied by the
    EOD mask when ``eod_mask_loss``.  Positions restart after each EOD when
    ``reset_position_ids`` (else they count along each row, as Megatron's do).
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    if not isinstance(tokens, Tensor) or tokens.dim() != 2 or tokens.dtype.is_floating_point:
        raise R.refuse(R.EOD_TOKENS, CONTEXT,
                       got=tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__)
    batch, seq = tokens.shape
    if not isinstance(max_documents, int) or max_documents < batch:
        raise R.refuse(R.EOD_MAX_DOCUMENTS, CONTEXT, batch=batch, got=max_documents)
    total = batch * seq
    starts = document_starts(tokens, eod_token)
    count = starts.sum()
    limit = f"{max_documents}"  # a plain string in the closure: a compiled graph keeps the refusal as a constant
    too_many = R.EOD_TOO_MANY.reason_for(max_documents=limit).reason.removesuffix(".")
    assert_on_device(count <= max_documents, too_many, lambda: R.refuse(R.EOD_TOO_MANY, CONTEXT, max_documents=limit))
    index = torch.arange(total, device=tokens.device)
    first = torch.nonzero_static(starts, size=max_documents, fill_value=total).reshape(-1)
    cu = torch.cat([first, first.new_full((1,), total)]).to(torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=seq,
                             max_seqlen_kv=seq)
    flat = tokens.reshape(1, total)
    if reset_position_ids:
        # Each token's document start is the running maximum of start indices up to it.
        start_of = torch.where(starts, index, torch.zeros_like(index)).cummax(0).values
        positions = (index - start_of).reshape(1, total)
    else:
        positions = (index % seq).reshape(1, total)
    weights = loss_mask.reshape(1, total).float() if loss_mask is not None else torch.ones(
        1, total, device=tokens.device)
    if eod_mask_loss:
        weights = weights * (flat != eod_token)
    return PackedMicroBatch(flat, labels.reshape(1, total) if labels is not None else None, weights,
                            positions, params)


__all__ = ["PackedMicroBatch", "document_starts", "pack_eod_micro_batch"]
