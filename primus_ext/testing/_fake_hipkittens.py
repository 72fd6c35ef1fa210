"""The fake's HipKittens kernel level: ``primus_turbo.hipkittens.attention`` and its ``_impl`` layer.

Upstream (``primus_turbo/hipkittens/attention/attention.py`` and
``pytorch/kernels/attention/attention_hipkittens_impl.py`` at a6a16cd; attention.py l.124-336)
has no ``torch.library`` op at the Python layer: plain functions check the envelope, pad, own
the workspaces and fill caller-allocated buffers through C++ ops.  The fake has the same
functions with the same signatures, written from that reading:

* ``hipkittens_attn_supported(q, k, v, *, causal, window_size, sink, dropout_p, bias,
  alibi_slopes) -> (ok, reason)``, its checks in upstream's order: gfx950, bf16 q/k/v, causal,
  no sink, dropout, bias or ALiBi, 4-D contiguous sbhd, a right window edge in {0, -1}, equal
  batch and head dim and ``v.shape == k.shape``, D in {64, 128}, ``Hq % Hkv == 0``, ``Sq <= Skv``;
* ``hipkittens_attn_forward -> (out [Sq, B, Hq, D], lse [B, Hq, 1, Sq] fp32, natural log)``, the
  lse a view of a tile-padded buffer as upstream hands it back;
* ``hipkittens_attn_backward -> (dq, dk, dv)`` sbhd; ``lse`` ``[B, Hq, 1, Sq]`` or ``[B, Hq, Sq]``;
  ``dout`` / ``out`` contiguous bf16 of q's shape, else upstream's ``NotImplementedError`` /
  ``ValueError``;
* the ``_impl`` wrappers the dispatcher imports.

The forward's softmax has a *fixed zero reference max*, not a running one
(csrc/kernels/attention/hipkittens/hk_attn_fwd_d128_gfx950.cu l.49-56, l.845-846, l.947-965, l.446, l.1048,
l.1131-1140; hk_attn_fwd_d64_gfx950.cu l.764-765, l.867-885, l.399, l.939, l.1025-1034 at a6a16cd): Q is scaled
once by ``softmax_scale * log2(e)`` and held in bf16, each logit becomes ``P = exp2(S)`` in fp32 (kittens' exp2 is
``__builtin_amdgcn_exp2f``, the bare ``v_exp_f32``, HazyResearch/HipKittens include/common/base_ops.cuh l.109-126:
``inf`` from 128 on, i.e. ``s * softmax_scale > 88.7``; no denormal results, so below 2^-126 it is 0), masked
entries are then *set* to 0, P is converted to bf16, ``l = sum P`` and ``O = P V`` accumulate in fp32, then
``out = O / l`` and ``lse = ln(l)``.  So a row with a kept logit past ~88.7 comes out NaN with ``lse = inf``;
a row whose sum alone overflows, zeros (or NaN) with ``lse = inf``; a row whose every kept logit is below
~-87.3, NaN with ``lse = -inf`` -- where an online softmax is exact.  `_zero_reference` computes that arithmetic and
`_forward` takes its rows wherever it leaves the exact range (an exp2 past fp32, a flushed weight, a
non-finite sum), the fake's online softmax elsewhere.  Upstream's ``flash_attn_func`` runs these same
functions when its dispatcher picks HipKittens (flash_attn_interface.py l.102-123, l.225-239), and so does the
fake's (`flash_attn`, unrecorded here: the entry records the call).

`HIPKITTENS_FORWARD_SKIPS_ROWS` (opt-in) is the forward kernel's own defect with ``Sq > Skv``:
the check lets the shape through and the leading ``Sq - Skv`` rows come back unwritten (NaN).
A call on gfx942 is refused as upstream's check refuses it.  The math is the fake's own
(`._fake_math`); each forward / backward is recorded as ``backend="HipKittens"``.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Optional, Tuple

import torch
from torch import Tensor

from ..attention.pattern import Pattern
from . import _fake_math
from ._fake_kernels import current, record

SUPPORTED_HEAD_DIMS = (64, 128)
_TILE = 128
"""A stand-in for the kernels' Q tile: upstream pads lse to it and returns a view."""
_KV_TILE = 64
"""The forward kernels' KV_BLOCK_SIZE: l and O accumulate one KV tile at a time."""
LOG2E = 1.44269504088896340736
_FLUSHED = torch.finfo(torch.float32).tiny
"""``v_exp_f32`` returns no denormal: an exp2 below 2^-126 is 0."""


