"""Exact attention in memory linear in the sequence: blockwise online softmax.

The ``reference`` backend runs windows, documents, sinks, ALiBi and mask hooks here
instead of materialising the ``[Sq, Skv]`` score matrix.  Queries are taken in blocks
of `BLOCK_Q` rows; each block visits only the keys its pattern can reach (a window's
band, its own document), in chunks sized so that one score tile stays under
`TILE_ELEMENTS`.  Per query row the forward keeps a running maximum, denominator and
unnormalised output (fp32, float64 for float64 inputs) and ends with ``out`` and the
log-sum-exp ``lse``.  The backward is written by hand from ``(out, lse)``: with
``P = exp(S - lse)`` and ``delta = rowsum(dO * out)``, ``dS = P * (dO V^T - delta)``,
``dQ = scale * dS K``, ``dK = scale * dS^T Q``, ``dV = P^T dO``; a sink's gradient is
``-sum(exp(sink - lse) * delta)``.  So a compiled graph can save ``(out, lse)`` and never
run the forward twice.

A tile is masked only where the pattern cuts through it; a tile the pattern leaves
whole is not masked, one it excludes is never visited.  Mask hooks are evaluated tile
by tile on global indices.  Index conventions are those of `exact` (top-left windows;
packed windows inside each document; ALiBi on raw token indices).

This module shares no code with the fake Primus-Turbo's math: both are held to the
float64 oracles of the test suite.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor

from ..attention.pattern import MaskMod, Pattern

BLOCK_Q = 256
"""Query rows per block."""

TILE_ELEMENTS = 1 << 22
"""Score elements per tile (batch x heads x rows x keys): 16 MiB in fp32, whatever the length."""

_MIN_KV, _MAX_KV = 128, 4096
_INF = float("inf")


@dataclass(frozen=True)
class Region:
    """Queries ``[q0, q1)`` see keys ``[k0, k1)`` at most; the window is read at
    ``(q - oq, kv - ok)`` (a document's own positions for packed calls)."""

    q0: int
    q1: int
    k0: int
    k1: int
    oq: int = 0
    ok: int = 0


@dataclass(frozen=True)
class Layout:
    """Where attention may look: regions, the window inside them, and any further mask."""

    regions: tuple[Region, ...]
    window: Pattern = Pattern()
    mask_mod: Optional[MaskMod] = None
    """Evaluated on every visited tile, on global ``(b, h, q_idx, kv_idx)``."""


def dense_layout(pattern: Optional[Pattern], mask_mod: Optional[MaskMod], q_len: int, kv_len: int) -> Layout:
    """The layout of a dense call: a pattern (maybe with documents), a hook, or full."""
    if pattern is None:
        return Layout((Region(0, q_len, 0, kv_len),), mask_mod=mask_mod)
    window = Pattern(pattern.left, pattern.right)
    if not pattern.documents:
        return Layout((Region(0, q_len, 0, kv_len),), window)
    if q_len != kv_len:  # documents over unequal lengths: one region, the whole pattern per tile
        return Layout((Region(0, q_len, 0, kv_len),), window, mask_mod=pattern.mask_mod())
    bounds = pattern.at_length(q_len).boundaries or (0, q_len)
    return Layout(tuple(Region(a, b, a, b) for a, b in zip(bounds, bounds[1:]) if b > a), window)


def packed_layout(pattern: Pattern, cu_q: Sequence[int], cu_kv: Sequence[int]) -> Layout:
    """The layout of a packed call: one region per document, the window in its own positions."""
    regions = tuple(Region(a, b, c, d, a, c) for a, b, c, d in zip(cu_q, cu_q[1:], cu_kv, cu_kv[1:]) if b > a)
    return Layout(regions, Pattern(pattern.left, pattern.right))


def packed_band_layout(pattern: Pattern, cu_q: Tensor, cu_kv: Tensor, total_q: int, total_kv: int,
                       max_q: int, max_kv: int, same: bool) -> Layout:
    """A packed call's layout without reading its boundaries on the host (no device sync).

    Documents are told apart per tile on the device.  With the same boundaries for q and
    kv (``same``), a query and a key of one document are less than ``max_seqlen`` apart,
    so only that band around the diagonal is visited; otherwise every tile is.
    """
    cu_q, cu_kv = cu_q.long(), cu_kv.long()
    window = Pattern(pattern.left, pattern.right)

    def documents(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        doc_q = torch.bucketize(q_idx, cu_q[1:], right=True).clamp(max=cu_q.numel() - 1)
        doc_kv = torch.bucketize(kv_idx, cu_kv[1:], right=True).clamp(max=cu_kv.numel() - 1)
        return (doc_q == doc_kv) & window.allows(q_idx - cu_q[doc_q], kv_idx - cu_kv[doc_kv])

    band = Pattern()
    if same:
        reach = max(int(max_q), int(max_kv)) - 1
        band = Pattern(reach if window.left < 0 else min(window.left, reach),
                       reach if window.right < 0 else min(window.right, reach))
    return Layout((Region(0, total_q, 0, total_kv),), band, mask_mod=documents)


@dataclass(frozen=True)
class _Tile:
    q0: int
    q1: int
    k0: int
    k1: int
    region: Region
    masked: bool


def _blocks(layout: Layout, batch_heads: int) -> Iterator[tuple[int, int, list[_Tile]]]:
    """Query blocks with the key chunks they must visit."""
    left, right = layout.window.left, layout.window.right
    for r in layout.regions:
        for a in range(r.q0, r.q1, BLOCK_Q):
            b = min(a + BLOCK_Q, r.q1)
            lo = r.k0 if left < 0 else max(r.k0, r.ok + (a - r.oq) - left)
            hi = r.k1 if right < 0 else min(r.k1, r.ok + (b - 1 - r.oq) + right + 1)
            step = max(_MIN_KV, min(_MAX_KV, TILE_ELEMENTS // max(1, batch_heads * (b - a))))
            tiles = []
            for c in range(lo, hi, step):
                d = min(c + step, hi)
                # whole iff every row's band contains [c, d)
                whole = ((left < 0 or (c - r.ok) >= (b - 1 - r.oq) - left)
                         and (right < 0 or (d - 1 - r.ok) <= (a - r.oq) + right))
                tiles.append(_Tile(a, b, c, d, r, layout.mask_mod is not None or not whole))
            yield a, b, tiles


def _positions(t: _Tile, device: torch.device) -> tuple[Tensor, Tensor]:
    """A tile's global query positions ``[n, 1]`` and key positions ``[1, m]``."""
    return (torch.arange(t.q0, t.q1, device=device).view(-1, 1),
            torch.arange(t.k0, t.k1, device=device).view(1, -1))


def _scores(qb: Tensor, kb: Tensor, t: _Tile, layout: Layout, scale: float, slopes: Optional[Tensor]) -> Tensor:
    """Masked scores of one tile, ``[B, Hkv, G, n, m]``."""
    s = torch.matmul(qb, kb.transpose(-1, -2)) * scale
    if slopes is None and not t.masked:
        return s
    dev = qb.device
    qi, ki = _positions(t, dev)
    if slopes is not None:
        s = s + slopes * (ki - qi).to(s.dtype)
    if t.masked:
        r = t.region
        allowed = layout.window.allows(qi - r.oq, ki - r.ok)
        if layout.mask_mod is not None:
            batch, hkv, groups = qb.shape[:3]
            b_idx = torch.arange(batch, device=dev).view(-1, 1, 1, 1)
            h_idx = torch.arange(hkv * groups, device=dev).view(1, -1, 1, 1)
            hook = torch.as_tensor(layout.mask_mod(b_idx, h_idx, qi.view(1, 1, -1, 1), ki.view(1, 1, 1, -1)),
                                   device=dev).to(torch.bool)
            allowed = (hook & allowed).expand(batch, hkv * groups, *allowed.shape).reshape(s.shape)
        s = s.masked_fill(~allowed, -_INF)
    return s


def _grouped(t: Tensor, hkv: int, work: torch.dtype) -> Tensor:
    """bshd -> ``[B, Hkv, G, S, D]`` in ``work`` (``G = 1`` for k and v, which then broadcast)."""
    return t.transpose(1, 2).to(work).unflatten(1, (hkv, -1))


@dataclass(frozen=True)
class _Problem:
    """What forward and backward both derive from the inputs: the working dtype, the scale,
    q/k/v grouped by key/value head, per-head extras as ``[1, Hkv, G, 1, 1]``."""

    work: torch.dtype
    scale: float
    hkv: int
    batch_heads: int
    qg: Tensor
    kg: Tensor
    vg: Tensor
    sink_g: Optional[Tensor]
    slopes_g: Optional[Tensor]


def _problem(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], sink: Optional[Tensor],
             alibi_slopes: Optional[Tensor]) -> _Problem:
    batch, _, hq, head_dim = q.shape
    hkv = k.shape[2]
    work = torch.promote_types(q.dtype, torch.float32)
    per_head = lambda t: None if t is None else t.detach().to(work).view(1, hkv, -1, 1, 1)  # noqa: E731
    return _Problem(work, head_dim ** -0.5 if scale is None else float(scale), hkv, batch * hq,
                    _grouped(q, hkv, work), _grouped(k, hkv, work), _grouped(v, hkv, work), per_head(sink),
                    per_head(alibi_slopes))


def forward(q: Tensor, k: Tensor, v: Tensor, layout: Layout, *, scale: Optional[float] = None,
            sink: Optional[Tensor] = None, alibi_slopes: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """bshd attention: ``(out [B, Sq, Hq, Dv] in q's dtype, lse [B, Hq, Sq])``.

    ``lse`` stays in the working precision (fp32, float64 for float64 inputs), so that a
    float64 backward from it is exact to float64.  A row with nothing allowed gives zeros
    and ``lse = -inf`` (the sink's logit with a sink).
    """
    pb = _problem(q, k, v, scale, sink, alibi_slopes)
    qg, kg, vg, sink_g, slopes_g, scale = pb.qg, pb.kg, pb.vg, pb.sink_g, pb.slopes_g, pb.scale
    out = qg.new_zeros(*qg.shape[:-1], v.shape[-1])
    lse = qg.new_full(qg.shape[:-1], -_INF)
    if sink_g is not None:
        lse.copy_(sink_g.squeeze(-1).expand_as(lse))
    for a, b, tiles in _blocks(layout, pb.batch_heads):
        qb = qg[..., a:b, :]
        stats = (*qb.shape[:-1], 1)
        m = qb.new_full(stats, -_INF) if sink_g is None else sink_g.expand(stats).clone()
        denom = qb.new_zeros(stats) if sink_g is None else qb.new_ones(stats)
        acc = qb.new_zeros(*qb.shape[:-1], v.shape[-1])
        for t in tiles:
            s = _scores(qb, kg[..., t.k0:t.k1, :], t, layout, scale, slopes_g)
            top = torch.maximum(m, s.amax(-1, keepdim=True))
            shift = torch.where(top == -_INF, torch.zeros_like(top), top)
            p = torch.exp(s - shift)
            rescale = torch.exp(m - shift)
            denom = denom * rescale + p.sum(-1, keepdim=True)
            acc = acc * rescale + torch.matmul(p, vg[..., t.k0:t.k1, :])
            m = top
        out[..., a:b, :] = acc / torch.where(denom > 0, denom, torch.ones_like(denom))
        lse[..., a:b] = (m + torch.log(denom)).squeeze(-1)
    return out.flatten(1, 2).transpose(1, 2).to(q.dtype), lse.flatten(1, 2)


def backward(d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, layout: Layout, *,
             scale: Optional[float] = None, sink: Optional[Tensor] = None,
             alibi_slopes: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor],
                                                             Optional[Tensor]]:
    """Gradients ``(dq, dk, dv, dsink, dslopes)`` from the forward's ``out`` and ``lse``,
    each in its input's dtype and layout (``None`` for an absent sink or slopes)."""
    pb = _problem(q, k, v, scale, sink, alibi_slopes)
    qg, kg, vg, slopes_g, scale, work, hkv = pb.qg, pb.kg, pb.vg, pb.slopes_g, pb.scale, pb.work, pb.hkv
    do = _grouped(d_out, hkv, work)
    delta = (do * _grouped(out, hkv, work)).sum(-1, keepdim=True)
    # +inf for an empty row makes every P of it exp(-inf) = 0
    lse_g = lse.to(work).unflatten(1, (hkv, -1)).unsqueeze(-1)
    lse_g = torch.where(lse_g == -_INF, torch.full_like(lse_g, _INF), lse_g)
    dq, dk, dv = torch.zeros_like(qg), torch.zeros_like(kg.squeeze(2)), torch.zeros_like(vg.squeeze(2))
    dslopes = None if alibi_slopes is None else qg.new_zeros(hkv, qg.shape[2])
    for a, b, tiles in _blocks(layout, pb.batch_heads):
        qb, dob, delta_b, lse_b = qg[..., a:b, :], do[..., a:b, :], delta[..., a:b, :], lse_g[..., a:b, :]
        dq_b = torch.zeros_like(qb)
        for t in tiles:
            kb, vb = kg[..., t.k0:t.k1, :], vg[..., t.k0:t.k1, :]
            p = torch.exp(_scores(qb, kb, t, layout, scale, slopes_g) - lse_b)
            dv[..., t.k0:t.k1, :] += torch.matmul(p.transpose(-1, -2), dob).sum(2)
            ds = p * (torch.matmul(dob, vb.transpose(-1, -2)) - delta_b)
            dq_b += torch.matmul(ds, kb)
            dk[..., t.k0:t.k1, :] += torch.matmul(ds.transpose(-1, -2), qb).sum(2)
            if dslopes is not None:
                qi, ki = _positions(t, q.device)
                dslopes += (ds * (ki - qi).to(work)).sum((0, 3, 4))
        dq[..., a:b, :] = dq_b * scale
    dsink = None
    if pb.sink_g is not None:
        dsink = -(torch.exp(pb.sink_g - lse_g) * delta).sum((0, 3, 4)).flatten().to(sink.dtype)  # type: ignore[union-attr]
    bshd = lambda g, like: g.flatten(1, 2).transpose(1, 2).to(like.dtype)  # noqa: E731
    return (bshd(dq, q), (dk * scale).transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype), dsink,
            None if dslopes is None else dslopes.flatten().to(alibi_slopes.dtype))  # type: ignore[union-attr]


class BlockwiseAttention(torch.autograd.Function):
    """`forward` and `backward` as one autograd node: ``apply(q, k, v, sink, slopes, layout, scale)``."""

    @staticmethod
    def forward(ctx, q, k, v, sink, slopes, layout, scale):  # type: ignore[override]
        out, lse = forward(q, k, v, layout, scale=scale, sink=sink, alibi_slopes=slopes)
        ctx.save_for_backward(q, k, v, sink, slopes, out, lse)
        ctx.layout, ctx.scale = layout, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out, _d_lse):  # type: ignore[override]
        q, k, v, sink, slopes, out, lse = ctx.saved_tensors
        dq, dk, dv, dsink, dslopes = backward(d_out, q, k, v, out, lse, ctx.layout, scale=ctx.scale,
                                              sink=sink, alibi_slopes=slopes)
        needs = ctx.needs_input_grad
        return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None,
                dsink if needs[3] else None, dslopes if needs[4] else None, None, None)


__all__ = ["BLOCK_Q", "BlockwiseAttention", "Layout", "Region", "TILE_ELEMENTS", "backward", "dense_layout",
           "forward", "packed_band_layout", "packed_layout"]
