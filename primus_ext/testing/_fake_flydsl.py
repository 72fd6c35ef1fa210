"""The fake's FlyDSL kernel level: ``primus_turbo.pytorch.kernels.attention.attention_flydsl_impl``.

Upstream (``attention_flydsl_impl.py`` at a6a16cd, l.31, l.107, l.189, l.367, l.428) has four
``torch.library`` ops, ``primus_turbo::flash_attn_{sbhd,varlen}_flydsl_{forward,backward}``
(``mutates_args=()``, tagged ``cudagraph_unsafe``), and plain-Python ``*_impl`` wrappers that
assert the kernels' preconditions before calling them.  The fake has both, with the real
names, schemas and signatures, written from that reading:

* the wrappers' asserts (``_check_fwd`` / ``_check_bwd``): causal, bf16 (forward), contiguous
  sbhd (dense), D in {64, 128}, the forward scale 1/sqrt(D) (absolute 1e-6), the right window
  edge in {0, -1}, a sink fp32 with Hq elements; raised explicitly, so ``python -O`` keeps them;
* the ops' layouts: dense ``out`` sbhd, ``lse`` fp32 ``[B*Sq, Hq]`` batch-major and zero-filled,
  ``(0,)`` without ``return_lse``; the dense backward reads ``lse`` as ``[B, Hq, Sq]``; varlen
  ``lse`` is ``[T, Hq]`` both ways; ``dsink`` fp32 ``[Hq]`` with a sink, else ``(0,)``;
* the varlen backward's uniform test is host-only (``B * max_seqlen == total`` for q and k);
  only that path computes ``dsink``: the ragged one returns an empty one, sink or not.

What the ops do *not* check, the dispatcher does (gfx950, a left window < 0 or >= 64, a GQA
group that is a power of two in 8..256, equal documents for varlen).  The fake is never
kinder there: a narrow window's backward gives NaN dQ (`FLYDSL_NARROW_WINDOW_BACKWARD_NAN`,
on an arch-modelled fake always, else when the fault is switched on), and a GQA group the
backward cannot take, or a call on gfx942, raises rather than computing a right answer.

The math is the fake's own (`._fake_math.kernel_forward` / ``kernel_backward``).  Each op call
is recorded in the active fake's log as ``backend="FlyDSL"``.
"""

from __future__ import annotations

import inspect
import math
import types
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from ..attention.pattern import Pattern
from . import _fake_math
from ._fake_dispatch import check_cu_seqlens
from ._fake_kernels import record
from ..backends.dispatch import BUILD_A6A16CD, TurboBuild, flydsl_group_ok

OPS = ("flash_attn_sbhd_flydsl_forward", "flash_attn_sbhd_flydsl_backward", "flash_attn_varlen_flydsl_forward",
       "flash_attn_varlen_flydsl_backward")
_REGISTERED: list[bool] = []
_TAGS = (torch._C.Tag.cudagraph_unsafe,)


def _assert(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


def _check(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], causal: bool, window_size: Any,
           sink: Optional[Tensor], heads: int, head_dim: int, *, sbhd: bool, forward: bool) -> tuple[float, int]:
    """Upstream's ``_check_fwd`` / ``_check_bwd``: ``(backward scale, normalised left window)``."""
    way = "forward" if forward else "backward"
    _assert(bool(causal), f"flydsl flash-attn {way} is bottom-right causal only")
    if forward:
        _assert(q.dtype == torch.bfloat16, "flydsl flash-attn forward is bf16 only")
    if sbhd:
        _assert(q.is_contiguous() and k.is_contiguous() and v.is_contiguous(), "SBHD tensors must be contiguous")
    _assert(head_dim in (64, 128), f"flydsl flash-attn {way} supports D in (64,128), got {head_dim}")
    if forward and scale is not None:
        _assert(abs(scale - 1.0 / math.sqrt(head_dim)) < 1e-6, "flydsl flash-attn forward bakes softmax_scale=1/sqrt(D)")
    left, right = window_size
    _assert(right in (0, -1), "only left-window (W,0) / full (-1,-1) supported")
    if sink is not None:
        _assert(sink.dtype == torch.float32 and sink.numel() == heads, "sink must be fp32 [Hq]")
    return (1.0 / math.sqrt(head_dim) if scale is None else scale), (left if left >= 0 else -1)


