"""Primus-Turbo's kernel-level AITER ops, bound so a compiled backward does not re-run the forward.

``flash_attn_func`` / ``flash_attn_varlen_func`` are autograd Functions over ``torch.library``
ops (dispatch facts §2).  A compiled graph cannot carry an autograd Function's context from
primus_ext's forward op to its backward op, so for a call the dispatch model routes to AITER
the ops call AITER's kernel-level pair themselves: the forward returns ``(out, lse)``, the
backward hands them back.  The eager path keeps the public entries.

The ops are discovered by their argument names, never by version: all four must exist under
``torch.ops.primus_turbo`` with the names bound here, or nothing is bound and a compiled
backward recomputes the forward through the public entry (as for calls routed to FlyDSL or
HipKittens, whose kernel functions are not bound, and for calls with dropout).

The backward op writes ``dsink`` and ``dbias`` in place without declaring it.  They are
allocated here, inside primus_ext's own opaque backward op, and read once the kernel
returns, so no tensor the graph can see is written behind its back.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .call_route import CallRoutes
from .dispatch import infer_qkv_format
from .ops import CallArgs

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
"""The argument names each op must have (Primus-Turbo main, dispatch facts §2); passed by keyword."""

IS_V3_ATOMIC_FP32, HOW_V3_BF16_CVT = True, 1
"""What ``flash_attn_func`` passes the AITER backward (fp32 atomics, its bf16 conversion mode 1)."""


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
    """AITER's kernel-level forward and backward for one call (`primus_ext.backends.ops.KernelPair`).

    ``causal`` / ``window`` are the arguments the public entry would get for this call.
    """

    def __init__(self, ops: dict[str, Any], causal: bool, window: tuple[int, int]) -> None:
        self.ops, self.causal, self.window = ops, causal, window

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
        common = dict(dout=_pad8(grad_out), q=q, k=k, v=v, out=_pad8(out), softmax_lse=lse, dq=dq, dk=dk, dv=dv,
                      dropout_p=0.0, softmax_scale=self._scale(a), causal=self.causal,
                      window_size_left=self.window[0], window_size_right=self.window[1], alibi_slopes=a.alibi,
                      deterministic=a.deterministic, rng_state=rng_state, is_v3_atomic_fp32=IS_V3_ATOMIC_FP32,
                      how_v3_bf16_cvt=HOW_V3_BF16_CVT)
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
    """AITER's pair for a call the public entry would give ``(causal, window)``, when the ops are
    there and the dispatch model routes the call to AITER on the arch (the kernels eager runs)."""
    if kernels is None or routes is None:
        return None
    entry = "dense" if a.cu_q is None else "varlen"
    if routes.backend(entry, a.q, a.k, a.v, causal, window, a.sink, a.dropout_p, a.deterministic, a.alibi, a.bias,
                      a.scale) != "AITER":
        return None
    return AiterPair(kernels, causal, window)


__all__ = ["AiterPair", "aiter_pair", "BACKWARD", "FORWARD", "HOW_V3_BF16_CVT", "IS_V3_ATOMIC_FP32", "VARLEN_BACKWARD",
           "VARLEN_FORWARD", "discover"]
