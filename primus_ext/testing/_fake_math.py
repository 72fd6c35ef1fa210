"""The fake Primus-Turbo's own attention math: blockwise online softmax, hand-written backward.

Written apart from `primus_ext.backends.exact` on purpose: the reference backend uses
that module, and a parity test "flex through the fake equals the reference" is only
worth something when the two sides do not share their numerics.  Both are held to the
independent float64 oracles of ``tests/oracle.py`` and ``tests/fuzz/oracle.py``.

The algorithm is the flash-attention one, run on CPU tensors:

* forward: keys are visited in blocks of `BLOCK_KV` positions; each query row keeps a
  running maximum ``m``, a running denominator ``l`` and an unnormalised output
  ``acc`` (float32, float64 for float64 inputs), rescaled by ``exp(m_old - m_new)``
  whenever the maximum grows; at the end ``out = acc / l`` and ``lse = m + log(l)``;
* backward, from the saved ``out`` and ``lse``: ``P = exp(S - lse)`` is recomputed per
  block, ``delta = rowsum(dO * out)``, ``dS = P * (dO V^T - delta)``, then
  ``dQ = dS K * scale``, ``dK = dS^T Q * scale``, ``dV = P^T dO``; a sink's gradient is
  ``-sum(exp(sink - lse) * delta)``, a bias's ``sum(dS)``, an ALiBi slope's
  ``sum(dS * distance)``.

Conventions kept from the fake's contract: a window is a flash-convention `Pattern`
whose query ``i`` sits at key ``i + Skv - Sq`` (bottom-right, per document for thd);
ALiBi is the kernels' (`_alibi_distance`: CK's ``+slope[h] * kv`` on a plain causal mask and
the symmetric ``-slope[h] * |q - kv|``, bottom-right aligned, on every other; with a sink the
Triton kernels' symmetric form on every mask; positions inside each document for thd); GQA
query head ``h`` reads key/value head ``h // (Hq // Hkv)``; a row with nothing allowed
gives zeros (``lse = -inf`` without a sink).  Dropout (``p > 0``) takes a simple path
instead: whole-row softmax, ``torch.nn.functional.dropout`` on the probabilities and
autograd, as the fake always did.

Faults (opt-in, see `FAULTS`) reproduce known silent defects of Primus-Turbo builds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..attention.pattern import FULL, Pattern

BLOCK_KV = 16
"""Key/value positions per block of the online softmax."""

SINK_BACKWARD_IGNORES_RIGHT_WINDOW = "sink_backward_ignores_right_window"
"""AITER's sink path runs Triton kernels whose backward takes only the left window edge:
with a sink and a right bound > 0 the forward is right, the gradients are computed as if
the right bound were -1 (unbounded), normalised by the forward's (correct) lse."""

SINK_LEFT_WINDOW_ZERO_UNBOUNDED = "sink_left_window_zero_unbounded"
"""AITER's sink path (Triton kernels) with a left window bound of 0: ``sliding_window = max(left, 0)``
is applied only when > 0 (aiter ops/triton/attention/mha.py l.110, _triton_kernels/attention/mha.py
l.195 at e4048607), forward and backward, so the call attends as if the left bound were -1."""

FLYDSL_NARROW_WINDOW_BACKWARD_NAN = "flydsl_narrow_window_backward_nan"
"""FlyDSL's backward with a left window narrower than 64 (``0 <= left < 64``): its kv band is
narrower than a q block, so the dQ reduce sums workspace no block wrote and dQ is NaN
(``_MIN_FLYDSL_WINDOW``, attention_impl.py l.46-50 at a6a16cd).  The dispatcher sends such
windows to AITER; FlyDSL's kernel-level functions do not check them (`._fake_flydsl`)."""

HIPKITTENS_FORWARD_SKIPS_ROWS = "hipkittens_forward_skips_rows_above_skv"
"""HipKittens' forward with ``Sq > Skv`` returns early for the leading ``Sq - Skv`` query rows
(bottom-right causal: they see no key) before their store, so those rows of ``out`` and ``lse``
are uninitialised memory (the note on the ``Sq > Skv`` check of ``hipkittens_attn_supported``,
primus_turbo/hipkittens/attention/attention.py at a6a16cd).  The check refuses the shape; the
fault is a build or caller without it: the check lets it pass and the rows come back NaN
(`._fake_hipkittens`)."""