def _kernel(fake: Any, q: Tensor, k: Tensor, v: Tensor, heads_dim: int) -> None:
    """What the kernels need and nothing checks: fail where they would compute garbage."""
    if fake.options.arch not in (None, "gfx950"):
        raise RuntimeError(f"FlyDSL kernels are built for gfx950; the fake models {fake.options.arch}")
    hq, hkv = q.shape[heads_dim], k.shape[heads_dim]
    if hkv <= 0 or hq % hkv or v.shape != k.shape or v.shape[-1] != q.shape[-1]:
        raise RuntimeError(f"FlyDSL kernel: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit "
                           "one GQA problem with one head dim (the fake does not model what it would compute)")


def _backward_group(fake: Any, q: Tensor, k: Tensor, heads_dim: int) -> None:
    hq, hkv = q.shape[heads_dim], k.shape[heads_dim]
    if not flydsl_group_ok(hq, hkv, q.shape[-1], fake.options.build):
        # a6a16cd: LD_VEC = 64 // (256 // G) must be >= 2; PT #509: G divides BLOCK_SIZE and Hq*D % 128 == 0
        raise NotImplementedError(f"fake FlyDSL backward: {hq} query heads over {hkv} key/value heads are outside "
                                  f"what the dkdv kernel of build {fake.options.kernels} takes (`_gqa_group_ok`); "
                                  "the fake cannot reproduce what it computes")


def fixed_strides(t: Tensor) -> Tensor:
    """What FlyDSL's varlen kernel reads of a ``[T, H, D]`` tensor: tokens ``H*D`` apart and heads ``D``
    apart from its first element, whatever its own strides (flydsl/attention/flash_attn_fwd.py l.708-746,
    flydsl/utils/attn_helper.py l.465-466, 695-705, 1159-1171 at a6a16cd); k and v share Hkv*D.  A
    non-contiguous view (megatron-core's split value) is thus read at the wrong addresses, as upstream
    reads it; one whose reads run past its storage raises, where the kernel would read out of bounds."""
    if t.is_contiguous() or t.numel() == 0:
        return t
    _, heads, dim = t.shape
    try:
        return t.as_strided(t.shape, (heads * dim, dim, 1), t.storage_offset())
    except RuntimeError:
        raise RuntimeError(f"fake FlyDSL varlen kernel: a non-contiguous {tuple(t.shape)} tensor (strides "
                           f"{t.stride()}) read at fixed strides runs past its storage: the kernel would read out "
                           "of bounds") from None


def _narrow(fake: Any, window_left: int) -> bool:
    armed = fake.options.arch is not None or _fake_math.FLYDSL_NARROW_WINDOW_BACKWARD_NAN in fake.options.faults
    return armed and 0 <= window_left < 64


def _window(window_left: int) -> Pattern:
    return Pattern(window_left if window_left >= 0 else -1, 0)  # bottom-right causal, always


