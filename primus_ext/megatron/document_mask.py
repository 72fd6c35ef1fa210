"""Megatron's dense document mask (``reset_attention_mask``) read as varlen boundaries, on the device.

With ``reset_attention_mask`` megatron-core builds each sample's mask as ``tril(ones(S, S))``
with, for every EOD at position ``i``, the keys ``0 .. i`` masked for the queries after it, and
then ``True`` = masked (``_get_ltor_masks_and_position_ids``, megatron/core/datasets/gpt_dataset.py
l.739-778 in 0.16.1): causal inside contiguous documents.  The varlen kernels need only where
the documents start, which the mask says on its first sub-diagonal: query ``i`` starts a
document exactly when key ``i - 1`` is masked for it.

So a dense ``[S, B, H, D]`` call is flattened to one THD sequence of ``T = B * S`` tokens with
``cu_seqlens`` at every row start and document start.  Nothing is read on the host, and the
shapes are fixed (``reset_attention_mask_max_documents + 1`` boundaries, ``T + 1`` when unset,
the unused tail repeating ``T``: zero-length documents), so every micro-batch shares one
compiled graph; a micro-batch with more documents than the bound is refused, never merged.  The mask is then held to the
block-causal mask those boundaries mean, element by element: anything else (a padding mask, a
bidirectional prefix, a hand-made mask) is refused, never approximated.  Both are done once per
mask tensor: every layer of a step gets the same tensor object (`primus_ext.call.facts.FACTS`),
so a 96-layer step derives and checks once.  On a GPU a failed check is a device-side assert
with the refusal's text (no host sync); on CPU it is our `UnsupportedInputError`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from .. import refusals as R
from ..call.checks import assert_on_device
from ..call.facts import FACTS

CONTEXT = "Megatron core attention"
_WHY = R.DOCUMENT_MASK_VALUES.reason_for().reason.removesuffix(".")  # a plain string: a graph constant


def check_document_mask(mask: Any, batch: int, q_len: int, kv_len: int) -> Tensor:
    """``mask`` checked to have the shape of a document mask of ``batch`` rows of ``q_len`` tokens."""
    if mask is None:
        raise R.refuse(R.DOCUMENT_MASK_MISSING, CONTEXT)
    if not isinstance(mask, Tensor):
        raise R.refuse(R.MASK_OBJECT, CONTEXT, kind=type(mask).__name__)
    shape = tuple(mask.shape)
    if (mask.dtype != torch.bool or mask.dim() != 4 or shape[0] not in (1, batch) or shape[1] != 1
            or shape[2:] != (q_len, kv_len) or q_len != kv_len):
        raise R.refuse(R.DOCUMENT_MASK_SHAPE, CONTEXT, batch=batch, q_len=q_len, kv_len=kv_len, dtype=mask.dtype,
                       shape=shape)
    return mask


def document_boundaries(mask: Any, batch: int, q_len: int, kv_len: int,
                        max_documents: Optional[int] = None) -> Tensor:
    """``cu_seqlens`` (int32, ``max_documents + 1`` entries; ``batch * q_len + 1`` for None) of the
    documents of Megatron's ``[batch or 1, 1, S, S]`` document mask, after holding the mask to them
    (refused if it is missing, of another shape, not block-causal, or holds more documents than
    ``max_documents``: ``reset_attention_mask_max_documents``).  Derived and checked once per mask
    tensor."""
    mask = check_document_mask(mask, batch, q_len, kv_len)
    seq = q_len
    total = batch * seq
    bound = total if max_documents is None else max_documents
    if total == 0:  # no token, so no document to count: each row an empty one, in the bound's fixed shape; no
        # row is one empty document (boundaries always hold 0 and the token count, which the varlen check asks)
        return torch.zeros((max(batch, 1) if max_documents is None else max_documents) + 1, dtype=torch.int32,
                           device=mask.device)
    limit = f"{max_documents}"  # plain strings in the closures: a compiled graph keeps the refusals as constants
    if bound < batch:
        raise R.refuse(R.DOCUMENT_MASK_COUNT, CONTEXT, batch=batch, max_documents=limit)
    claim = ("document-mask", batch, seq, bound)
    compiling = torch.compiler.is_compiling()  # no memo inside a graph: derived per call
    if not compiling:
        known = FACTS.recall(mask, claim)
        if known is not None:
            return known
    rows = mask[:, 0].expand(batch, seq, seq)
    starts = torch.ones(batch, seq, dtype=torch.bool, device=mask.device)
    starts[:, 1:] = rows.diagonal(offset=-1, dim1=1, dim2=2)  # query i, key i - 1 masked: a new document
    at = torch.arange(seq, device=mask.device)
    start_of = torch.where(starts, at, 0).cummax(1).values  # each query's document start
    # Block-causal: query i sees exactly the keys start_of[i] .. i; everything else is masked.
    masked = (at.view(1, 1, seq) > at.view(1, seq, 1)) | (at.view(1, 1, seq) < start_of.unsqueeze(2))
    ok = (rows == masked).all()
    if bound < total:
        count_ok = starts.sum() <= bound
        too_many = R.DOCUMENT_MASK_COUNT.reason_for(batch=batch, max_documents=limit).reason.removesuffix(".")
        assert_on_device(count_ok, too_many, lambda: R.refuse(R.DOCUMENT_MASK_COUNT, CONTEXT, batch=batch,
                                                             max_documents=limit))
    assert_on_device(ok, _WHY, lambda: R.refuse(R.DOCUMENT_MASK_VALUES, CONTEXT))
    first = torch.nonzero_static(starts.reshape(total), size=bound, fill_value=total).reshape(-1)
    cu = torch.cat([first, first.new_full((1,), total)]).to(torch.int32)
    if not compiling:
        FACTS.learn(mask, claim, cu)
    return cu


__all__ = ["check_document_mask", "document_boundaries"]
