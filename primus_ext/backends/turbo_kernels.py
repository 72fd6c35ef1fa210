"""Primus-Turbo's kernel-level ops, bound so a compiled backward does not re-run the forward.

``flash_attn_func`` / ``flash_attn_varlen_func`` are autograd Functions over kernel-level
functions (``flash_attn_interface.py`` at a6a16cd).  A compiled graph cannot carry an autograd Function's context
from primus_ext's forward op to its backward op, so for a call whose kernel backend is known
the ops call that backend's kernel-level pair themselves: the forward returns ``(out, lse,
rng_state)``, the backward hands them back.  The eager path keeps the public entries.

`kernel_pair` binds a pair only where the dispatch model routes the call to that backend on
the plan's arch, so compiled and eager steps run the same kernels:

* AITER: its four ``torch.ops.primus_turbo.attention_aiter_*_impl`` ops (`AiterPair`);
* FlyDSL and HipKittens (gfx950): their ``_impl`` wrappers, behind the dispatcher's own gates
  (`turbo_pairs_gfx950`).

Everything is discovered by argument names, never by version (`discover_kernels`); what is
missing is not bound, and a compiled backward then recomputes the forward through the public
entry.  So does a call whose backend eager picks from the data or by timing: a varlen call
FlyDSL would take if its documents were equal, unless the metadata proves they are
(`uniform_documents`); any call autotune may give to more than one backend.

AITER's backward op writes ``dsink`` and ``dbias`` in place without declaring it.  They are
allocated here, inside primus_ext's own opaque backward op, and read once the kernel
returns, so no tensor the graph can see is written behind its back.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .call_route import CallRoutes, call_features
from .dispatch import BUILD_A6A16CD, DEFAULT_ORDER, DENSE, FLYDSL, VARLEN, route, route_on
from .layout import infer_qkv_format
from .base import CallArgs, KernelPair
from .turbo_pairs_gfx950 import (FlydslPair, HipkittensPair, discover_flydsl, discover_hipkittens, flydsl_takes,
                                 hipkittens_takes, uniform_documents)

FORWARD, BACKWARD = "attention_aiter_forward_impl", "attention_aiter_backward_impl"
VARLEN_FORWARD, VARLEN_BACKWARD = "attention_aiter_varlen_forward_impl", "attention_aiter_varlen_backward_impl"

_ARGS = {
    FORWARD: ("q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size_left", "window_size_right",
              "bias", "alibi_slopes", "return_lse", "return_softmax", "max_seqlen_q", "max_seqlen_k", "sink",
              "qkv_format"),
    BACKWARD: ("dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "dropout_p", "softmax_scale", "causal",
               "window_size_left", "window_size_right", "bias", "alibi_slopes", "deterministic", "rng_state",
               "is_v3_atomic_fp32", "how_v3_bf16_cvt", "dbias", "dsink", "sink", "qkv_format"),
    VARLEN_FORWARD: ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p",
                     "softmax_scale", "causal", "window_size_left", "window_size_right", "bias", "alibi_slopes",
                     "return_lse", "return_softmax"),
    VARLEN_BACKWARD: ("dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "cu_seqlens_q", "cu_seqlens_k",
                      "max_seqlen_q", "max_seqlen_k", "dropout_p", "softmax_scale", "causal", "window_size_left",
                      "window_size_right", "alibi_slopes", "deterministic", "rng_state", "is_v3_atomic_fp32",
                      "how_v3_bf16_cvt"),
}
"""The argument names each op must have (Primus-Turbo ``primus_turbo/pytorch/kernels/attention/attention_aiter_impl.py``
l.336-354, l.420-450, l.695-715, l.770-799 at a6a16cd); passed by keyword."""

IS_V3_ATOMIC_FP32, HOW_V3_BF16_CVT = True, 1
"""What ``flash_attn_func`` passes the AITER backward by default (fp32 atomics, bf16 conversion
mode 1); see `aiter_backward_flags` for what it reads instead."""

ATOMIC_FP32_ENV = "PRIMUS_TURBO_ATTN_V3_ATOMIC_FP32"


def aiter_backward_flags(arch: Optional[str]) -> tuple[bool, int]:
    """``(is_v3_atomic_fp32, how_v3_bf16_cvt)`` as ``flash_attn_func`` computes them: the former from
    ``PRIMUS_TURBO_ATTN_V3_ATOMIC_FP32`` ("0" / "1", anything else or unset: fp32), the latter 0
    at compute capability 9.5 (gfx950), else 1 (flash_attn_interface.py, attention_utils.py l.18-20)."""
    value = os.environ.get(ATOMIC_FP32_ENV, "1")
    return (value == "1" if value in ("0", "1") else IS_V3_ATOMIC_FP32), 0 if arch == "gfx950" else HOW_V3_BF16_CVT


def discover() -> Optional[dict[str, Any]]:
    """The four ops by name, or None unless every one exists with the arguments bound here."""
    found = {}
    for name, wanted in _ARGS.items():
        try:
            op = getattr(torch.ops.primus_turbo, name)
            names = {a.name for a in op.default._schema.arguments}
        except (AttributeError, RuntimeError):
            return None
        if not set(wanted) <= names:
            return None
        found[name] = op
    return found


def _pad8(t: Tensor) -> Tensor:
    """Head dim padded to a multiple of 8, as the public entries pad before the kernel."""
    extra = -t.shape[-1] % 8
    return F.pad(t, [0, extra]) if extra else t


class AiterPair:
    """AITER's kernel-level forward and backward for one call (`primus_ext.call.ops.KernelPair`).

    ``causal`` / ``window`` are the arguments the public entry would get for this call; ``arch``
    the plan's (the backward's bf16 conversion mode depends on it, as in ``flash_attn_func``).
    """

    def __init__(self, ops: dict[str, Any], causal: bool, window: tuple[int, int],
                 arch: Optional[str] = None) -> None:
        self.ops, self.causal, self.window, self.arch = ops, causal, window, arch

    def _scale(self, a: CallArgs) -> float:
        return float(a.scale) if a.scale is not None else a.q.shape[-1] ** -0.5

    def forward(self, a: CallArgs) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = _pad8(a.q), _pad8(a.k), _pad8(a.v)
        common = dict(q=q, k=k, v=v, dropout_p=0.0, softmax_scale=self._scale(a), causal=self.causal,
                      window_size_left=self.window[0], window_size_right=self.window[1], bias=a.bias,
                      alibi_slopes=a.alibi, return_lse=True, return_softmax=False)
        if a.cu_q is None:
            out, lse, _, rng = self.ops[FORWARD](max_seqlen_q=q.shape[1], max_seqlen_k=k.shape[1], sink=a.sink,
                                                 qkv_format=infer_qkv_format(a.q, a.k, a.v), **common)
        else:
            out, lse, _, rng = self.ops[VARLEN_FORWARD](cu_seqlens_q=a.cu_q, cu_seqlens_k=a.cu_kv,
                                                        max_seqlen_q=a.max_q, max_seqlen_k=a.max_kv, **common)
        # rng_state goes to the backward as the kernel gave it: the sink path's Triton backward
        # asserts a CPU int64 [2] tensor (attention_aiter_impl.py l.290-295).
        return out[..., :a.v.shape[-1]], lse, rng

    def backward(self, a: CallArgs, grad_out: Tensor, out: Tensor, lse: Tensor, rng_state: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor], None, Optional[Tensor]]:
        q, k, v = _pad8(a.q), _pad8(a.k), _pad8(a.v)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        atomic_fp32, bf16_cvt = aiter_backward_flags(self.arch)
        common = dict(dout=_pad8(grad_out), q=q, k=k, v=v, out=_pad8(out), softmax_lse=lse, dq=dq, dk=dk, dv=dv,
                      dropout_p=0.0, softmax_scale=self._scale(a), causal=self.causal,
                      window_size_left=self.window[0], window_size_right=self.window[1], alibi_slopes=a.alibi,
                      deterministic=a.deterministic, rng_state=rng_state, is_v3_atomic_fp32=atomic_fp32,
                      how_v3_bf16_cvt=bf16_cvt)
        dsink = dbias = None
        if a.cu_q is None:
            # Ours alone: the kernel writes them without declaring it (see the module docstring).
            dsink = torch.zeros(a.sink.shape, dtype=torch.float32, device=a.sink.device) if a.sink is not None else None
            dbias = torch.empty_like(a.bias) if a.bias is not None else None
            self.ops[BACKWARD](bias=a.bias, dbias=dbias, dsink=dsink, sink=a.sink,
                               qkv_format=infer_qkv_format(a.q, a.k, a.v), **common)
        else:
            self.ops[VARLEN_BACKWARD](cu_seqlens_q=a.cu_q, cu_seqlens_k=a.cu_kv, max_seqlen_q=a.max_q,
                                      max_seqlen_k=a.max_kv, **common)
        d_qk, d_v = a.q.shape[-1], a.v.shape[-1]
        return dq[..., :d_qk], dk[..., :d_qk], dv[..., :d_v], dsink, None, dbias  # AITER: no ALiBi gradient


def aiter_pair(kernels: Optional[dict[str, Any]], routes: Optional[CallRoutes], a: CallArgs, causal: bool,
               window: tuple[int, int]) -> Optional["AiterPair"]:
    """AITER's pair alone (`kernel_pair` with only AITER's ops discovered; the name callers had)."""
    return kernel_pair(TurboKernels(aiter=kernels), routes, a, causal, window)  # type: ignore[return-value]


@dataclass(frozen=True)
class TurboKernels:
    """The kernel-level functions this Primus-Turbo build has, per backend (None: not bindable),
    and the pairs chosen so far (a layer makes the same call step after step: choosing costs
    ~70 us, a lookup a few)."""

    aiter: Optional[dict[str, Any]] = None
    flydsl: Optional[dict[str, Callable[..., Any]]] = None
    hipkittens: Optional[dict[str, Callable[..., Any]]] = None
    chosen: dict = field(default_factory=dict, compare=False, repr=False)


def discover_kernels() -> TurboKernels:
    """Every backend's kernel level, each found by its argument names (`discover`,
    `turbo_pairs_gfx950.discover_flydsl`, `turbo_pairs_gfx950.discover_hipkittens`)."""
    return TurboKernels(aiter=discover(), flydsl=discover_flydsl(), hipkittens=discover_hipkittens())


def _routed_backend(routes: CallRoutes, a: CallArgs, causal: bool, window: tuple[int, int],
                    general: bool = False) -> Optional[str]:
    """The backend eager's dispatcher is known to pick for this call, or None where it is not
    known from the call's metadata: refused, autotuned among several, or a varlen call that
    FlyDSL takes exactly when its documents are equal, which only a host read would tell.  With
    ``general`` (a caller that runs the pair itself, eager and compiled alike, so no public entry's
    choice has to be matched) such a varlen call gets the backend that takes any documents."""
    entry = DENSE if a.cu_q is None else VARLEN
    backend = routes.backend(entry, a, causal, window)
    if backend is None or routes.arch is None:
        return None
    selection = getattr(routes, "selection", DEFAULT_ORDER)
    equal = uniform_documents(a) if entry == VARLEN else None
    build = getattr(routes, "build", BUILD_A6A16CD)
    # the layout was checked by `routes.backend` (a LAYOUT refusal), so this raises nothing
    features = call_features(routes.arch, entry, a, causal, window, equal_documents=equal or None, build=build)
    found = route(features, selection)
    if len(found.candidates) > 1 or not found.ok or found.backend is None:
        return None  # autotune keeps whichever is fastest
    if entry == VARLEN and selection.pin is None and not equal and not general:
        if route_on(dataclasses.replace(features, equal_documents=True), FLYDSL) is not None:
            return None  # FlyDSL if the documents happen to be equal, else AITER: eager reads them
    if found.backend != backend and not (entry == VARLEN and equal):
        return None  # the two views disagree: bind nothing rather than guess
    return found.backend


def kernel_pair(kernels: Optional[TurboKernels], routes: Optional[CallRoutes], a: CallArgs, causal: bool,
                window: tuple[int, int], general: bool = False) -> Optional[KernelPair]:
    """The kernel-level pair of the backend eager runs for a call the public entry would get as
    ``(causal, window)``, when that build has it and the backend's own gates hold; else None
    (``general``: see `_routed_backend`)."""
    if kernels is None or routes is None:
        return None
    key = (_call_key(routes, a, causal, window), general)
    if key in kernels.chosen:
        return kernels.chosen[key]
    if len(kernels.chosen) >= _CHOSEN_MAX:
        kernels.chosen.clear()
    pair = kernels.chosen[key] = _choose(kernels, routes, a, causal, window, general)
    return pair


_CHOSEN_MAX = 256


def _call_key(routes: CallRoutes, a: CallArgs, causal: bool, window: tuple[int, int]) -> tuple:
    """Everything `_choose` reads: the route's arch and selection, and the call's metadata."""
    def meta(t: Optional[Tensor]) -> Any:
        return None if t is None else (t.dtype, tuple(t.shape), t.stride())

    return (routes.arch, getattr(routes, "selection", None), getattr(routes, "build", None), causal, window, meta(a.q), meta(a.k), meta(a.v),
            meta(a.sink), a.alibi is None, a.bias is None, None if a.cu_q is None else a.cu_q.numel(),
            None if a.cu_kv is None else a.cu_kv.numel(), a.max_q, a.max_kv, a.scale, a.dropout_p, a.deterministic)


def _choose(kernels: TurboKernels, routes: CallRoutes, a: CallArgs, causal: bool,
            window: tuple[int, int], general: bool = False) -> Optional[KernelPair]:
    backend = _routed_backend(routes, a, causal, window, general)
    if backend == "AITER" and kernels.aiter is not None:
        return AiterPair(kernels.aiter, causal, window, routes.arch)
    build = getattr(routes, "build", BUILD_A6A16CD)
    if backend == "FlyDSL" and routes.arch == "gfx950" and kernels.flydsl is not None and flydsl_takes(
            a, causal, window, build):
        return FlydslPair(kernels.flydsl, causal, window)
    if backend == "HipKittens" and routes.arch == "gfx950" and kernels.hipkittens is not None and hipkittens_takes(
            a, causal, window):
        pair = HipkittensPair(kernels.hipkittens, causal, window)
        return pair if pair.supported(a) else None
    return None


__all__ = ["AiterPair", "BACKWARD", "FORWARD", "HOW_V3_BF16_CVT", "IS_V3_ATOMIC_FP32", "TurboKernels",
           "VARLEN_BACKWARD", "VARLEN_FORWARD", "aiter_backward_flags", "aiter_pair", "discover", "discover_kernels",
           "kernel_pair"]