def _forward(q: Tensor, k: Tensor, v: Tensor, window_left: int, sink: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """bshd math with the baked scale: ``(out [B, Sq, Hq, D], lse [B, Hq, Sq])``."""
    return _fake_math.kernel_forward(q, k, v, window=_window(window_left), scale=1.0 / math.sqrt(q.shape[-1]),
                                     alibi_slopes=None, bias=None, sink=sink)


def _backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
              window_left: int, sink: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """bshd math from ``lse [B, Hq, Sq]``: ``(dq, dk, dv, dsink or None)``."""
    g = _fake_math.kernel_backward(dout, q, k, v, out, lse, window=_window(window_left), scale=scale,
                                   alibi_slopes=None, bias=None, sink=sink)
    return g[0], g[1], g[2], g[3]


def _sbhd(t: Tensor) -> Tensor:
    return t.transpose(0, 1)


def _bounds(name: str, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, q: Tensor, k: Tensor) -> list:
    bq = check_cu_seqlens(name, "q", cu_q, max_q, q.shape[0], q.device)
    bk = check_cu_seqlens(name, "k", cu_k, max_k, k.shape[0], q.device)
    _assert(len(bq) == len(bk), "q/k batch mismatch")
    return list(zip(zip(bq, bq[1:]), zip(bk, bk[1:])))


def register() -> None:
    """Register the four ops once per process (CPU too: the fake runs there)."""
    if _REGISTERED:
        return
    _REGISTERED.append(True)

    @torch.library.custom_op("primus_turbo::flash_attn_sbhd_flydsl_forward", mutates_args=(), tags=_TAGS)
    def sbhd_forward(q: Tensor, k: Tensor, v: Tensor, window_left: int, return_lse: bool,
                     sink: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        fake = record("flash_attn_sbhd_flydsl_forward", dict(locals()), "FlyDSL")
        _kernel(fake, q, k, v, 2)
        s_q, batch, hq, _ = q.shape
        out_b, lse_b = _forward(_sbhd(q), _sbhd(k), _sbhd(v), window_left, sink)
        out = torch.empty_like(q)
        out.copy_(_sbhd(out_b))
        lse = torch.zeros((batch * s_q, hq) if return_lse else (0,), dtype=torch.float32, device=q.device)
        if return_lse:  # batch-major [B*Sq, Hq], whatever the q/k/v layout
            lse.view(batch, s_q, hq).copy_(lse_b.transpose(1, 2))
        return out, lse

    @sbhd_forward.register_fake
    def _(q, k, v, window_left, return_lse, sink):
        s_q, batch, hq, _ = q.shape
        return torch.empty_like(q), q.new_empty((batch * s_q, hq) if return_lse else (0,), dtype=torch.float32)

    @torch.library.custom_op("primus_turbo::flash_attn_sbhd_flydsl_backward", mutates_args=(), tags=_TAGS)
    def sbhd_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, softmax_scale: float,
                      window_left: int, sink: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        fake = record("flash_attn_sbhd_flydsl_backward", dict(locals()), "FlyDSL")
        _kernel(fake, q, k, v, 2)
        _backward_group(fake, q, k, 2)
        s_q, batch, hq, _ = q.shape
        if tuple(lse.shape) != (batch, hq, s_q) or out.shape != q.shape or dout.shape != q.shape:
            raise RuntimeError(f"FlyDSL backward: lse must be [B, Hq, Sq] = {(batch, hq, s_q)} (got "
                               f"{tuple(lse.shape)}), out and dout q's shape (the kernel would read garbage)")
        dq, dk, dv, dsink = _backward(_sbhd(dout), _sbhd(q), _sbhd(k), _sbhd(v), _sbhd(out), lse, softmax_scale,
                                      window_left, sink)
        grads = [torch.empty_like(t).copy_(_sbhd(g)) for t, g in ((q, dq), (k, dk), (v, dv))]
        if _narrow(fake, window_left):
            grads[0].fill_(float("nan"))
        return grads[0], grads[1], grads[2], dsink if sink is not None else lse.new_empty((0,))

    @sbhd_backward.register_fake
    def _(dout, q, k, v, out, lse, softmax_scale, window_left, sink):
        dsink = (q.shape[2],) if sink is not None else (0,)
        return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
                lse.new_empty(dsink, dtype=torch.float32))

    @torch.library.custom_op("primus_turbo::flash_attn_varlen_flydsl_forward", mutates_args=(), tags=_TAGS)
    def varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                       max_seqlen_q: int, max_seqlen_k: int, window_left: int, return_lse: bool,
                       sink: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        fake = record("flash_attn_varlen_flydsl_forward", dict(locals()), "FlyDSL")
        _kernel(fake, q, k, v, 1)
        q, k, v = fixed_strides(q), fixed_strides(k), fixed_strides(v)
        out = torch.empty_like(q)
        lse = torch.zeros(tuple(q.shape[:2]) if return_lse else (0,), dtype=torch.float32, device=q.device)
        for (q0, q1), (k0, k1) in _bounds("flash_attn_varlen_flydsl_forward", cu_seqlens_q, cu_seqlens_k,
                                          max_seqlen_q, max_seqlen_k, q, k):
            o, s = _forward(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], window_left, sink)
            out[q0:q1] = o[0]
            if return_lse:
                lse[q0:q1] = s[0].t()
        return out, lse

    @varlen_forward.register_fake
    def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_left, return_lse, sink):
        return torch.empty_like(q), q.new_empty(tuple(q.shape[:2]) if return_lse else (0,), dtype=torch.float32)

    @torch.library.custom_op("primus_turbo::flash_attn_varlen_flydsl_backward", mutates_args=(), tags=_TAGS)
    def varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                        softmax_scale: float, window_left: int,
                        sink: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        fake = record("flash_attn_varlen_flydsl_backward", dict(locals()), "FlyDSL")
        _kernel(fake, q, k, v, 1)
        _backward_group(fake, q, k, 1)
        q, k, v = fixed_strides(q), fixed_strides(k), fixed_strides(v)
        if tuple(lse.shape) != tuple(q.shape[:2]):
            raise RuntimeError(f"FlyDSL varlen backward: lse must be [T, Hq] = {tuple(q.shape[:2])}, got "
                               f"{tuple(lse.shape)} (the kernel would read garbage)")
        documents = cu_seqlens_q.numel() - 1
        # Host-only, as upstream's `_uniform_shape`: equal documents of exactly max_seqlen.
        uniform = documents * max_seqlen_q == q.shape[0] and documents * max_seqlen_k == k.shape[0]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dsink = torch.zeros(q.shape[1], dtype=torch.float32, device=q.device) if sink is not None else None
        for (q0, q1), (k0, k1) in _bounds("flash_attn_varlen_flydsl_backward", cu_seqlens_q, cu_seqlens_k,
                                          max_seqlen_q, max_seqlen_k, q, k):
            g = _backward(dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], out[None, q0:q1],
                          lse[q0:q1].t()[None], softmax_scale, window_left, sink)
            dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
            if dsink is not None and g[3] is not None:
                dsink += g[3]
        if _narrow(fake, window_left):
            dq.fill_(float("nan"))
        # The ragged path runs without the sink: dQ/dK/dV are right (the lse holds it), dsink empty.
        return dq, dk, dv, dsink if uniform and dsink is not None else lse.new_empty((0,))

    @varlen_backward.register_fake
    def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
          window_left, sink):
        dsink = (q.shape[1],) if sink is not None else (0,)
        return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
                lse.new_empty(dsink, dtype=torch.float32))