CORRUPT_OUTPUT = {"aiter_corrupt_output": "AITER", "flydsl_corrupt_output": "FlyDSL",
                  "hipkittens_corrupt_output": "HipKittens"}
"""Injected faults, not known defects: every entry call the named kernel backend takes (an arch
set, so that calls are dispatched) returns its last query head's output negated.  They let a
test show that the self-test reaches, and catches a fault in, each backend a layer's calls reach."""

FAULTS = frozenset({SINK_BACKWARD_IGNORES_RIGHT_WINDOW, SINK_LEFT_WINDOW_ZERO_UNBOUNDED, FLYDSL_NARROW_WINDOW_BACKWARD_NAN,
                    HIPKITTENS_FORWARD_SKIPS_ROWS, *CORRUPT_OUTPUT})

FAULT_BACKEND = {SINK_BACKWARD_IGNORES_RIGHT_WINDOW: "AITER", SINK_LEFT_WINDOW_ZERO_UNBOUNDED: "AITER",
                 FLYDSL_NARROW_WINDOW_BACKWARD_NAN: "FlyDSL",
                 HIPKITTENS_FORWARD_SKIPS_ROWS: "HipKittens", **CORRUPT_OUTPUT}
"""The kernel backend whose defect each fault reproduces."""


def corrupt_output(result: Any) -> Any:
    """`CORRUPT_OUTPUT`'s corruption of an entry's result (``out`` or ``(out, lse, ...)``, out
    ``[..., H, D]``): the last head negated, differentiably, so gradients are wrong too."""
    out = result[0] if isinstance(result, tuple) else result
    sign = torch.ones(out.shape[-2], 1, dtype=out.dtype, device=out.device)
    sign[-1] = -1
    out = out * sign
    return (out, *result[1:]) if isinstance(result, tuple) else out

_NEG_INF = float("-inf")


def unknown_faults(faults: Iterable[str]) -> list[str]:
    """The names in ``faults`` the fake does not model, sorted (each caller words its own refusal)."""
    return sorted(set(faults) - FAULTS)


def check_faults(faults: Iterable[str]) -> frozenset[str]:
    """``faults`` as a frozenset, refusing names the fake does not model."""
    chosen = frozenset(faults)
    unknown = unknown_faults(chosen)
    if unknown:
        raise ValueError(f"unknown fake Primus-Turbo fault(s) {unknown}; known: {sorted(FAULTS)}")
    return chosen


@dataclass(frozen=True)
class _Spec:
    """Everything static about one (batch of) attention problem(s)."""

    window: Pattern        # forward mask
    backward_window: Pattern  # mask the backward recomputes with (differs only under a fault)
    q_shift: int           # query i sits at key i + q_shift for the mask
    scale: float
    block: int
    triton_alibi: bool = False  # AITER's sink path: Triton kernels, whose ALiBi is always symmetric


def _unbounded(window: Pattern) -> bool:
    return window.left < 0 and window.right < 0 and not window.documents


