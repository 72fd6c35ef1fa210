"""Exact attention math in plain torch, with autograd, on any device.

Shared by the ``reference`` backend and the CPU fake of Primus-Turbo, so that both
compute the same numbers.  Layouts: dense ``bshd`` ``[B, S, H, D]``; packed ``thd``
``[T, H, D]`` is treated as one sequence of ``T`` tokens with a document mask.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..attention.pattern import MaskMod, Pattern, ScoreMod, index_grid


def mask_from_mask_mod(mask_mod: MaskMod, batch: int, heads: int, q_len: int, kv_len: int,
                       device: torch.device) -> Tensor:
    """Evaluate a mask_mod into a boolean tensor broadcastable to ``[B, H, Sq, Skv]``."""
    out = mask_mod(*index_grid(batch, heads, q_len, kv_len, device))
    return torch.as_tensor(out, device=device).to(torch.bool)


def document_mask(pattern: Pattern, cu_seqlens_q: Tensor, cu_seqlens_kv: Tensor,
                  total_q: int, total_kv: int) -> Tensor:
    """``[Tq, Tkv]`` mask of packed documents with ``pattern``'s window inside each document.

    Positions are counted from each document's start, so no host sync is needed.
    """
    dev = cu_seqlens_q.device
    cu_q, cu_kv = cu_seqlens_q.long(), cu_seqlens_kv.long()
    pos_q = torch.arange(total_q, device=dev)
    pos_kv = torch.arange(total_kv, device=dev)
    doc_q = torch.bucketize(pos_q, cu_q[1:], right=True)
    doc_kv = torch.bucketize(pos_kv, cu_kv[1:], right=True)
    local_q = pos_q - cu_q[doc_q.clamp(max=cu_q.numel() - 1)]
    local_kv = pos_kv - cu_kv[doc_kv.clamp(max=cu_kv.numel() - 1)]
    window = Pattern(pattern.left, pattern.right)
    return (doc_q[:, None] == doc_kv[None, :]) & window.allows(local_q[:, None], local_kv[None, :])


def alibi_bias(slopes: Tensor, q_len: int, kv_len: int) -> Tensor:
    """``[1, H, Sq, Skv]`` float64 ALiBi bias ``slope[h] * (kv - q)`` (Primus-Turbo's sign convention)."""
    dev = slopes.device
    rel = torch.arange(kv_len, device=dev)[None, :] - torch.arange(q_len, device=dev)[:, None]
    # float64, rounded once by the caller to its working dtype: no float32 step in between
    return slopes.double().view(1, -1, 1, 1) * rel.to(torch.float64)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: Optional[float] = None,
    allowed: Optional[Tensor] = None,
    score_mod: Optional[ScoreMod] = None,
    alibi_slopes: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    sink: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
):
    """Softmax attention on bshd tensors, GQA/MQA by head grouping.

    ``allowed``: boolean, broadcastable to ``[B, Hq, Sq, Skv]``.  ``sink``: one logit
    per query head that joins the softmax denominator and carries no value.  Rows
    with nothing allowed give zeros (and ``lse = -inf`` without a sink).  Returns
    ``out [B, Sq, Hq, Dv]`` in q's dtype, or ``(out, lse [B, Hq, Sq] fp32)``.
    """
    batch, q_len, hq, head_dim = q.shape
    kv_len, hkv = k.shape[1], k.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    work = torch.promote_types(q.dtype, torch.float32)
    qh = q.transpose(1, 2).to(work)
    kh = k.transpose(1, 2).to(work)
    vh = v.transpose(1, 2).to(work)
    if hq != hkv:
        kh = kh.repeat_interleave(hq // hkv, dim=1)
        vh = vh.repeat_interleave(hq // hkv, dim=1)
    scale = head_dim ** -0.5 if scale is None else scale
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if score_mod is not None:
        # A hook may widen the dtype (float64 slopes on float32 scores); kernels keep theirs.
        scores = score_mod(scores, *index_grid(batch, hq, q_len, kv_len, q.device)).to(work)
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes, q_len, kv_len).to(work)
    if bias is not None:
        scores = scores + bias.to(work)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    if sink is not None:
        sink_logit = sink.to(work).view(1, hq, 1, 1).expand(batch, hq, q_len, 1)
        row_max = torch.maximum(row_max, sink_logit)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    probs = torch.exp(scores - row_max)
    denom = probs.sum(dim=-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink_logit - row_max)
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    probs = probs / safe
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    out = torch.matmul(probs, vh).transpose(1, 2).to(q.dtype)
    if not return_lse:
        return out
    lse = (torch.log(denom) + row_max).squeeze(-1).float()
    return out, lse


__all__ = ["alibi_bias", "attention", "document_mask", "index_grid", "mask_from_mask_mod"]