# ----------------------------------------------------------------------------- the _impl wrappers
def flash_attn_sbhd_flydsl_forward_impl(q, k, v, softmax_scale=None, causal=True, window_size=(-1, -1),
                                        return_lse=False, sink=None):
    """SBHD forward: ``out`` (and ``lse [B*Sq, Hq]`` fp32 with ``return_lse``)."""
    _, window_left = _check(q, k, v, softmax_scale, causal, window_size, sink, q.shape[2], q.shape[3], sbhd=True,
                            forward=True)
    out, lse = torch.ops.primus_turbo.flash_attn_sbhd_flydsl_forward(q, k, v, window_left, bool(return_lse), sink)
    return (out, lse) if return_lse else out


def flash_attn_sbhd_flydsl_backward_impl(dout, q, k, v, out, lse, softmax_scale=None, causal=True,
                                         window_size=(-1, -1), sink=None):
    """SBHD backward from ``lse [B, Hq, Sq]``: ``(dq, dk, dv)``, plus ``dsink`` with a sink."""
    scale, window_left = _check(q, k, v, softmax_scale, causal, window_size, sink, q.shape[2], q.shape[3], sbhd=True,
                                forward=False)
    dq, dk, dv, dsink = torch.ops.primus_turbo.flash_attn_sbhd_flydsl_backward(
        dout.contiguous(), q, k, v, out, lse, scale, window_left, sink)
    return (dq, dk, dv, dsink) if sink is not None else (dq, dk, dv)


def flash_attn_varlen_flydsl_forward_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          softmax_scale=None, causal=True, window_size=(-1, -1), return_lse=False,
                                          sink=None):
    """THD forward: ``out`` (and ``lse [T, Hq]`` fp32 with ``return_lse``)."""
    _assert(cu_seqlens_q.numel() == cu_seqlens_k.numel(), "q/k batch mismatch")
    _, window_left = _check(q, k, v, softmax_scale, causal, window_size, sink, q.shape[1], q.shape[2], sbhd=False,
                            forward=True)
    out, lse = torch.ops.primus_turbo.flash_attn_varlen_flydsl_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), window_left, bool(return_lse), sink)
    return (out, lse) if return_lse else out


