"""The fake's kernel-level AITER ops: ``torch.ops.primus_turbo.attention_aiter_*_impl``.

Real Primus-Turbo registers these ``torch.library`` ops under the ``primus_turbo``
namespace and builds ``flash_attn_func`` / ``flash_attn_varlen_func`` on them (Primus-Turbo
``primus_turbo/pytorch/kernels/attention/attention_aiter_impl.py`` l.336-799 at a6a16cd).  The fake
registers the same four ops with the same argument names, on the
first `fake_primus_turbo` block of a process, and they behave like the real ones:

* the forward returns ``(out, softmax_lse, S_dmask, rng_state)``; ``out`` is allocated in
  the layout ``qkv_format`` names, ``softmax_lse`` is fp32 ``[B, Hq, Sq]`` (``[Hq, T]``
  varlen);
* the backward returns None and writes ``dq``/``dk``/``dv`` in place (declared
  mutations) and ``dsink``/``dbias`` in place **without declaring them**, as the real
  op does, so only a caller that owns those buffers is safe;
* head dims must already be padded to a multiple of 8 (the public entries pad first);
* the dense ops check no dtype (upstream's ``can_handle`` does not): fp32 / fp64 reach aiter, whose
  CK kernels raise ``RuntimeError`` (`_dense_dtype`), on any arch;
* with an arch set, the AITER rows of the dispatch model apply: what AITER does not
  take or refuses raises, and its known silent defect (the sink backward ignoring a
  window's right bound) is reproduced.

Each call is recorded in the active fake's call log (``backend="AITER"``).  Outside a
``with fake_primus_turbo()`` block the ops raise.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from ..attention.pattern import pattern_from_flash_args
from ..backends.dispatch import AITER_DENSE, AITER_VARLEN, DENSE, VARLEN, CallFeatures, default_scale, route_on
from . import _fake_math
from ._fake_dispatch import check_cu_seqlens, dtype_name, faults_of

NAMES = ("attention_aiter_forward_impl", "attention_aiter_backward_impl", "attention_aiter_varlen_forward_impl",
         "attention_aiter_varlen_backward_impl")

_ACTIVE: list[Any] = []  # the FakeTurbo of the innermost `with` block
_REGISTERED: list[bool] = []


def activate(fake: Any) -> None:
    _register()
    _ACTIVE.append(fake)


def deactivate(fake: Any) -> None:
    _ACTIVE.remove(fake)


def _fake(name: str, args: dict[str, Any]) -> Any:
    if not _ACTIVE:
        raise RuntimeError(f"primus_turbo::{name}: the fake Primus-Turbo is not installed")
    fake = _ACTIVE[-1]
    fake.record(name, args, "AITER")
    return fake


def _aiter(fake: Any, entry: str, q: Tensor, k: Tensor, v: Tensor, causal: bool, window: tuple[int, int],
           sink: Optional[Tensor], bias: Optional[Tensor], alibi: Optional[Tensor], deterministic: bool,
           scale: float, backward: bool = False) -> frozenset[str]:
    """AITER's own checks on the fake's arch; the faults of its known defects."""
    if entry == DENSE and q.dtype not in (torch.float16, torch.bfloat16):
        _dense_dtype(q, v, sink, backward=backward)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[-1] % 8:
            raise RuntimeError(f"AITER kernel: {name} head dim {t.shape[-1]} is not padded to a multiple of 8")
    arch = fake.options.arch
    if arch is None:
        return frozenset()
    backend = AITER_DENSE if entry == DENSE else AITER_VARLEN
    features = CallFeatures(arch=arch, entry=entry, dtype=dtype_name(q), head_dim=int(q.shape[-1]),
                            head_dim_v=int(v.shape[-1]), heads=int(q.shape[-2]), kv_heads=int(k.shape[-2]),
                            causal=causal, window=window, sink=sink is not None, bias=bias is not None,
                            alibi=alibi is not None, deterministic=deterministic,
                            default_scale=default_scale(scale, int(q.shape[-1])),
                            # gfx942's v3 backward mishandles the strided bshd view (a defect row)
                            contiguous_bshd=entry != DENSE or all(t.is_contiguous() for t in (q, k, v)))
    found = route_on(features, backend)
    if found is None:
        why = "; ".join(c.text for c in backend.takes if not c.ok(features))
        raise ValueError(f"AttnFwdAiterBackend cannot handle the given inputs: {why} (fake Primus-Turbo on {arch})")
    return faults_of(found)


def _dense_dtype(q: Tensor, v: Tensor, sink: Optional[Tensor], *, backward: bool) -> None:
    """The dense ops with a dtype other than fp16/bf16.  Their ``can_handle`` checks only a sink's head dims and
    qkv_format, not the dtype (attention_aiter_impl.py l.84-111, l.202-236 at a6a16cd), so the call reaches aiter:
    without a sink its CK ``mha_fwd`` / ``mha_bwd`` (or asm ``fmha_v3_bwd``) refuse it with ``TORCH_CHECK``, a
    RuntimeError (aiter e4048607: aiter/ops/mha.py l.2097, l.2421-2461; csrc/py_itfs_ck/mha_fwd_kernels.cu l.206-207,
    mha_bwd_kernels.cu l.43-44, py_itfs_cu/asm_mha_bwd.cu l.38-39); with one, aiter's Triton kernels, which the
    fake cannot speak for.  The dispatcher's own gate does check the dtype (attention_impl.py l.107-110): that
    ``No compatible backend`` is `flash_attn_func`'s, not these ops'."""
    d_qk, d_v = int(q.shape[-1]), int(v.shape[-1])
    if sink is not None and (d_qk != d_v or d_qk <= 0 or d_qk & (d_qk - 1)):
        raise ValueError(f"{'AttnBwdAiterBackend' if backward else 'AttnFwdAiterBackend'} cannot handle the given "
                         f"inputs: a sink needs equal, power-of-two head dims, got {d_qk} and {d_v} (fake Primus-Turbo)")
    if sink is not None:
        raise RuntimeError(f"fake Primus-Turbo: with a sink the dense AITER op runs aiter's Triton kernels, and the "
                           f"fake cannot say what they do with {q.dtype} inputs")
    if backward:
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type (aiter mha_bwd, fake Primus-Turbo)")
    raise RuntimeError("FlashAttention only support fp16, bf16 and fp8_e4m3 data type (aiter mha_fwd, "
                       "fake Primus-Turbo)")


def _rng_state(q: Tensor, sink: Optional[Tensor]) -> Tensor:
    """The forward's fourth output: with a sink the Triton forward's ``[philox_seed, philox_offset]``
    on the CPU (attention_aiter_impl.py l.195), else CK's int64 ``[2]`` on the device."""
    if sink is not None:
        return torch.tensor([0, 0], dtype=torch.int64, device="cpu")
    return torch.zeros(2, dtype=torch.int64, device=q.device)


