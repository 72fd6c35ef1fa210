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
from ._fake_gfx950 import current, record

SUPPORTED_HEAD_DIMS = (64, 128)
_TILE = 128
"""A stand-in for the kernels' Q tile: upstream pads lse to it and returns a view."""


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


def hipkittens_attn_forward(q: Tensor, k: Tensor, v: Tensor, softmax_scale: Optional[float] = None,
                            causal: bool = True, window_size: Tuple[int, int] = (-1, -1)) -> Tuple[Tensor, Tensor]:
    """``q/k/v`` contiguous sbhd: ``(out, lse [B, Hq, 1, Sq])``, lse a natural log."""
    record("hipkittens_attn_forward", dict(locals()), "HipKittens")
    _require_supported(q, k, v, causal, window_size)
    s_q, batch, hq, d = q.shape
    scale = d ** (-0.5) if softmax_scale is None else softmax_scale
    out_b, lse_b = _fake_math.kernel_forward(_bshd(q), _bshd(k), _bshd(v), window=_pattern(window_size), scale=scale,
                                             alibi_slopes=None, bias=None, sink=None)
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


def hipkittens_attn_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                             softmax_scale: Optional[float] = None, causal: bool = True,
                             window_size: Tuple[int, int] = (-1, -1)) -> Tuple[Tensor, Tensor, Tensor]:
    """sbhd bf16 ``dout/q/out`` ``[Sq, B, Hq, D]``, ``k/v`` ``[Skv, B, Hkv, D]``: ``(dq, dk, dv)``."""
    record("hipkittens_attn_backward", dict(locals()), "HipKittens")
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


__all__ = ["IMPL", "LAYER", "SUPPORTED_HEAD_DIMS", "flash_attn_sbhd_hipkittens_backward_impl",
           "flash_attn_sbhd_hipkittens_forward_impl", "hipkittens_attn_backward", "hipkittens_attn_forward",
           "hipkittens_attn_supported", "hipkittens_attn_supported_impl", "impl_module", "layer_module"]