def flash_attn_varlen_flydsl_backward_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                           max_seqlen_k, softmax_scale=None, causal=True, window_size=(-1, -1),
                                           sink=None):
    """THD backward from ``lse [T, Hq]``: ``(dq, dk, dv)``, plus ``dsink`` where one came back
    (the uniform path with a sink)."""
    scale, window_left = _check(q, k, v, softmax_scale, causal, window_size, sink, q.shape[1], q.shape[2],
                                sbhd=False, forward=False)
    dq, dk, dv, dsink = torch.ops.primus_turbo.flash_attn_varlen_flydsl_backward(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), scale,
        window_left, sink)
    return (dq, dk, dv, dsink) if dsink.numel() else (dq, dk, dv)


def _deterministic_backward(name: str, wrapped: Callable[..., Any]) -> Callable[..., Any]:
    """PT #480's backward wrapper: ``wrapped``'s arguments and ``deterministic=False`` (True: a reproducible
    split-K dQ; False: an atomic bf16 dQ).  The fake's math is reproducible either way, so the flag is
    recorded (entry ``<name>``, args ``{"deterministic": flag}``) for tests to read what a caller asked."""

    def backward(*args: Any, deterministic: bool = False, **kwargs: Any) -> Any:
        record(name, {"deterministic": bool(deterministic)}, "FlyDSL")
        return wrapped(*args, **kwargs)

    params = list(inspect.signature(wrapped).parameters.values())
    backward.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        params + [inspect.Parameter("deterministic", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=False)])
    backward.__name__ = backward.__qualname__ = name
    backward.__doc__ = wrapped.__doc__
    return backward


WRAPPERS = (flash_attn_sbhd_flydsl_forward_impl, flash_attn_sbhd_flydsl_backward_impl,
            flash_attn_varlen_flydsl_forward_impl, flash_attn_varlen_flydsl_backward_impl)


def module(name: str, new_module: Callable[[str], types.ModuleType], build: TurboBuild = BUILD_A6A16CD
           ) -> types.ModuleType:
    """The fake ``attention_flydsl_impl`` module: the four wrappers under their upstream names, the
    backward ones with PT #480's ``deterministic`` on a build that has it."""
    mod = new_module(name)
    for fn in WRAPPERS:
        if build.flydsl_deterministic and fn.__name__.endswith("_backward_impl"):
            fn = _deterministic_backward(fn.__name__, fn)
        setattr(mod, fn.__name__, fn)
    mod.__all__ = [fn.__name__ for fn in WRAPPERS]  # type: ignore[attr-defined]
    return mod


def gate_module(name: str, new_module: Callable[[str], types.ModuleType], build: TurboBuild) -> types.ModuleType:
    """The fake ``attention_impl``: the dispatcher's ``_gqa_group_ok`` with its build's signature, the
    head dim a third argument since PT #509 (`primus_ext.backends.turbo_build` reads it)."""
    mod = new_module(name)
    if build.wide_gqa:
        def _gqa_group_ok(num_heads_q: int, num_heads_kv: int, head_dim: int) -> bool:
            return flydsl_group_ok(num_heads_q, num_heads_kv, head_dim, build)
    else:
        def _gqa_group_ok(num_heads_q: int, num_heads_kv: int) -> bool:  # type: ignore[misc]
            return flydsl_group_ok(num_heads_q, num_heads_kv, 128, build)
    mod._gqa_group_ok = _gqa_group_ok  # type: ignore[attr-defined]
    return mod


__all__ = ["OPS", "WRAPPERS", "flash_attn_sbhd_flydsl_backward_impl", "flash_attn_sbhd_flydsl_forward_impl",
           "flash_attn_varlen_flydsl_backward_impl", "flash_attn_varlen_flydsl_forward_impl", "fixed_strides",
           "gate_module", "module", "register"]
