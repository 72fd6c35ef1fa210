"""Primus-Turbo's gfx950 kernel levels, FlyDSL and HipKittens, as kernel pairs (`ops.KernelPair`).

Beside AITER's ops (`turbo_kernels`), ``flash_attn_func`` runs two gfx950 backends whose
forward saves ``(q_s, k_s, v_s, out_s, lse)`` and no random state (Primus-Turbo
``primus_turbo/pytorch/ops/attention/flash_attn_interface.py`` l.116, l.143 at a6a16cd), so a
compiled backward can run their kernel-level backward from the forward's output instead of
running the forward again.  They are bound here from inside primus_ext's own opaque ops:

* FlyDSL through its plain-Python ``*_impl`` wrappers (which assert the kernels'
  preconditions), never its raw ``torch.library`` ops;
* HipKittens through its ``_impl`` wrappers, each call first asked of
  ``hipkittens_attn_supported_impl`` on the sbhd views.

Both are discovered by their argument names (`discover_flydsl`, `discover_hipkittens`), never
by version.  Neither wrapper checks what the dispatcher checks before naming the backend,
so `flydsl_takes` / `hipkittens_takes` apply those gates again here (upstream's
``_flydsl_common_ok``, ``_gqa_group_ok``, ``_sink_ok``, ``_sbhd_layout``; HipKittens' envelope):
the caller binds a pair only where the dispatch model routes the call to that backend *and*
these hold.  Layouts: q/k/v go in as contiguous sbhd (``[S, B, H, D]``, a copy only for a
tensor not so already); FlyDSL's dense lse ``[B*Sq, Hq]`` becomes the ops' ``[B, Hq, Sq]``, its
varlen lse ``[T, Hq]`` the ops' ``[Hq, T]``; HipKittens' ``[B, Hq, 1, Sq]`` becomes ``[B, Hq, Sq]``.
"""

from __future__ import annotations

import importlib
import inspect
import math
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from ..errors import PrimusExtError
from .dispatch_rows import flydsl_group_ok
from .layout import LayoutError, storage_features
from .turbo_build import BUILD_A6A16CD, TurboBuild
from .base import CallArgs, kernel_rng
from .capabilities import entry_accepts

FLYDSL_MODULE = "primus_turbo.pytorch.kernels.attention.attention_flydsl_impl"
HIPKITTENS_MODULE = "primus_turbo.pytorch.kernels.attention.attention_hipkittens_impl"

FLYDSL_ARGS = {
    "flash_attn_sbhd_flydsl_forward_impl": ("q", "k", "v", "softmax_scale", "causal", "window_size", "return_lse",
                                            "sink"),
    "flash_attn_sbhd_flydsl_backward_impl": ("dout", "q", "k", "v", "out", "lse", "softmax_scale", "causal",
                                             "window_size", "sink"),
    "flash_attn_varlen_flydsl_forward_impl": ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                              "max_seqlen_k", "softmax_scale", "causal", "window_size", "return_lse",
                                              "sink"),
    "flash_attn_varlen_flydsl_backward_impl": ("dout", "q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k",
                                               "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal",
                                               "window_size", "sink"),
}
"""The wrappers' argument names (attention_flydsl_impl.py at a6a16cd); passed by keyword."""

HIPKITTENS_ARGS = {
    "hipkittens_attn_supported_impl": ("q", "k", "v", "causal", "window_size", "sink", "dropout_p", "bias",
                                       "alibi_slopes"),
    "flash_attn_sbhd_hipkittens_forward_impl": ("q", "k", "v", "softmax_scale", "causal", "window_size",
                                                "return_lse"),
    "flash_attn_sbhd_hipkittens_backward_impl": ("dout", "q", "k", "v", "out", "lse", "softmax_scale", "causal",
                                                 "window_size"),
}
"""HipKittens' ``_impl`` layer (attention_hipkittens_impl.py at a6a16cd); ``supported`` may take
the keywords as ``**kwargs``."""

MIN_FLYDSL_WINDOW = 64
"""Upstream's ``_MIN_FLYDSL_WINDOW``: a narrower left window gives NaN in FlyDSL's backward."""