def hipkittens_attn_supported(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, window_size: Tuple[int, int] = (-1, -1),
                              sink: Optional[Tensor] = None, dropout_p: float = 0.0, bias: Optional[Tensor] = None,
                              alibi_slopes: Optional[Tensor] = None) -> Tuple[bool, str]:
    """Whether the kernels take this call (q ``[Sq, B, Hq, D]``, k/v ``[Skv, B, Hkv, D]``), and why not."""
    fake = current("hipkittens_attn_supported")
    if fake.options.arch not in (None, "gfx950"):
        return False, "hipkittens attention is gfx950-only"
    if any(t.dtype is not torch.bfloat16 for t in (q, k, v)):
        return False, f"hipkittens attention is bf16-only, got {q.dtype}"
    if not causal:
        return False, "hipkittens attention implements causal masking only"
    if sink is not None:
        return False, "hipkittens attention does not implement a learned sink"
    if dropout_p != 0.0:
        return False, "hipkittens attention does not implement dropout"
    if bias is not None or alibi_slopes is not None:
        return False, "hipkittens attention does not implement bias / alibi"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return False, "hipkittens attention takes dense 4-D SBHD tensors, not varlen/THD packing"
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        return False, "hipkittens attention needs contiguous [s, b, h, d]; it derives strides from the shape"
    if len(window_size) > 1 and int(window_size[1]) not in (0, -1):
        return False, "hipkittens attention implements a left window only"
    s_q, batch, hq, d = q.shape
    s_kv, batch_k, hkv, d_k = k.shape
    if (batch, d) != (batch_k, d_k) or v.shape != k.shape:
        return False, f"shape mismatch q={tuple(q.shape)} k={tuple(k.shape)}"
    if d not in SUPPORTED_HEAD_DIMS:
        return False, f"hipkittens attention supports head dim {SUPPORTED_HEAD_DIMS}, got {d}"
    if hq % hkv != 0:
        return False, f"Hq={hq} must be a multiple of Hkv={hkv}"
    if s_q > s_kv and _fake_math.HIPKITTENS_FORWARD_SKIPS_ROWS not in fake.options.faults:
        return False, f"hipkittens attention does not support Sq > Skv yet (Sq={s_q}, Skv={s_kv})"
    return True, ""


def _require_supported(q: Tensor, k: Tensor, v: Tensor, causal: bool, window_size: Tuple[int, int]) -> None:
    ok, why = hipkittens_attn_supported(q, k, v, causal=causal, window_size=window_size)
    if not ok:
        raise NotImplementedError(why)


def _pattern(window_size: Tuple[int, int]) -> Pattern:
    left = int(window_size[0])
    return Pattern(left if left >= 0 else -1, 0)  # bottom-right causal, optionally windowed


def _bshd(t: Tensor) -> Tensor:
    return t.transpose(0, 1)