# ----------------------------------------------------------------------------- blocks
def _heads(q: Tensor, k: Tensor, v: Tensor, work: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """bshd -> ``q [B, Hkv, G, Sq, D]``, ``k, v [B, Hkv, 1, Skv, D]`` (views when no cast)."""
    hkv = k.shape[2]
    qg = q.transpose(1, 2).to(work).unflatten(1, (hkv, q.shape[2] // hkv))
    return qg, k.transpose(1, 2).to(work).unsqueeze(2), v.transpose(1, 2).to(work).unsqueeze(2)


def _positions(q_len: int, j0: int, n: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Query positions ``[Sq, 1]`` and key positions ``j0 .. j0 + n`` as ``[1, n]``."""
    return (torch.arange(q_len, device=device).view(q_len, 1),
            torch.arange(j0, j0 + n, device=device).view(1, n))


def _alibi_distance(q_pos: Tensor, kv_pos: Tensor, spec: _Spec) -> Tensor:
    """What CK's fmha kernels (AITER's ALiBi path) multiply each slope by, from
    ``block_position_encoding.hpp`` (ROCm/composable_kernel at fe6e4fb; docs/fidelity.md, fact `ck-alibi`):

    * a plain causal mask (left unbounded, right bound 0) is ``AlibiMode::VERTICAL``: ``+kv``,
      a per-row constant away from ``kv - q`` (equal after the softmax, not in the lse);
    * any other mask, and no mask, ``FROM_BOTTOM_RIGHT``: ``-|q + max(Skv - Sq, 0) - kv -
      max(Sq - Skv, 0)|``, symmetric, so keys right of the diagonal are penalised too.

    With a sink AITER runs Triton kernels instead (``aiter/ops/triton/_triton_kernels/attention/
    mha.py`` ``_compute_alibi_block`` and ``mha_onekernel_bwd.py``, ROCm/aiter e4048607): always
    ``-|q + Skv - Sq - kv|``, whatever the mask.  Positions are those inside the sequence (each
    document's own, for varlen).
    """
    shift = spec.q_shift  # Skv - Sq
    if spec.triton_alibi:
        return -(q_pos + shift - kv_pos).abs()
    window = spec.window
    if window.left < 0 and window.right == 0:
        return kv_pos.expand(q_pos.shape[0], kv_pos.shape[1])
    return -(q_pos + max(shift, 0) - kv_pos - max(-shift, 0)).abs()


def _scores(qg: Tensor, kb: Tensor, j0: int, spec: _Spec, window: Pattern,
            slopes: Optional[Tensor], bias: Optional[Tensor]) -> Tensor:
    """Scores of all queries against keys ``j0 .. j0 + n``: ``[B, Hkv, G, Sq, n]``."""
    n = kb.shape[-2]
    s = torch.matmul(qg, kb.transpose(-1, -2)) * spec.scale
    q_pos, kv_pos = _positions(qg.shape[-2], j0, n, qg.device)
    if slopes is not None:
        s = s + slopes * _alibi_distance(q_pos, kv_pos, spec).to(s.dtype)
    if bias is not None:
        s = s + bias[:, j0:j0 + n]
    if not _unbounded(window):
        s = s.masked_fill(~window.allows(q_pos + spec.q_shift, kv_pos), _NEG_INF)
    return s


def _extras(sink: Optional[Tensor], slopes: Optional[Tensor], bias: Optional[Tensor], hkv: int,
            work: torch.dtype) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """Sink and slopes as ``[Hkv, G, 1, 1]``, bias as ``[Sq, Skv]``, all in ``work``."""
    sink_g = None if sink is None else sink.to(work).view(hkv, -1, 1, 1)
    slopes_g = None if slopes is None else slopes.to(work).view(hkv, -1, 1, 1)
    return sink_g, slopes_g, None if bias is None else bias.to(work)


def _forward(qg: Tensor, kh: Tensor, vh: Tensor, spec: _Spec, sink: Optional[Tensor],
             slopes: Optional[Tensor], bias: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """Online softmax over key blocks: ``(out [B, Hkv, G, Sq, Dv], lse [B, Hkv, G, Sq])``."""
    batch, hkv, groups, sq, _ = qg.shape
    stats = (batch, hkv, groups, sq, 1)
    if sink is None:
        m, l = qg.new_full(stats, _NEG_INF), qg.new_zeros(stats)
    else:  # the sink is one more logit, carrying no value: start each row with it
        m, l = sink.expand(stats), qg.new_ones(stats)
    acc = qg.new_zeros(batch, hkv, groups, sq, vh.shape[-1])
    for j0 in range(0, kh.shape[-2], spec.block):
        kb, vb = kh[..., j0:j0 + spec.block, :], vh[..., j0:j0 + spec.block, :]
        s = _scores(qg, kb, j0, spec, spec.window, slopes, bias)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        base = torch.where(m_new == _NEG_INF, torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - base)
        p = torch.exp(s - base)
        l = l * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.matmul(p, vb)
        m = m_new
    out = acc / torch.where(l > 0, l, torch.ones_like(l))
    return out, (m + torch.log(l)).squeeze(-1)


def _backward(d_out: Tensor, qg: Tensor, kh: Tensor, vh: Tensor, out: Tensor, lse: Tensor,
              spec: _Spec, sink: Optional[Tensor], slopes: Optional[Tensor], bias: Optional[Tensor],
              needs: Sequence[bool]) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor],
                                             Optional[Tensor], Optional[Tensor]]:
    """Flash backward from ``out`` and ``lse``; ``needs`` flags (sink, slopes, bias) grads."""
    delta = (d_out * out).sum(-1, keepdim=True)
    # A row with nothing allowed has lse = -inf; +inf there makes every P of it exp(-inf) = 0.
    lse_b = torch.where(lse == _NEG_INF, torch.full_like(lse, float("inf")), lse).unsqueeze(-1)
    d_q = torch.zeros_like(qg)
    d_ks, d_vs = [], []
    d_bias = torch.zeros_like(bias) if needs[2] and bias is not None else None
    d_slopes = qg.new_zeros(qg.shape[1], qg.shape[2]) if needs[1] and slopes is not None else None
    for j0 in range(0, kh.shape[-2], spec.block):
        kb, vb = kh[..., j0:j0 + spec.block, :], vh[..., j0:j0 + spec.block, :]
        p = torch.exp(_scores(qg, kb, j0, spec, spec.backward_window, slopes, bias) - lse_b)
        d_vs.append(torch.matmul(p.transpose(-1, -2), d_out).sum(2))
        d_s = p * (torch.matmul(d_out, vb.transpose(-1, -2)) - delta)
        d_q = d_q + torch.matmul(d_s, kb) * spec.scale
        d_ks.append(torch.matmul(d_s.transpose(-1, -2), qg).sum(2) * spec.scale)
        n = kb.shape[-2]
        if d_bias is not None:
            d_bias[:, j0:j0 + n] = d_s.sum((0, 1, 2))
        if d_slopes is not None:
            q_pos, kv_pos = _positions(qg.shape[-2], j0, n, qg.device)
            dist = _alibi_distance(q_pos, kv_pos, spec).to(d_s.dtype)
            d_slopes = d_slopes + (d_s * dist).sum((0, 3, 4))
    d_k = torch.cat(d_ks, dim=2) if d_ks else torch.zeros_like(kh.squeeze(2))  # Skv == 0
    d_v = torch.cat(d_vs, dim=2) if d_vs else torch.zeros_like(vh.squeeze(2))
    d_sink = None
    if needs[0] and sink is not None:
        d_sink = -(torch.exp(sink - lse_b) * delta).sum((0, 3, 4)).flatten()
    return d_q, d_k, d_v, d_sink, None if d_slopes is None else d_slopes.flatten(), d_bias


def _forward_bshd(q: Tensor, k: Tensor, v: Tensor, spec: _Spec, sink: Optional[Tensor], slopes: Optional[Tensor],
                  bias: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """``(out [B, Hq, Sq, Dv] in work precision, lse [B, Hkv, G, Sq])`` of bshd inputs."""
    work = torch.promote_types(q.dtype, torch.float32)
    qg, kh, vh = _heads(q, k, v, work)
    return _forward(qg, kh, vh, spec, *_extras(sink, slopes, bias, k.shape[2], work))


def _backward_bshd(d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, spec: _Spec,
                   sink: Optional[Tensor], slopes: Optional[Tensor], bias: Optional[Tensor],
                   needs: Sequence[bool]) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor],
                                                   Optional[Tensor]]:
    """bshd gradients (work precision) from ``d_out [B, Hq, Sq, Dv]``, ``out`` alike and ``lse [B, Hkv, G, Sq]``."""
    work = torch.promote_types(q.dtype, torch.float32)
    qg, kh, vh = _heads(q, k, v, work)
    hkv = k.shape[2]
    d_q, d_k, d_v, d_sink, d_slopes, d_bias = _backward(
        d_out.to(work).unflatten(1, (hkv, -1)), qg, kh, vh, out.to(work).unflatten(1, (hkv, -1)), lse, spec,
        *_extras(sink, slopes, bias, hkv, work), needs=needs)
    return d_q.flatten(1, 2).transpose(1, 2), d_k.transpose(1, 2), d_v.transpose(1, 2), d_sink, d_slopes, d_bias


class _Blockwise(torch.autograd.Function):
    """bshd q, k, v -> ``(out [B, Hq, Sq, Dv] in q's dtype, lse [B, Hq, Sq] fp32)``."""

    @staticmethod
    def forward(ctx, q, k, v, sink, slopes, bias, spec):  # type: ignore[override]
        out, lse = _forward_bshd(q, k, v, spec, sink, slopes, bias)
        result = out.flatten(1, 2).to(q.dtype)
        # The backward reads the output as the kernel stored it (rounded to q's dtype), as
        # flash kernels do: the fake must not be more precise than the real one.
        ctx.save_for_backward(q, k, v, sink, slopes, bias, result, lse)
        ctx.spec = spec
        lse32 = lse.flatten(1, 2).float()
        ctx.mark_non_differentiable(lse32)
        return result, lse32

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out, _d_lse):  # type: ignore[override]
        q, k, v, sink, slopes, bias, out, lse = ctx.saved_tensors
        # No gradient for ALiBi slopes: AITER's backward returns none (Primus-Turbo flash_attn_interface.py
        # l.58-60 at a6a16cd), and the fake is never kinder than the real library.
        needs = ctx.needs_input_grad[:4] + (False,) + ctx.needs_input_grad[5:]
        grads = _backward_bshd(d_out, q, k, v, out, lse, ctx.spec, sink, slopes, bias, needs[3:6])

        def back(grad: Optional[Tensor], like: Optional[Tensor], wanted: bool) -> Optional[Tensor]:
            return grad.to(like.dtype) if wanted and grad is not None and like is not None else None

        return tuple(back(g, t, n) for g, t, n in zip(grads, (q, k, v, sink, slopes, bias), needs)) + (None,)


def _with_dropout(q: Tensor, k: Tensor, v: Tensor, spec: _Spec, sink: Optional[Tensor],
                  slopes: Optional[Tensor], bias: Optional[Tensor], p: float) -> tuple[Tensor, Tensor]:
    """Dropout on the probabilities: one whole-row softmax, differentiated by autograd."""
    work = torch.promote_types(q.dtype, torch.float32)
    qg, kh, vh = _heads(q, k, v, work)
    sink_g, slopes_g, bias_w = _extras(sink, slopes, bias, k.shape[2], work)
    s = _scores(qg, kh, 0, spec, spec.window, slopes_g, bias_w)
    top = s.amax(-1, keepdim=True) if s.shape[-1] else s.new_full((*s.shape[:-1], 1), _NEG_INF)
    if sink_g is not None:
        top = torch.maximum(top, sink_g)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top)).detach()
    weights = torch.exp(s - top)
    denom = weights.sum(-1, keepdim=True)
    if sink_g is not None:
        denom = denom + torch.exp(sink_g - top)
    probs = F.dropout(weights / torch.where(denom > 0, denom, torch.ones_like(denom)), p=p, training=True)
    out = torch.matmul(probs, vh).flatten(1, 2).to(q.dtype)
    return out, (torch.log(denom) + top).squeeze(-1).flatten(1, 2).float()


def _run(q: Tensor, k: Tensor, v: Tensor, spec: _Spec, sink: Optional[Tensor],
         slopes: Optional[Tensor], bias: Optional[Tensor], dropout_p: float) -> tuple[Tensor, Tensor]:
    if dropout_p > 0.0:
        return _with_dropout(q, k, v, spec, sink, slopes, bias, dropout_p)
    return _Blockwise.apply(q, k, v, sink, slopes, bias, spec)


def _spec(window: Pattern, q_len: int, kv_len: int, scale: Optional[float],
          head_dim: int, block: int, sink: Optional[Tensor], faults: frozenset[str]) -> _Spec:
    if SINK_LEFT_WINDOW_ZERO_UNBOUNDED in faults and sink is not None and window.left == 0:
        window = dataclasses.replace(window, left=-1)
    backward_window = window
    if SINK_BACKWARD_IGNORES_RIGHT_WINDOW in faults and sink is not None and window.right > 0:
        backward_window = dataclasses.replace(window, right=-1)
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    return _Spec(window, backward_window, kv_len - q_len,
                 head_dim ** -0.5 if scale is None else float(scale), int(block), triton_alibi=sink is not None)


# ----------------------------------------------------------------------------- entries
def attention(q: Tensor, k: Tensor, v: Tensor, *, window: Pattern = FULL, scale: Optional[float] = None,
              alibi_slopes: Optional[Tensor] = None, bias: Optional[Tensor] = None,
              sink: Optional[Tensor] = None, dropout_p: float = 0.0, return_lse: bool = False,
              faults: Iterable[str] = (), block: int = BLOCK_KV):
    """Dense bshd attention, ``window`` aligned bottom-right.

    Returns ``out [B, Sq, Hq, Dv]`` in q's dtype (a view of a bhsd-dense tensor, as the
    fake always returned it), or ``(out, lse [B, Hq, Sq] fp32)``.
    """
    spec = _spec(window, q.shape[1], k.shape[1], scale, q.shape[-1], block, sink,
                 check_faults(faults))
    out, lse = _run(q, k, v, spec, sink, alibi_slopes, bias, float(dropout_p))
    out = out.transpose(1, 2)
    return (out, lse) if return_lse else out


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, bounds_q: Sequence[int], bounds_k: Sequence[int],
                     *, window: Pattern = FULL, scale: Optional[float] = None,
                     alibi_slopes: Optional[Tensor] = None, sink: Optional[Tensor] = None,
                     dropout_p: float = 0.0, return_lse: bool = False, faults: Iterable[str] = (),
                     block: int = BLOCK_KV):
    """Packed thd attention, one document pair at a time (host boundaries, already checked).

    Document ``i`` holds queries ``bounds_q[i]:bounds_q[i+1]`` and keys
    ``bounds_k[i]:bounds_k[i+1]``; ``window`` is aligned bottom-right inside each pair.
    Returns ``out [T, Hq, Dv]`` (a view of an ``[Hq, T, Dv]``-dense tensor), or
    ``(out, lse [Hq, T] fp32)``, the flash-attn varlen layout.
    """
    chosen = check_faults(faults)
    outs, lses = [], []
    for (q0, q1), (k0, k1) in zip(zip(bounds_q, bounds_q[1:]), zip(bounds_k, bounds_k[1:])):
        spec = _spec(window, q1 - q0, k1 - k0, scale, q.shape[-1], block, sink, chosen)
        out, lse = _run(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], spec, sink, alibi_slopes,
                        None, float(dropout_p))
        outs.append(out[0])
        lses.append(lse[0])
    out = torch.cat(outs, dim=1).transpose(0, 1)
    return (out, torch.cat(lses, dim=1)) if return_lse else out