class KernelOutputError(PrimusExtError, RuntimeError):
    """A kernel-level function returned something other than what primus_ext binds it for."""


def _takes(fn: Any, names: tuple[str, ...]) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return set(names[:3]) <= set(params)  # q, k, v by name; the rest through **kwargs
    return set(names) <= set(params)


def _discover(module: str, wanted: dict[str, tuple[str, ...]]) -> Optional[dict[str, Callable[..., Any]]]:
    """The wanted functions of ``module`` by name, or None unless each one takes its arguments."""
    try:
        mod = importlib.import_module(module)
    except Exception:  # noqa: BLE001 - absent, or a build whose kernel layer fails to import: bind nothing
        return None
    found = {name: getattr(mod, name, None) for name in wanted}
    if not all(callable(fn) and _takes(fn, wanted[name]) for name, fn in found.items()):
        return None
    return found  # type: ignore[return-value]


def discover_flydsl() -> Optional[dict[str, Callable[..., Any]]]:
    return _discover(FLYDSL_MODULE, FLYDSL_ARGS)


def discover_hipkittens() -> Optional[dict[str, Callable[..., Any]]]:
    return _discover(HIPKITTENS_MODULE, HIPKITTENS_ARGS)


# -- the dispatcher's gates ---------------------------------------------------------------
def _sbhd_layout(a: CallArgs) -> bool:
    """``_sbhd_layout`` on the call's bshd-shaped q, k, v: sbhd memory order, or bshd with batch 1,
    as upstream infers the order from all three."""
    try:
        return storage_features(a.q, a.k, a.v)[1]
    except LayoutError:
        return False


def uniform_documents(a: CallArgs) -> bool:
    """Equal documents of exactly ``max_seqlen``, from metadata alone (FlyDSL's own host-only test,
    ``_uniform_shape``): the op checks that no document exceeds ``max_seqlen``, so B of them summing
    to ``B * max_seqlen`` tokens are all that long."""
    if a.cu_q is None or a.cu_kv is None or a.cu_q.numel() != a.cu_kv.numel():
        return False
    documents = a.cu_q.numel() - 1
    return documents > 0 and documents * a.max_q == a.q.shape[0] and documents * a.max_kv == a.k.shape[0]


def flydsl_takes(a: CallArgs, causal: bool, window: tuple[int, int], build: TurboBuild = BUILD_A6A16CD) -> bool:
    """Every gate upstream's dispatcher applies before naming FlyDSL, the arch apart (the caller
    checks gfx950 through the route): causal bf16, D 64/128 for q, k and v, right window edge 0
    or -1 with a left one < 0 or >= 64, the default scale, no dropout / bias / ALiBi, a GQA group
    ``build`` takes (`flydsl_group_ok`), a sink fp32 of Hq; dense sbhd storage, varlen equal
    documents of exactly ``max_seqlen`` (where the backward computes ``dsink``)."""
    d, heads = a.q.shape[-1], a.q.shape[-2]
    left, right = window
    if not (causal and a.q.dtype == a.k.dtype == a.v.dtype == torch.bfloat16 and d in (64, 128)
            and a.k.shape[-1] == a.v.shape[-1] == d and right in (0, -1)
            and (left < 0 or left >= MIN_FLYDSL_WINDOW)
            and (a.scale is None or abs(a.scale - 1.0 / math.sqrt(d)) < 1e-6)
            and a.dropout_p == 0.0 and a.bias is None and a.alibi is None
            and flydsl_group_ok(heads, a.k.shape[-2], d, build)):
        return False
    if a.sink is not None and not (a.sink.dtype == torch.float32 and a.sink.numel() == heads):
        return False
    if a.cu_q is None:
        return _sbhd_layout(a)
    return uniform_documents(a)


