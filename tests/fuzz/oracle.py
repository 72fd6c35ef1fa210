"""A dense float64 attention oracle for the fuzzer, written from the definitions.

Nothing here imports primus_ext.  Every mask is built from index arithmetic on an
explicit grid; the softmax is written out; autograd through it gives the expected
gradients.  It is vectorised (unlike ``tests/oracle.py``, a per-cell loop) so that
thousands of generated cases fit in a test run.

Conventions, each taken from docs/behaviours.md or the kernel contract:

* window (flash-attention): key ``kv`` is visible from query ``q`` iff
  ``q - left <= kv <= q + right``; ``-1`` leaves that side unbounded; ``causal``
  forces ``right = 0``;
* alignment: FlexAttention indices are top-left (query ``i`` is position ``i``);
  the flash kernels of the direct path align bottom-right (query ``i`` sits at
  ``i + Skv - Sq``), per packed segment pair for varlen;
* packed documents: a token sees only tokens of its own document, and the window
  applies to positions counted from each document's start; empty documents are
  allowed anywhere in the boundaries;
* sinks: one logit per query head that joins the softmax denominator and carries
  no value;
* GQA: query head ``h`` reads key/value head ``h // (Hq // Hkv)``;
* ALiBi: ``score += slope[h] * (kv - q)``; score hooks get the *scaled* score;
* user hooks are called as torch calls them (``create_block_mask`` and ``flex_attention``): under
  ``torch.vmap`` over 0-d index tensors (torch's own ``_vmap_for_bhqkv``), never on broadcast grids, so
  a hook that tells the two apart (a type check, ``.dim()``, a ``try``) is held to torch's meaning; a
  score hook's result is taken in float64, whatever dtype it returns;
* a row with nothing visible (and no sink) outputs zeros and has ``lse = -inf``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import _vmap_for_bhqkv

F64 = torch.float64


# ----------------------------------------------------------------------------- grids
def grid(batch: int, heads: int, q_len: int, kv_len: int):
    """``(b, h, q, kv)`` int64 index tensors broadcasting to ``[B, H, Sq, Skv]``."""
    return (
        torch.arange(batch).view(-1, 1, 1, 1),
        torch.arange(heads).view(1, -1, 1, 1),
        torch.arange(q_len).view(1, 1, -1, 1),
        torch.arange(kv_len).view(1, 1, 1, -1),
    )


def in_window(q_pos: Tensor, kv_pos: Tensor, left: int, right: int) -> Tensor:
    ok = torch.ones(torch.broadcast_shapes(q_pos.shape, kv_pos.shape), dtype=torch.bool)
    if left >= 0:
        ok = ok & (q_pos - kv_pos <= left)
    if right >= 0:
        ok = ok & (kv_pos - q_pos <= right)
    return ok


def flash_mask(q_len: int, kv_len: int, *, causal: bool, window: Sequence[int],
               align: str = "top_left") -> Tensor:
    """``[Sq, Skv]`` mask of ``flash_attn_func(causal=..., window_size=...)``."""
    left, right = int(window[0]), int(window[1])
    if causal:
        right = 0
    shift = kv_len - q_len if align == "bottom_right" else 0
    q_pos = torch.arange(q_len).view(-1, 1) + shift
    kv_pos = torch.arange(kv_len).view(1, -1)
    return in_window(q_pos, kv_pos, left, right)


def document_of(bounds: Sequence[int], length: int) -> Tensor:
    """Document index of each position ``0..length-1``.

    Position ``x`` belongs to the last document whose start is ``<= x`` among the
    interior boundaries, so empty documents own no position; positions past the
    last boundary stay in the last document.
    """
    interior = torch.tensor(list(bounds[1:-1]), dtype=torch.long)
    pos = torch.arange(length)
    if interior.numel() == 0:
        return torch.zeros(length, dtype=torch.long)
    return (interior.view(1, -1) <= pos.view(-1, 1)).sum(1)


def packed_mask(bounds_q: Sequence[int], bounds_kv: Sequence[int], *, causal: bool,
                window: Sequence[int], align: str = "top_left") -> Tensor:
    """``[Tq, Tkv]`` mask of packed documents with a window inside each one."""
    left, right = int(window[0]), int(window[1])
    if causal:
        right = 0
    tq, tkv = bounds_q[-1], bounds_kv[-1]
    dq, dk = document_of(bounds_q, tq), document_of(bounds_kv, tkv)
    start_q = torch.tensor(list(bounds_q), dtype=torch.long)[dq]
    start_k = torch.tensor(list(bounds_kv), dtype=torch.long)[dk]
    local_q = torch.arange(tq) - start_q
    local_k = torch.arange(tkv) - start_k
    if align == "bottom_right":
        len_q = torch.tensor([b - a for a, b in zip(bounds_q, bounds_q[1:])], dtype=torch.long)
        len_k = torch.tensor([b - a for a, b in zip(bounds_kv, bounds_kv[1:])], dtype=torch.long)
        local_q = local_q + (len_k - len_q)[dq]
    same = dq.view(-1, 1) == dk.view(1, -1)
    return same & in_window(local_q.view(-1, 1), local_k.view(1, -1), left, right)


# ----------------------------------------------------------------------------- library masks
def library_mask(name: str, kwargs: dict, q_len: int, kv_len: int) -> Tensor:
    """``[Sq, Skv]`` mask of ``primus_ext.attention.masks:<name>(**kwargs)``, from its docstring."""
    q = torch.arange(q_len).view(-1, 1)
    kv = torch.arange(kv_len).view(1, -1)
    if name == "full":
        return torch.ones(q_len, kv_len, dtype=torch.bool)
    if name == "causal":
        return kv <= q
    if name == "sliding_window":
        return in_window(q, kv, int(kwargs["left"]), int(kwargs.get("right", 0)))
    if name == "prefix_lm":
        return (kv < int(kwargs["prefix_length"])) | (kv <= q)
    if name == "chunked":
        c = int(kwargs["chunk_size"])
        same = (q // c) == (kv // c)
        return same & (kv <= q) if kwargs.get("causal", True) else same
    if name == "packed_documents":
        bounds = list(kwargs["cu_seqlens"])
        left, right = (int(x) for x in kwargs.get("window", (-1, -1)))
        if kwargs.get("causal", True):
            right = 0
        same = document_of(bounds, q_len).view(-1, 1) == document_of(bounds, kv_len).view(1, -1)
        return same & in_window(q, kv, left, right)
    raise KeyError(f"no oracle for library mask {name!r}")


def hook_mask(hook: Callable[..., Tensor], batch: int, heads: int, q_len: int, kv_len: int) -> Tensor:
    """A user mask_mod called as torch calls it, at every index of the call: ``[B, H, Sq, Skv]`` bool."""
    index = [torch.arange(n) for n in (batch, heads, q_len, kv_len)]
    out = _vmap_for_bhqkv(hook, prefix=())(*index)
    return torch.as_tensor(out).to(torch.bool).broadcast_to((batch, heads, q_len, kv_len))


def hook_scores(hook: Callable[..., Tensor], scores: Tensor) -> Tensor:
    """A user score_mod called as torch calls it on ``[B, H, Sq, Skv]`` scores (differentiable), in float64."""
    index = [torch.arange(n) for n in scores.shape]
    return _vmap_for_bhqkv(hook, prefix=(0,))(scores, *index).to(F64)


# ----------------------------------------------------------------------------- attention
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Optional[Tensor] = None,
    *,
    scale: Optional[float] = None,
    sink: Optional[Tensor] = None,
    score_fn: Optional[Callable[..., Tensor]] = None,
    alibi: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """bshd ``[B, S, H, D]`` in; ``(out [B, Sq, Hq, Dv], lse [B, Hq, Sq])`` float64 out.

    Differentiable in ``q``, ``k``, ``v`` and ``sink`` (they are used as given, so
    pass float64 leaves to get float64 gradients).  ``allowed`` broadcasts to
    ``[B, Hq, Sq, Skv]``.
    """
    batch, q_len, hq, d = q.shape
    kv_len, hkv = k.shape[1], k.shape[2]
    assert hq % hkv == 0, "the oracle needs Hkv | Hq"
    kv_head = torch.arange(hq) // (hq // hkv)
    qh = q.to(F64).permute(0, 2, 1, 3)
    kh = k.to(F64).permute(0, 2, 1, 3).index_select(1, kv_head)
    vh = v.to(F64).permute(0, 2, 1, 3).index_select(1, kv_head)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    s = torch.einsum("bhqd,bhkd->bhqk", qh, kh) * scale
    b_idx, h_idx, q_idx, kv_idx = grid(batch, hq, q_len, kv_len)
    if score_fn is not None:
        s = hook_scores(score_fn, s)
    if alibi is not None:
        s = s + alibi.to(F64).view(1, -1, 1, 1) * (kv_idx - q_idx).to(F64)
    if bias is not None:
        s = s + bias.to(F64)
    if allowed is None:
        allowed = torch.ones(1, 1, q_len, kv_len, dtype=torch.bool)
    allowed = allowed.broadcast_to(s.shape)
    masked = torch.where(allowed, s, torch.full_like(s, -math.inf))
    top = masked.amax(-1, keepdim=True)
    if sink is not None:
        sink_logit = sink.to(F64).view(1, hq, 1, 1)
        top = torch.maximum(top, sink_logit.expand_as(top))
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top)).detach()
    weights = torch.exp(masked - top)
    denom = weights.sum(-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink_logit - top)
    out = (weights @ vh) / torch.where(denom > 0, denom, torch.ones_like(denom))
    lse = (torch.log(denom) + top).squeeze(-1)
    return out.permute(0, 2, 1, 3), lse


def packed_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, **kw: Any) -> tuple[Tensor, Tensor]:
    """thd ``[T, H, D]`` in, ``(out [T, Hq, Dv], lse [Hq, T])`` out, for a ``[Tq, Tkv]`` mask."""
    out, lse = attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), allowed.view(1, 1, *allowed.shape), **kw)
    return out[0], lse[0]


# ----------------------------------------------------------------------------- comparison
@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


# Outputs are computed in float32 at least and rounded once to the input dtype;
# gradients go through one more rounding and a reduction over keys.
OUTPUT_TOL = {torch.float64: Tolerance(1e-9, 1e-9), torch.float32: Tolerance(2e-5, 2e-5),
              torch.bfloat16: Tolerance(2e-2, 2e-2)}
GRAD_TOL = {torch.float64: Tolerance(1e-8, 1e-8), torch.float32: Tolerance(1e-4, 1e-4),
            torch.bfloat16: Tolerance(6e-2, 3e-2)}


def mismatch(got: Tensor, want: Tensor, tol: Tolerance) -> Optional[str]:
    """``None`` when ``|got - want| <= atol + rtol * |want|`` everywhere, else a description."""
    if tuple(got.shape) != tuple(want.shape):
        return f"shape {tuple(got.shape)} != expected {tuple(want.shape)}"
    g, w = got.detach().to(F64), want.detach().to(F64)
    both_inf = torch.isinf(g) & torch.isinf(w) & (torch.sign(g) == torch.sign(w))
    err = torch.where(both_inf, torch.zeros_like(g), (g - w).abs())
    bound = tol.atol + tol.rtol * torch.where(torch.isinf(w), torch.zeros_like(w), w.abs())
    bad = ~(err <= bound)  # NaN counts as bad
    if not bool(bad.any()):
        return None
    where = tuple(int(i) for i in bad.nonzero()[0])
    return (f"{int(bad.sum())} of {bad.numel()} elements differ; max error "
            f"{float(err[bad].max()):.3g} (atol={tol.atol:g}, rtol={tol.rtol:g}); first at {where}: "
            f"got {float(g[where]):.6g}, expected {float(w[where]):.6g}")


__all__ = ["GRAD_TOL", "OUTPUT_TOL", "Tolerance", "attention", "document_of", "flash_mask", "grid",
           "hook_mask", "hook_scores", "in_window", "library_mask", "mismatch", "packed_attention", "packed_mask"]