def kernel_forward(q: Tensor, k: Tensor, v: Tensor, *, window: Pattern, scale: Optional[float],
                   alibi_slopes: Optional[Tensor], bias: Optional[Tensor], sink: Optional[Tensor],
                   faults: Iterable[str] = ()) -> tuple[Tensor, Tensor]:
    """The kernel-level dense forward: ``(out [B, Sq, Hq, Dv] in q's dtype, lse [B, Hq, Sq] fp32)``,
    ``window`` bottom-right; no dropout (the ops bound by primus_ext never pass one)."""
    spec = _spec(window, q.shape[1], k.shape[1], scale, q.shape[-1], BLOCK_KV, sink, check_faults(faults))
    with torch.no_grad():
        out, lse = _forward_bshd(q, k, v, spec, sink, alibi_slopes, bias)
    return out.flatten(1, 2).transpose(1, 2).to(q.dtype), lse.flatten(1, 2).float()


def kernel_backward(d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, window: Pattern,
                    scale: Optional[float], alibi_slopes: Optional[Tensor], bias: Optional[Tensor],
                    sink: Optional[Tensor], faults: Iterable[str] = ()
                    ) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """The kernel-level dense backward from the forward's ``out`` and ``lse``:
    ``(dq, dk, dv, dsink fp32 or None, dbias or None)``, the known faults applied."""
    spec = _spec(window, q.shape[1], k.shape[1], scale, q.shape[-1], BLOCK_KV, sink, check_faults(faults))
    lse_g = lse.unflatten(1, (k.shape[2], -1)).to(torch.promote_types(q.dtype, torch.float32))
    with torch.no_grad():
        d_q, d_k, d_v, d_sink, _, d_bias = _backward_bshd(
            d_out.transpose(1, 2), q, k, v, out.transpose(1, 2), lse_g, spec, sink, alibi_slopes, bias,
            (sink is not None, False, bias is not None))
    return (d_q.to(q.dtype), d_k.to(k.dtype), d_v.to(v.dtype), None if d_sink is None else d_sink.float(),
            None if d_bias is None else d_bias.to(bias.dtype))  # type: ignore[union-attr]


__all__ = ["BLOCK_KV", "CORRUPT_OUTPUT", "FAULTS", "FAULT_BACKEND", "FLYDSL_NARROW_WINDOW_BACKWARD_NAN", "HIPKITTENS_FORWARD_SKIPS_ROWS",
           "SINK_BACKWARD_IGNORES_RIGHT_WINDOW", "SINK_LEFT_WINDOW_ZERO_UNBOUNDED", "attention", "check_faults", "corrupt_output",
           "kernel_backward", "kernel_forward", "unknown_faults", "varlen_attention"]