def hipkittens_takes(a: CallArgs, causal: bool, window: tuple[int, int]) -> bool:
    """HipKittens' envelope, the arch apart: dense causal bf16 without sink, dropout, bias or
    ALiBi, sbhd storage, right window edge 0 or -1, D 64/128 with ``v.shape == k.shape``,
    ``Hq % Hkv == 0`` and ``Sq <= Skv`` (its forward leaves rows unwritten beyond that); the
    pair then asks ``hipkittens_attn_supported_impl`` too."""
    q, k, v = a.q, a.k, a.v
    return (a.cu_q is None and causal and q.dtype == k.dtype == v.dtype == torch.bfloat16 and a.sink is None
            and a.dropout_p == 0.0 and a.bias is None and a.alibi is None and window[1] in (0, -1)
            and q.shape[-1] in (64, 128) and v.shape == k.shape and k.shape[-1] == q.shape[-1]
            and q.shape[0] == k.shape[0] and k.shape[-2] > 0 and q.shape[-2] % k.shape[-2] == 0
            and q.shape[1] <= k.shape[1]
            and _sbhd_layout(a))


# -- the pairs ---------------------------------------------------------------------------
def _to_sbhd(t: Tensor) -> Tensor:
    """A bshd-shaped tensor as the contiguous sbhd one the kernels take (a view when it is)."""
    s = t.transpose(0, 1)
    return s if s.is_contiguous() else s.contiguous()


def _contiguous(t: Tensor) -> Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _expect(t: Any, shape: tuple[int, ...], what: str) -> Tensor:
    if not isinstance(t, Tensor) or tuple(t.shape) != shape:
        got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
        raise KernelOutputError(f"{what} returned {got}, expected {shape}; primus_ext binds it for that layout "
                                "(is this Primus-Turbo build one it knows?)")
    return t


class FlydslPair:
    """FlyDSL's kernel-level forward and backward for one call (dense sbhd, or uniform varlen)."""

    def __init__(self, fns: dict[str, Callable[..., Any]], causal: bool, window: tuple[int, int]) -> None:
        self.fns, self.causal, self.window = fns, causal, window

    def _common(self, a: CallArgs) -> dict[str, Any]:
        return dict(softmax_scale=a.scale, causal=self.causal, window_size=self.window, sink=a.sink)

    def _backward_common(self, a: CallArgs, name: str) -> dict[str, Any]:
        """The backward's arguments: since PT #480 it takes ``deterministic`` (without it: an atomic,
        non-reproducible dQ), passed as the call asks, as ``flash_attn_func`` passes ``ctx.deterministic``;
        before it the backward had one, reproducible, way (docs/fidelity.md, fact `pt480-deterministic`)."""
        extra = {"deterministic": bool(a.deterministic)} if entry_accepts(self.fns[name], "deterministic") else {}
        return {**self._common(a), **extra}

    def forward(self, a: CallArgs) -> tuple[Tensor, Tensor, Tensor]:
        heads = a.q.shape[-2]
        if a.cu_q is None:
            batch, s_q = a.q.shape[0], a.q.shape[1]
            out_s, lse = self.fns["flash_attn_sbhd_flydsl_forward_impl"](
                q=_to_sbhd(a.q), k=_to_sbhd(a.k), v=_to_sbhd(a.v), return_lse=True, **self._common(a))
            lse = _expect(lse, (batch * s_q, heads), "FlyDSL's dense forward lse")
            # [B*Sq, Hq] batch-major -> [B, Hq, Sq]
            return out_s.transpose(0, 1), lse.view(batch, s_q, heads).permute(0, 2, 1), kernel_rng(a)
        q, k, v = _contiguous(a.q), _contiguous(a.k), _contiguous(a.v)  # its kernel reads fixed strides
        out, lse = self.fns["flash_attn_varlen_flydsl_forward_impl"](
            q=q, k=k, v=v, cu_seqlens_q=a.cu_q, cu_seqlens_k=a.cu_kv, max_seqlen_q=a.max_q,
            max_seqlen_k=a.max_kv, return_lse=True, **self._common(a))
        return out, _expect(lse, (a.q.shape[0], heads), "FlyDSL's varlen forward lse").t(), kernel_rng(a)

    def backward(self, a: CallArgs, grad_out: Tensor, out: Tensor, lse: Tensor, rng_state: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor], None, None]:
        if a.cu_q is None:
            grads = self.fns["flash_attn_sbhd_flydsl_backward_impl"](
                dout=_to_sbhd(grad_out), q=_to_sbhd(a.q), k=_to_sbhd(a.k), v=_to_sbhd(a.v), out=_to_sbhd(out),
                lse=lse, **self._backward_common(a, "flash_attn_sbhd_flydsl_backward_impl"))  # lse: [B, Hq, Sq]
            dq, dk, dv = (g.transpose(0, 1) for g in grads[:3])
        else:
            name = "flash_attn_varlen_flydsl_backward_impl"
            grads = self.fns[name](
                dout=_contiguous(grad_out), q=_contiguous(a.q), k=_contiguous(a.k), v=_contiguous(a.v),
                out=_contiguous(out), lse=lse.t().contiguous(), cu_seqlens_q=a.cu_q, cu_seqlens_k=a.cu_kv,
                max_seqlen_q=a.max_q, max_seqlen_k=a.max_kv, **self._backward_common(a, name))
            dq, dk, dv = grads[:3]
        dsink = None
        if a.sink is not None:
            # The sink's gradient comes back only where FlyDSL computes it; without it the sink
            # would train with a zero gradient, silently.
            if len(grads) < 4:
                raise KernelOutputError("FlyDSL's backward returned no dsink for a call with a sink (its ragged "
                                        "varlen path computes none); primus_ext binds it only where it does")
            dsink = _expect(grads[3], (a.q.shape[-2],), "FlyDSL's backward dsink")
        return dq, dk, dv, dsink, None, None


