"""A shared-prefix row under ``torch.compile``: one custom op for the merged forward, one for its backward.

``primus_ext::shared_prefix_attention`` runs the packed call's kernel-level forward, the cross call's, and
the merge (`primus_ext.backends.shared_prefix.merged_forward`); it returns ``(out, lse, rng_self,
rng_cross)``.  ``primus_ext::shared_prefix_attention_backward`` gives each kernel's backward the merged
``out`` and ``lse`` (`merged_backward`).  So a compiled step calls each kernel once forward and once
backward and never recomputes the forward, and Dynamo sees the layer as one opaque op (no graph break).
The row's layout travels as its tensors and ints; the target, as in `primus_ext.call.ops`, as a handle.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import refusals as R
from ..attention.pattern import pattern_from_flash_args
from ..backends.base import CallArgs, KernelPair, kernel_rng
from ..backends.dispatch_keys import autograd_keys_lifted
from ..backends.shared_prefix import SharedPrefixLayout, cross_args, merged_backward, merged_forward
from ..backends.turbo import turbo_window_args
from ..backends.turbo_kernels import kernel_pair
from .checks import assert_boundaries
from .ops import NAMESPACE, OpTarget, _fit, _lse_dtype, target


def _call(q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor], segments: Tensor, cross_q: Tensor,
          cross_kv: Tensor, cu_cross_q: Tensor, cu_cross_kv: Tensor, max_segment: int, max_cross_q: int,
          max_cross_kv: int, causal: bool, window_left: int, window_right: int, scale: Optional[float],
          deterministic: bool) -> tuple[CallArgs, SharedPrefixLayout]:
    layout = SharedPrefixLayout(total=q.shape[0], segments=segments, max_segment=max_segment, cross_q=cross_q,
                                cross_kv=cross_kv, cu_cross_q=cu_cross_q, cu_cross_kv=cu_cross_kv,
                                max_cross_q=max_cross_q, max_cross_kv=max_cross_kv)
    a = CallArgs(q, k, v, segments, segments, max_segment, max_segment, sink, None, None, causal,
                 (window_left, window_right), scale, 0.0, deterministic, True)
    return a, layout


def checked_calls(found: OpTarget, a: CallArgs, layout: SharedPrefixLayout) -> Optional[CallArgs]:
    """The cross call of the self call ``a`` (None without one), both checked on ``found``'s routes (B33)."""
    found.check(a)
    cross = cross_args(a, layout) if layout.has_cross else None
    if cross is not None:
        found.check(cross)
    return cross


def _pair(found: OpTarget, a: CallArgs) -> Optional[KernelPair]:
    """The target's pair for ``a``; on Primus-Turbo's kernels where none is known from the call's metadata because
    FlyDSL would take it only with equal documents, AITER's (which takes any): the merge runs the pair itself, eager
    and compiled alike, so it need not follow the public entry's choice, which reads the boundaries."""
    pair = found.pair(a)
    kernels = getattr(found, "kernels", None) or getattr(getattr(found, "backend", None), "kernels", None)
    routes = getattr(found, "routes", None)
    if pair is not None or kernels is None or routes is None:
        return pair
    causal, window = turbo_window_args(pattern_from_flash_args(a.causal, a.window))
    return kernel_pair(kernels, routes, a, causal, window, general=True)


def pairs_of(found: OpTarget, a: CallArgs, cross: Optional[CallArgs]) -> tuple:
    """``(self_pair, cross_pair)``, or our refusal: the eager call and the ops choose them here alike."""
    self_pair, cross_pair = _pair(found, a), (_pair(found, cross) if cross is not None else None)
    if self_pair is None or (cross is not None and cross_pair is None):
        which = "the packed call" if self_pair is None else "the cross call"
        raise R.refuse(R.PREFIX_CALL, what=f"kernel-level forward and backward pairs that return and take an LSE, "
                                           f"which this backend has not for {which} of this row")
    return self_pair, cross_pair


def _pairs(handle: int, a: CallArgs, layout: SharedPrefixLayout) -> tuple:
    """The pairs of the two calls, checked again when the graph runs (a traced graph skips the eager checks)."""
    found = target(handle)
    return pairs_of(found, a, checked_calls(found, a, layout))