def _described(t: Any) -> str:
    return f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, Tensor) else repr(t)


def _alloc_like_format(shape: tuple[int, ...], fmt: str, like: Tensor) -> Tensor:
    """An empty bshd-shaped tensor stored as ``fmt`` says, as the real op allocates ``out``."""
    b, s, h, d = shape
    if fmt not in ("bshd", "sbhd", "bhsd"):
        raise ValueError(f"AITER kernel: unknown qkv_format {fmt!r}")
    if fmt == "sbhd":
        return like.new_empty(s, b, h, d).permute(1, 0, 2, 3)
    if fmt == "bhsd":
        return like.new_empty(b, h, s, d).permute(0, 2, 1, 3)
    return like.new_empty(b, s, h, d)


def _register() -> None:
    if _REGISTERED:
        return
    _REGISTERED.append(True)

    @torch.library.custom_op("primus_turbo::attention_aiter_forward_impl", mutates_args=())
    def forward_impl(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, softmax_scale: float, causal: bool,
                     window_size_left: int, window_size_right: int, bias: Optional[Tensor],
                     alibi_slopes: Optional[Tensor], return_lse: bool, return_softmax: bool,
                     max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                     sink: Optional[Tensor] = None,
                     qkv_format: Optional[str] = "bshd") -> tuple[Tensor, Tensor, Tensor, Tensor]:
        fake = _fake("attention_aiter_forward_impl", dict(locals()))
        if dropout_p:
            raise NotImplementedError("fake attention_aiter_forward_impl: dropout is not modelled")
        window = (window_size_left, window_size_right)
        faults = _aiter(fake, DENSE, q, k, v, causal, window, sink, bias, alibi_slopes, False, softmax_scale)
        stored = _alloc_like_format((*q.shape[:3], v.shape[3]), qkv_format or "bshd", q)
        out, lse = _fake_math.kernel_forward(
            q, k, v, window=pattern_from_flash_args(causal, window),
            scale=softmax_scale, alibi_slopes=alibi_slopes, bias=bias, sink=sink, faults=faults)
        stored.copy_(out)
        return stored, lse, q.new_empty(0), _rng_state(q, sink)

    @torch.library.custom_op("primus_turbo::attention_aiter_backward_impl", mutates_args=("dq", "dk", "dv"))
    def backward_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
                      dq: Tensor, dk: Tensor, dv: Tensor, dropout_p: float, softmax_scale: float, causal: bool,
                      window_size_left: int, window_size_right: int, bias: Optional[Tensor],
                      alibi_slopes: Optional[Tensor], deterministic: bool, rng_state: Optional[Tensor],
                      is_v3_atomic_fp32: bool, how_v3_bf16_cvt: int, dbias: Optional[Tensor] = None,
                      dsink: Optional[Tensor] = None, sink: Optional[Tensor] = None,
                      qkv_format: Optional[str] = "bshd") -> None:
        fake = _fake("attention_aiter_backward_impl", dict(locals()))
        if sink is not None and not (isinstance(rng_state, Tensor) and rng_state.device.type == "cpu"
                                     and rng_state.dtype == torch.int64 and tuple(rng_state.shape) == (2,)):
            # The sink path's Triton backward (attention_aiter_impl.py l.290-295 at a6a16cd).
            raise AssertionError("Triton backward requires rng_state to be a CPU int64 tensor of shape [2] "
                                 f"(got {_described(rng_state)}; fake attention_aiter_backward_impl)")
        window = (window_size_left, window_size_right)
        faults = _aiter(fake, DENSE, q, k, v, causal, window, sink, bias, alibi_slopes, deterministic, softmax_scale,
                        backward=True)
        g = _fake_math.kernel_backward(dout, q, k, v, out, softmax_lse, window=pattern_from_flash_args(causal, window),
                                       scale=softmax_scale, alibi_slopes=alibi_slopes, bias=bias, sink=sink,
                                       faults=faults)
        dq.copy_(g[0])
        dk.copy_(g[1])
        dv.copy_(g[2])
        if dsink is not None and g[3] is not None:
            dsink.copy_(g[3])  # written in place, not declared: as the real op
        if dbias is not None and g[4] is not None:
            dbias.copy_(g[4])

    @torch.library.custom_op("primus_turbo::attention_aiter_varlen_forward_impl", mutates_args=())
    def varlen_forward_impl(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                            max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float,
                            causal: bool, window_size_left: int, window_size_right: int, bias: Optional[Tensor],
                            alibi_slopes: Optional[Tensor], return_lse: bool,
                            return_softmax: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        fake = _fake("attention_aiter_varlen_forward_impl", dict(locals()))
        if dropout_p or bias is not None:
            raise NotImplementedError("fake attention_aiter_varlen_forward_impl: dropout and bias are not modelled")
        window = (window_size_left, window_size_right)
        faults = _aiter(fake, VARLEN, q, k, v, causal, window, None, None, alibi_slopes, False, softmax_scale)
        outs, lses = [], []
        for (q0, q1), (k0, k1) in _documents(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k):
            out, lse = _fake_math.kernel_forward(
                q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], window=pattern_from_flash_args(causal, window),
                scale=softmax_scale, alibi_slopes=alibi_slopes, bias=None, sink=None, faults=faults)
            outs.append(out[0])
            lses.append(lse[0])
        out = torch.cat(outs) if outs else q.new_empty(0, q.shape[1], v.shape[2])
        lse = torch.cat(lses, dim=1) if lses else q.new_empty(q.shape[1], 0, dtype=torch.float32)
        return out, lse, q.new_empty(0), _rng_state(q, None)

    @torch.library.custom_op("primus_turbo::attention_aiter_varlen_backward_impl", mutates_args=("dq", "dk", "dv"))
    def varlen_backward_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
                             dq: Tensor, dk: Tensor, dv: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                             max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float,
                             causal: bool, window_size_left: int, window_size_right: int,
                             alibi_slopes: Optional[Tensor], deterministic: bool, rng_state: Optional[Tensor],
                             is_v3_atomic_fp32: bool, how_v3_bf16_cvt: int) -> None:
        fake = _fake("attention_aiter_varlen_backward_impl", dict(locals()))
        window = (window_size_left, window_size_right)
        faults = _aiter(fake, VARLEN, q, k, v, causal, window, None, None, alibi_slopes, deterministic, softmax_scale)
        dk.zero_()
        dv.zero_()
        for (q0, q1), (k0, k1) in _documents(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k):
            g = _fake_math.kernel_backward(
                dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], out[None, q0:q1],
                softmax_lse[None, :, q0:q1], window=pattern_from_flash_args(causal, window), scale=softmax_scale,
                alibi_slopes=alibi_slopes, bias=None, sink=None, faults=faults)
            dq[q0:q1] = g[0][0]
            dk[k0:k1] = g[1][0]
            dv[k0:k1] = g[2][0]


def _documents(cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, q: Tensor,
               k: Tensor) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Host boundaries of each document pair, checked as the varlen entries check them."""
    name = "attention_aiter_varlen_*_impl"
    bq = check_cu_seqlens(name, "q", cu_q, max_q, q.shape[0], q.device)
    bk = check_cu_seqlens(name, "k", cu_k, max_k, k.shape[0], q.device)
    if len(bq) != len(bk):
        raise ValueError(f"{name}: cu_seqlens_q and cu_seqlens_k describe different batch sizes")
    return list(zip(zip(bq, bq[1:]), zip(bk, bk[1:])))



def current(name: str) -> Any:
    """The fake of the innermost ``with fake_primus_turbo()`` block (``name`` for the error)."""
    if not _ACTIVE:
        raise RuntimeError(f"primus_turbo {name}: the fake Primus-Turbo is not installed")
    return _ACTIVE[-1]


def record(name: str, args: dict[str, Any], backend: str) -> Any:
    """The active fake, with this kernel-level call recorded in its log as ``backend``'s."""
    fake = current(name)
    fake.record(name, args, backend)
    return fake

__all__ = ["NAMES", "activate", "current", "deactivate", "record"]