class HipkittensPair:
    """HipKittens' kernel-level forward and backward for one dense sbhd call (no sink)."""

    def __init__(self, fns: dict[str, Callable[..., Any]], causal: bool, window: tuple[int, int]) -> None:
        self.fns, self.causal, self.window = fns, causal, window

    def supported(self, a: CallArgs) -> bool:
        """The layer's own envelope check, on the sbhd views the kernels will get."""
        ok = self.fns["hipkittens_attn_supported_impl"](
            _to_sbhd(a.q), _to_sbhd(a.k), _to_sbhd(a.v), causal=self.causal, window_size=self.window, sink=a.sink,
            dropout_p=a.dropout_p, bias=a.bias, alibi_slopes=a.alibi)
        return isinstance(ok, tuple) and bool(ok[0])

    def forward(self, a: CallArgs) -> tuple[Tensor, Tensor, Tensor]:
        batch, s_q, heads = a.q.shape[:3]
        out_s, lse = self.fns["flash_attn_sbhd_hipkittens_forward_impl"](
            q=_to_sbhd(a.q), k=_to_sbhd(a.k), v=_to_sbhd(a.v), softmax_scale=a.scale, causal=self.causal,
            window_size=self.window, return_lse=True)
        lse = _expect(lse, (batch, heads, 1, s_q), "HipKittens' forward lse")
        return out_s.transpose(0, 1), lse.reshape(batch, heads, s_q), kernel_rng(a)

    def backward(self, a: CallArgs, grad_out: Tensor, out: Tensor, lse: Tensor, rng_state: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor, None, None, None]:
        dq, dk, dv = self.fns["flash_attn_sbhd_hipkittens_backward_impl"](
            dout=_to_sbhd(grad_out), q=_to_sbhd(a.q), k=_to_sbhd(a.k), v=_to_sbhd(a.v), out=_to_sbhd(out), lse=lse,
            softmax_scale=a.scale, causal=self.causal, window_size=self.window)
        return dq.transpose(0, 1), dk.transpose(0, 1), dv.transpose(0, 1), None, None, None


__all__ = ["FLYDSL_ARGS", "FLYDSL_MODULE", "FlydslPair", "HIPKITTENS_ARGS", "HIPKITTENS_MODULE", "HipkittensPair",
           "KernelOutputError", "MIN_FLYDSL_WINDOW", "discover_flydsl", "discover_hipkittens", "flydsl_takes",
           "hipkittens_takes", "uniform_documents"]