def _zero_reference(q: Tensor, k: Tensor, v: Tensor, window: Pattern, scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    """The forward kernels' own softmax arithmetic on bshd bf16 q/k/v (see the module's docstring):
    ``(out fp32 [B, Sq, Hq, D], lse fp32 [B, Hq, Sq], exact [B, Hq, Sq])``, ``exact`` where no kept weight
    left fp32's normal range and the sums stayed finite (there the online softmax is the same answer)."""
    batch, s_q, hq, _ = q.shape
    s_kv, hkv = k.shape[1], k.shape[2]
    factor = torch.tensor(scale, dtype=torch.float32) * torch.tensor(LOG2E, dtype=torch.float32)
    qs = (q.transpose(1, 2).float() * factor).to(torch.bfloat16).float()  # scaled once, held in bf16
    heads = torch.arange(hq, device=q.device) // (hq // hkv)
    kh, vh = (t.transpose(1, 2).float()[:, heads] for t in (k, v))
    l = qs.new_zeros(batch, hq, s_q)
    o = qs.new_zeros(batch, hq, s_q, v.shape[-1])
    lost = torch.zeros(batch, hq, s_q, dtype=torch.bool, device=q.device)
    q_pos = torch.arange(s_q, device=q.device).view(s_q, 1) + (s_kv - s_q)
    for j0 in range(0, s_kv, _KV_TILE):
        kb, vb = kh[:, :, j0:j0 + _KV_TILE], vh[:, :, j0:j0 + _KV_TILE]
        keep = window.allows(q_pos, torch.arange(j0, j0 + kb.shape[2], device=q.device).view(1, -1))
        p = torch.exp2(torch.matmul(qs, kb.transpose(-1, -2)))
        flushed = p < _FLUSHED
        lost |= (keep & flushed).any(-1)
        p = torch.where(keep & ~flushed, p, torch.zeros_like(p))  # masked entries set to 0, after the exp2
        p = p.to(torch.bfloat16).float()  # the PV operand and the denominator's
        lost |= torch.isinf(p).any(-1)
        l = l + p.sum(-1)
        o = o + torch.matmul(p, vb)
    exact = ~lost & torch.isfinite(l) & (l > 0) & torch.isfinite(o).all(-1)
    return (o / l.unsqueeze(-1)).transpose(1, 2), torch.log(l), exact


def _forward(q: Tensor, k: Tensor, v: Tensor, softmax_scale: Optional[float],
             window_size: Tuple[int, int]) -> Tuple[Tensor, Tensor]:
    """The forward's math on contiguous sbhd q/k/v (checked): ``(out [Sq, B, Hq, D], lse [B, Hq, 1, Sq])``."""
    s_q, batch, hq, d = q.shape
    scale = d ** (-0.5) if softmax_scale is None else softmax_scale
    pattern = _pattern(window_size)
    out_b, lse_b = _fake_math.kernel_forward(_bshd(q), _bshd(k), _bshd(v), window=pattern, scale=scale,
                                             alibi_slopes=None, bias=None, sink=None)
    zero_out, zero_lse, exact = _zero_reference(_bshd(q), _bshd(k), _bshd(v), pattern, scale)
    if not bool(exact.all()):  # the kernels' own answer where their fixed reference overflows or flushes
        lse_b = torch.where(exact, lse_b, zero_lse)
        out_b = torch.where(exact.transpose(1, 2).unsqueeze(-1), out_b, zero_out.to(out_b.dtype))
    out = torch.empty_like(q)
    out.copy_(_bshd(out_b))
    lse_pad = torch.empty((batch, hq, 1, -(-s_q // _TILE) * _TILE), dtype=torch.float32, device=q.device)
    lse = lse_pad[..., :s_q]
    lse.copy_(lse_b.unsqueeze(2))
    skipped = s_q - k.shape[0]
    if skipped > 0:  # only under the fault: the kernel returns before storing these rows
        out[:skipped] = float("nan")
        lse[..., :skipped] = float("nan")
    return out, lse


def hipkittens_attn_forward(q: Tensor, k: Tensor, v: Tensor, softmax_scale: Optional[float] = None,
                            causal: bool = True, window_size: Tuple[int, int] = (-1, -1)) -> Tuple[Tensor, Tensor]:
    """``q/k/v`` contiguous sbhd: ``(out, lse [B, Hq, 1, Sq])``, lse a natural log."""
    record("hipkittens_attn_forward", dict(locals()), "HipKittens")
    _require_supported(q, k, v, causal, window_size)
    return _forward(q, k, v, softmax_scale, window_size)


def hipkittens_attn_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                             softmax_scale: Optional[float] = None, causal: bool = True,
                             window_size: Tuple[int, int] = (-1, -1)) -> Tuple[Tensor, Tensor, Tensor]:
    """sbhd bf16 ``dout/q/out`` ``[Sq, B, Hq, D]``, ``k/v`` ``[Skv, B, Hkv, D]``: ``(dq, dk, dv)``."""
    record("hipkittens_attn_backward", dict(locals()), "HipKittens")
    return _backward(dout, q, k, v, out, lse, softmax_scale, causal, window_size)


def _backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, softmax_scale: Optional[float],
              causal: bool, window_size: Tuple[int, int]) -> Tuple[Tensor, Tensor, Tensor]:
    _require_supported(q, k, v, causal, window_size)
    if dout.dtype is not torch.bfloat16 or out.dtype is not torch.bfloat16:
        raise NotImplementedError("hipkittens attention is bf16-only")
    if dout.shape != q.shape or out.shape != q.shape:
        raise ValueError("hipkittens attention backward: dout/out must have q's shape")
    for name, t in (("dout", dout), ("out", out)):
        if not t.is_contiguous():
            raise ValueError(f"hipkittens attention backward: {name} must be contiguous")
    s_q, batch, hq, d = q.shape
    lse_flat = lse.reshape(batch, hq, 1, -1)
    if lse_flat.shape[-1] != s_q:
        raise ValueError(f"hipkittens attention backward: lse last axis {lse_flat.shape[-1]} != Sq {s_q}")
    scale = d ** (-0.5) if softmax_scale is None else softmax_scale
    g = _fake_math.kernel_backward(_bshd(dout), _bshd(q), _bshd(k), _bshd(v), _bshd(out), lse_flat[:, :, 0],
                                   window=_pattern(window_size), scale=scale, alibi_slopes=None, bias=None, sink=None)
    return tuple(torch.empty_like(t).copy_(_bshd(grad)) for t, grad in zip((q, k, v), g[:3]))  # type: ignore[return-value]


class _FlashAttnHipKittens(torch.autograd.Function):
    """Upstream's ``FlashAttnFunc`` with ``backend=HIPKITTENS`` (flash_attn_interface.py l.102-123, l.225-239 at
    a6a16cd): bshd views of sbhd memory in, these kernels' forward and backward on the sbhd views."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, window_size):  # type: ignore[override]
        q_s, k_s, v_s = (t.permute(1, 0, 2, 3) for t in (q, k, v))
        _require_supported(q_s, k_s, v_s, causal, window_size)
        out_s, lse = _forward(q_s, k_s, v_s, softmax_scale, window_size)
        ctx.save_for_backward(q_s, k_s, v_s, out_s, lse)
        ctx.softmax_scale, ctx.causal, ctx.window_size = softmax_scale, causal, window_size
        lse = lse.squeeze(2)
        ctx.mark_non_differentiable(lse)
        return out_s.permute(1, 0, 2, 3), lse

    @staticmethod
    def backward(ctx, dout, _dlse):  # type: ignore[override]
        q_s, k_s, v_s, out_s, lse = ctx.saved_tensors
        grads = _backward(dout.permute(1, 0, 2, 3).contiguous(), q_s, k_s, v_s, out_s, lse, ctx.softmax_scale,
                          ctx.causal, ctx.window_size)
        return (*(g.permute(1, 0, 2, 3) for g in grads), None, None, None)


def flash_attn(q: Tensor, k: Tensor, v: Tensor, softmax_scale: Optional[float], causal: bool,
               window_size: Tuple[int, int], return_lse: bool) -> Any:
    """The fake ``flash_attn_func`` where its dispatcher picked HipKittens (bshd views of sbhd q/k/v):
    ``out`` or ``(out, lse [B, Hq, Sq])``; not recorded (the entry is)."""
    out, lse = _FlashAttnHipKittens.apply(q, k, v, softmax_scale, causal, tuple(int(w) for w in window_size))
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- the _impl layer
def hipkittens_attn_supported_impl(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tuple[bool, str]:
    """Whether these kernels take this call (sbhd q/k/v), and if not, why."""
    return hipkittens_attn_supported(q, k, v, **kwargs)


def flash_attn_sbhd_hipkittens_forward_impl(q: Tensor, k: Tensor, v: Tensor, softmax_scale: Optional[float] = None,
                                            causal: bool = True, window_size: Tuple[int, int] = (-1, -1),
                                            return_lse: bool = True):
    """SBHD forward: ``(out, lse)``, or ``out`` alone without ``return_lse``."""
    out, lse = hipkittens_attn_forward(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size)
    return (out, lse) if return_lse else out


def flash_attn_sbhd_hipkittens_backward_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                             softmax_scale: Optional[float] = None, causal: bool = True,
                                             window_size: Tuple[int, int] = (-1, -1)) -> Tuple[Tensor, Tensor, Tensor]:
    """SBHD backward: ``(dq, dk, dv)`` in the layouts of q, k and v."""
    return hipkittens_attn_backward(dout, q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal,
                                    window_size=window_size)


LAYER = (hipkittens_attn_supported, hipkittens_attn_forward, hipkittens_attn_backward)
IMPL = (hipkittens_attn_supported_impl, flash_attn_sbhd_hipkittens_forward_impl,
        flash_attn_sbhd_hipkittens_backward_impl)


def _module(name: str, new_module: Callable[[str], types.ModuleType], functions: tuple) -> types.ModuleType:
    mod = new_module(name)
    for fn in functions:
        setattr(mod, fn.__name__, fn)
    mod.__all__ = [fn.__name__ for fn in functions]  # type: ignore[attr-defined]
    return mod


def layer_module(name: str, new_module: Callable[[str], types.ModuleType]) -> types.ModuleType:
    """The fake ``primus_turbo.hipkittens.attention``."""
    mod = _module(name, new_module, LAYER)
    mod.SUPPORTED_HEAD_DIMS = SUPPORTED_HEAD_DIMS  # type: ignore[attr-defined]
    return mod


def impl_module(name: str, new_module: Callable[[str], types.ModuleType]) -> types.ModuleType:
    """The fake ``primus_turbo.pytorch.kernels.attention.attention_hipkittens_impl``."""
    return _module(name, new_module, IMPL)


__all__ = ["IMPL", "LAYER", "LOG2E", "SUPPORTED_HEAD_DIMS", "flash_attn", "flash_attn_sbhd_hipkittens_backward_impl",
           "flash_attn_sbhd_hipkittens_forward_impl", "hipkittens_attn_backward", "hipkittens_attn_forward",
           "hipkittens_attn_supported", "hipkittens_attn_supported_impl", "impl_module", "layer_module"]