@torch.library.custom_op(f"{NAMESPACE}::shared_prefix_attention", mutates_args=())
def shared_prefix_attention(q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor], segments: Tensor,
                            cross_q: Tensor, cross_kv: Tensor, cu_cross_q: Tensor, cu_cross_kv: Tensor, handle: int,
                            max_segment: int, max_cross_q: int, max_cross_kv: int, causal: bool, window_left: int,
                            window_right: int, scale: Optional[float], deterministic: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    assert_boundaries("cu_seqlens_q", segments, q.shape[0], max_segment)
    a, layout = _call(q, k, v, sink, segments, cross_q, cross_kv, cu_cross_q, cu_cross_kv, max_segment, max_cross_q,
                      max_cross_kv, causal, window_left, window_right, scale, deterministic)
    with torch.no_grad(), autograd_keys_lifted():
        out, lse, rng_self, rng_cross = merged_forward(a, layout, *_pairs(handle, a, layout))
    rng_cross = rng_cross if rng_cross is not None else kernel_rng(a)
    return out.contiguous(), lse.to(_lse_dtype(q)).contiguous(), rng_self, rng_cross


@shared_prefix_attention.register_fake
def _(q, k, v, *_):
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=_lse_dtype(q))
    rng = torch.empty(2, dtype=torch.int64, device=q.device)  # `kernel_rng` of a packed call: on q's device
    return out, lse, rng, torch.empty_like(rng)


@torch.library.custom_op(f"{NAMESPACE}::shared_prefix_attention_backward", mutates_args=())
def shared_prefix_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor],
                                     out: Tensor, lse: Tensor, rng_self: Tensor, rng_cross: Tensor, segments: Tensor,
                                     cross_q: Tensor, cross_kv: Tensor, cu_cross_q: Tensor, cu_cross_kv: Tensor,
                                     handle: int, max_segment: int, max_cross_q: int, max_cross_kv: int,
                                     causal: bool, window_left: int, window_right: int, scale: Optional[float],
                                     deterministic: bool
                                     ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    a, layout = _call(q, k, v, sink, segments, cross_q, cross_kv, cu_cross_q, cu_cross_kv, max_segment, max_cross_q,
                      max_cross_kv, causal, window_left, window_right, scale, deterministic)
    with torch.no_grad(), autograd_keys_lifted():
        grads = merged_backward(a, layout, *_pairs(handle, a, layout), grad_out, out, lse, rng_self, rng_cross)
    return tuple(_fit(g, t, q) for g, t in zip(grads, (q, k, v, sink)))  # type: ignore[return-value]


@shared_prefix_attention_backward.register_fake
def _(grad_out, q, k, v, sink, *_):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty_like(sink) if sink is not None else q.new_empty(0))


_LAYOUT = ("segments", "cross_q", "cross_kv", "cu_cross_q", "cu_cross_kv")
_SCALARS = ("handle", "max_segment", "max_cross_q", "max_cross_kv", "causal", "window_left", "window_right", "scale",
            "deterministic")


def _setup(ctx, inputs, output) -> None:
    q, k, v, sink, *rest = inputs
    ctx.mark_non_differentiable(output[1], output[2], output[3])
    ctx.save_for_backward(q, k, v, sink, output[0], output[1], output[2], output[3], *rest[:len(_LAYOUT)])
    ctx.scalars = rest[len(_LAYOUT):]


def _backward(ctx, grad_out, _lse, _rng_self, _rng_cross):
    q, k, v, sink, out, lse, rng_self, rng_cross, *layout = ctx.saved_tensors
    dq, dk, dv, dsink = torch.ops.primus_ext.shared_prefix_attention_backward(
        grad_out, q, k, v, sink, out, lse, rng_self, rng_cross, *layout, *ctx.scalars)
    return (dq, dk, dv, dsink if sink is not None else None) + (None,) * (len(_LAYOUT) + len(_SCALARS))


shared_prefix_attention.register_autograd(_backward, setup_context=_setup)


def run_compiled(handle: int, a: CallArgs, layout: SharedPrefixLayout) -> Tensor:
    """The merged call as the op, inside a compiled graph."""
    out, _, _, _ = torch.ops.primus_ext.shared_prefix_attention(
        a.q, a.k, a.v, a.sink, layout.segments, layout.cross_q, layout.cross_kv, layout.cu_cross_q,
        layout.cu_cross_kv, handle, layout.max_segment, layout.max_cross_q, layout.max_cross_kv, a.causal,
        a.window[0], a.window[1], a.scale, a.deterministic)
    return out


__all__ = ["checked_calls", "pairs_of", "run_compiled", "shared_prefix_attention", "shared_prefix_attention_backward"]
