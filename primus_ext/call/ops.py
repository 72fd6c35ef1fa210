"""The attention kernel call as ``torch.library`` custom ops (namespace ``primus_ext``).

Why ops: a compiled transformer block must not break its graph at attention, and
selective activation checkpointing must be able to *save* attention instead of
recomputing it.  Under ``torch.compile`` each call goes through one op per layout
(`run_dense` / `run_packed`; eager calls run the target directly, keeping the kernels'
native backward):

* ``primus_ext::dense_attention`` (bshd) and ``primus_ext::varlen_attention`` (thd),
  each returning ``(out, lse, rng_state)``, with backward ops
  ``primus_ext::dense_attention_backward`` / ``primus_ext::varlen_attention_backward``.

Everything that is not a tensor or a scalar (the plan, hook callables, the Turbo
module, the BlockMask cache) stays outside the graph: the op receives an integer
``handle`` naming a registered `OpTarget`, a constant per layer, so Dynamo neither
traces nor guards on it.  The implementations run eagerly: the reference math on
any device (so the ops work in CPU tests), or Primus-Turbo's entries.

Where the target has a kernel-level pair for the call (`OpTarget.pair`: Primus-Turbo's
AITER ops, FlyDSL's or HipKittens' ``_impl`` wrappers on gfx950 (`turbo_pairs_gfx950`), or the
reference's blockwise math), the forward op returns that kernel's
``(out, lse, rng_state)`` and the backward op hands them back to the kernel-level
backward, so a compiled step runs attention's forward once.  Otherwise the backward op recomputes
the forward with autograd; ``rng_state`` is then the generator state captured before
a forward with dropout, restored for the recompute, so the same dropout mask is used.
Without dropout it is int64 ``[2]`` in AITER's own format (`kernel_rng`), decided by the
call's form alone, so the op's fake knows it without asking which kernel runs.
``lse`` (``[B, Hq, Sq]`` dense, ``[Hq, T]`` packed, fp32 or float64 for float64
inputs) is not differentiable.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Any, NamedTuple, Optional, Protocol, Sequence

import torch
from torch import Tensor

from ..backends.base import CallArgs, KernelPair, kernel_rng
from .checks import assert_boundaries
from .op_rng import rng_restored, rng_size, rng_snapshot

NAMESPACE = "primus_ext"


class OpTarget(Protocol):
    """What a handle names: runs one call eagerly, with autograd when asked."""

    def check(self, a: "CallArgs") -> None:
        """Refuse a call its kernels would fail or compute wrongly (its route on the plan's arch, its
        storage layout): run by the forward op itself, since a traced graph skips the eager check."""
        ...

    def dense(self, q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor], alibi: Optional[Tensor],
              bias: Optional[Tensor], causal: bool, window: tuple[int, int], scale: Optional[float],
              dropout_p: float, deterministic: bool, return_lse: bool) -> Any: ...

    def packed(self, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_kv: Tensor, max_q: int, max_kv: int,
               sink: Optional[Tensor], alibi: Optional[Tensor], causal: bool, window: tuple[int, int],
               scale: Optional[float], dropout_p: float, deterministic: bool, return_lse: bool) -> Any: ...


_TARGETS: dict[int, OpTarget] = {}
_NEXT = itertools.count(1)


def register_target(target: OpTarget, owner: Any = None) -> int:
    """Give ``target`` a handle the ops can carry as a plain int (build time, not per call).

    With ``owner`` (the adapter or module the handle belongs to) the registry lets go of the
    target when the owner is collected, so dropped layers do not stay alive through it.
    """
    handle = next(_NEXT)
    _TARGETS[handle] = target
    if owner is not None:
        weakref.finalize(owner, _TARGETS.pop, handle, None)
    return handle


def target(handle: int) -> OpTarget:
    return _TARGETS[handle]


def _pair(handle: int, a: CallArgs) -> Optional[KernelPair]:
    """The target's kernel pair for this call; never with dropout (its rng would have to
    travel through the graph in each kernel's own format)."""
    if a.dropout_p > 0.0:
        return None
    find = getattr(_TARGETS.get(handle), "pair", None)
    return None if find is None else find(a)


def _fake_rng(a: CallArgs) -> Tensor:
    """The forward op's ``rng_state`` output, as metadata (it depends on the call's form alone): the
    generator state a dropout forward starts from, else `kernel_rng`."""
    if a.dropout_p > 0:
        return torch.empty(rng_size(a.q.device), dtype=torch.uint8, device="cpu")
    return kernel_rng(a, fake=True)


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.promote_types(q.dtype, torch.float32)


def _contiguous(t: Tensor) -> Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _run_forward(handle: int, a: CallArgs, lse_shape: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
    """The forward ops' body: the kernel pair's forward, or the target's eager call."""
    target(handle).check(a)
    pair = _pair(handle, a)
    if pair is not None:
        out, lse, rng = pair.forward(a)
        return _contiguous(out), _contiguous(lse.to(_lse_dtype(a.q))), rng
    rng = rng_snapshot(a.q.device, a.dropout_p) if a.dropout_p > 0 else kernel_rng(a)
    with torch.no_grad():
        result = _target_call(handle, a, a.q, a.k, a.v, a.sink, a.alibi, a.bias)
    out, lse = result if a.return_lse else (result, None)
    # zeros, not garbage: an output nobody asked for must still be deterministic
    lse = lse.to(_lse_dtype(a.q)) if lse is not None else a.q.new_zeros(lse_shape, dtype=_lse_dtype(a.q))
    return _contiguous(out), _contiguous(lse), rng


def _target_call(handle: int, a: CallArgs, q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor],
                 alibi: Optional[Tensor], bias: Optional[Tensor]) -> Any:
    """The target's own eager call of ``a`` with these tensors (leaves, for a recompute)."""
    t = target(handle)
    if a.cu_q is None:
        return t.dense(q, k, v, sink, alibi, bias, a.causal, a.window, a.scale, a.dropout_p, a.deterministic,
                       a.return_lse)
    return t.packed(q, k, v, a.cu_q, a.cu_kv, a.max_q, a.max_kv, sink, alibi, a.causal, a.window, a.scale,
                    a.dropout_p, a.deterministic, a.return_lse)


def _run_backward(handle: int, a: CallArgs, grad_out: Tensor, out: Tensor, lse: Tensor,
                  rng_state: Tensor) -> tuple[Tensor, ...]:
    """The backward ops' body: ``(dq, dk, dv, dsink, dalibi[, dbias])`` from the kernel pair's
    backward, or by differentiating a recompute of the forward (dropout mask replayed)."""
    dense = a.cu_q is None
    like = [a.q, a.k, a.v, a.sink, a.alibi] + ([a.bias] if dense else [])
    pair = _pair(handle, a)
    if pair is not None:
        dq, dk, dv, dsink, dalibi, dbias = pair.backward(a, grad_out, out, lse, rng_state)
        grads = [dq, dk, dv, dsink, dalibi] + ([dbias] if dense else [])
        return tuple(_fit(g, t, a.q) for g, t in zip(grads, like))
    leaves = [_leaf(t) for t in like]
    with _autograd_inside_op(), rng_restored(rng_state if a.dropout_p > 0 else None, a.q.device):
        again = _target_call(handle, a, *leaves[:5], leaves[5] if dense else None)
        return tuple(_grads(again[0] if a.return_lse else again, leaves, grad_out, a.q))


def _fit(g: Optional[Tensor], leaf: Optional[Tensor], q: Tensor) -> Tensor:
    """A gradient as the op declares it: ``empty_like(leaf)`` strides and dtype, empty for no leaf."""
    if leaf is None:
        return q.new_empty(0)
    if g is None:
        return torch.zeros_like(leaf)
    want = torch.empty_like(leaf)
    return g if g.stride() == want.stride() and g.dtype == want.dtype else want.copy_(g)


@contextlib.contextmanager
def _autograd_inside_op():
    """Record autograd inside an op implementation.

    A custom op's implementation runs below the Autograd dispatch keys (they are in
    the thread-local exclude set), so ops inside it build no graph even under
    ``enable_grad``.  The backward ops recompute the forward to differentiate it, so
    they lift that exclusion for the recompute (Autocast stays excluded).
    """
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradOther)
    for key in ("AutogradFunctionality", "AutogradNestedTensor"):
        if hasattr(torch._C.DispatchKey, key):
            keys = keys | torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set() - keys
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
        yield


def _none_if_empty(t: Tensor) -> Optional[Tensor]:
    return None if t.numel() == 0 else t


def _grads(out: Tensor, leaves: Sequence[Optional[Tensor]], grad_out: Tensor, like: Tensor) -> list[Tensor]:
    live = [t for t in leaves if t is not None]
    found = iter(torch.autograd.grad(out, live, grad_out, allow_unused=True))
    # The fake implementations declare ``empty_like(input)`` strides; the math's own
    # gradient layout (e.g. from a transpose) must not leak out of the op.
    return [_fit(None if leaf is None else next(found), leaf, like) for leaf in leaves]


def _leaf(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.detach().requires_grad_(True)


# -- dense ------------------------------------------------------------------------
@torch.library.custom_op(f"{NAMESPACE}::dense_attention", mutates_args=())
def dense_attention(q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor], alibi_slopes: Optional[Tensor],
                    bias: Optional[Tensor], handle: int, causal: bool, window_left: int, window_right: int,
                    scale: Optional[float], dropout_p: float, deterministic: bool,
                    return_lse: bool) -> tuple[Tensor, Tensor, Tensor]:
    a = CallArgs(q, k, v, None, None, q.shape[1], k.shape[1], sink, alibi_slopes, bias, causal,
                 (window_left, window_right), scale, dropout_p, deterministic, return_lse)
    return _run_forward(handle, a, (q.shape[0], q.shape[2], q.shape[1]))


@dense_attention.register_fake
def _(q, k, v, sink, alibi_slopes, bias, handle, causal, window_left, window_right, scale, dropout_p,
      deterministic, return_lse):
    batch, q_len, heads = q.shape[0], q.shape[1], q.shape[2]
    out = q.new_empty(batch, q_len, heads, v.shape[-1])
    lse = q.new_empty((batch, heads, q_len), dtype=_lse_dtype(q))
    a = CallArgs(q, k, v, None, None, q_len, k.shape[1], sink, alibi_slopes, bias, causal,
                 (window_left, window_right), scale, dropout_p, deterministic, return_lse)
    return out, lse, _fake_rng(a)


@torch.library.custom_op(f"{NAMESPACE}::dense_attention_backward", mutates_args=())
def dense_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                             sink: Optional[Tensor], alibi_slopes: Optional[Tensor], bias: Optional[Tensor],
                             rng_state: Tensor, handle: int, causal: bool, window_left: int, window_right: int,
                             scale: Optional[float], dropout_p: float, deterministic: bool,
                             return_lse: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    a = CallArgs(q, k, v, None, None, q.shape[1], k.shape[1], sink, alibi_slopes, bias, causal,
                 (window_left, window_right), scale, dropout_p, deterministic, return_lse)
    return _run_backward(handle, a, grad_out, out, lse, rng_state)  # type: ignore[return-value]


@dense_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, sink, alibi_slopes, bias, rng_state, handle, causal, window_left, window_right,
      scale, dropout_p, deterministic, return_lse):
    def like(t: Optional[Tensor]) -> Tensor:
        return torch.empty_like(t) if t is not None else q.new_empty(0)

    return like(q), like(k), like(v), like(sink), like(alibi_slopes), like(bias)


def _dense_setup(ctx, inputs, output) -> None:
    q, k, v, sink, alibi, bias, *scalars = inputs
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.save_for_backward(q, k, v, output[0], output[1], sink, alibi, bias, output[2])
    ctx.scalars = scalars


def _dense_backward(ctx, grad_out, _grad_lse, _grad_rng):
    q, k, v, out, lse, sink, alibi, bias, rng = ctx.saved_tensors
    dq, dk, dv, dsink, dalibi, dbias = torch.ops.primus_ext.dense_attention_backward(
        grad_out, q, k, v, out, lse, sink, alibi, bias, rng, *ctx.scalars)
    return (dq, dk, dv, _none_if_empty(dsink), _none_if_empty(dalibi), _none_if_empty(dbias)) + (None,) * 8


dense_attention.register_autograd(_dense_backward, setup_context=_dense_setup)


# -- packed (thd) -----------------------------------------------------------------
@torch.library.custom_op(f"{NAMESPACE}::varlen_attention", mutates_args=())
def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_kv: Tensor,
                     sink: Optional[Tensor], alibi_slopes: Optional[Tensor], handle: int, max_seqlen_q: int,
                     max_seqlen_kv: int, causal: bool, window_left: int, window_right: int,
                     scale: Optional[float], dropout_p: float, deterministic: bool,
                     return_lse: bool) -> tuple[Tensor, Tensor, Tensor]:
    # The boundaries' values are checked here, eagerly, not traced: a refusal is then our error
    # on CPU, as in eager (on a GPU it is a device-side assert either way).
    assert_boundaries("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
    assert_boundaries("cu_seqlens_kv", cu_seqlens_kv, k.shape[0], max_seqlen_kv)
    a = CallArgs(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, sink, alibi_slopes, None,
                 causal, (window_left, window_right), scale, dropout_p, deterministic, return_lse)
    return _run_forward(handle, a, (q.shape[1], q.shape[0]))


@varlen_attention.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_kv, sink, alibi_slopes, handle, max_seqlen_q, max_seqlen_kv, causal,
      window_left, window_right, scale, dropout_p, deterministic, return_lse):
    tokens, heads = q.shape[0], q.shape[1]
    out = q.new_empty(tokens, heads, v.shape[-1])
    lse = q.new_empty((heads, tokens), dtype=_lse_dtype(q))
    a = CallArgs(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, sink, alibi_slopes, None,
                 causal, (window_left, window_right), scale, dropout_p, deterministic, return_lse)
    return out, lse, _fake_rng(a)


@torch.library.custom_op(f"{NAMESPACE}::varlen_attention_backward", mutates_args=())
def varlen_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                              cu_seqlens_q: Tensor, cu_seqlens_kv: Tensor, sink: Optional[Tensor],
                              alibi_slopes: Optional[Tensor], rng_state: Tensor, handle: int, max_seqlen_q: int,
                              max_seqlen_kv: int, causal: bool, window_left: int, window_right: int,
                              scale: Optional[float], dropout_p: float, deterministic: bool,
                              return_lse: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    a = CallArgs(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, sink, alibi_slopes, None,
                 causal, (window_left, window_right), scale, dropout_p, deterministic, return_lse)
    return _run_backward(handle, a, grad_out, out, lse, rng_state)  # type: ignore[return-value]


@varlen_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_kv, sink, alibi_slopes, rng_state, handle,
      max_seqlen_q, max_seqlen_kv, causal, window_left, window_right, scale, dropout_p, deterministic, return_lse):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty_like(sink) if sink is not None else q.new_empty(0),
            torch.empty_like(alibi_slopes) if alibi_slopes is not None else q.new_empty(0))


def _varlen_setup(ctx, inputs, output) -> None:
    q, k, v, cu_q, cu_kv, sink, alibi, *scalars = inputs
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_q, cu_kv, sink, alibi, output[2])
    ctx.scalars = scalars


def _varlen_backward(ctx, grad_out, _grad_lse, _grad_rng):
    q, k, v, out, lse, cu_q, cu_kv, sink, alibi, rng = ctx.saved_tensors
    dq, dk, dv, dsink, dalibi = torch.ops.primus_ext.varlen_attention_backward(
        grad_out, q, k, v, out, lse, cu_q, cu_kv, sink, alibi, rng, *ctx.scalars)
    return (dq, dk, dv, None, None, _none_if_empty(dsink), _none_if_empty(dalibi)) + (None,) * 10


varlen_attention.register_autograd(_varlen_backward, setup_context=_varlen_setup)


def run_dense(handle: int, q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor], alibi: Optional[Tensor],
              bias: Optional[Tensor], causal: bool, window: tuple[int, int], scale: Optional[float],
              dropout_p: float, deterministic: bool, return_lse: bool) -> Any:
    """One dense call: the op under ``torch.compile``, the target's own autograd in eager.

    Eager keeps the kernels' native backward (no recompute); a compiled graph gets one
    opaque op that selective checkpointing can save.
    """
    if torch.compiler.is_compiling():
        out, lse, _ = torch.ops.primus_ext.dense_attention(
            q, k, v, sink, alibi, bias, handle, causal, window[0], window[1], scale, dropout_p, deterministic,
            return_lse)
        return (out, lse.float()) if return_lse else out
    return target(handle).dense(q, k, v, sink, alibi, bias, causal, window, scale, dropout_p, deterministic,
                                return_lse)


# How max_seqlen reaches the kernel without a recompile per micro-batch: it is an
# ``int`` argument of the op (``SymInt`` in the schema), passed as the caller gives it.
# Dynamo's automatic dynamic shapes turn it symbolic the first time it changes, so a
# compiled graph recompiles once and then serves every value, and the kernel still gets
# the exact bound (no bucketing, which would waste kernel blocks, and no host read of
# cu_seqlens, which would sync).  A caller without max_seqlen passes the token count,
# a static shape.  docs/compile.md shows how to declare both dynamic up front.
def run_packed(handle: int, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_kv: Tensor, max_q: int, max_kv: int,
               sink: Optional[Tensor], alibi: Optional[Tensor], causal: bool, window: tuple[int, int],
               scale: Optional[float], dropout_p: float, deterministic: bool, return_lse: bool) -> Any:
    """One packed (thd) call; like `run_dense`."""
    if torch.compiler.is_compiling():
        out, lse, _ = torch.ops.primus_ext.varlen_attention(
            q, k, v, cu_q, cu_kv, sink, alibi, handle, max_q, max_kv, causal, window[0], window[1], scale,
            dropout_p, deterministic, return_lse)
        return (out, lse.float()) if return_lse else out
    return target(handle).packed(q, k, v, cu_q, cu_kv, max_q, max_kv, sink, alibi, causal, window, scale,
                                 dropout_p, deterministic, return_lse)


FORWARD_OPS = (torch.ops.primus_ext.dense_attention.default, torch.ops.primus_ext.varlen_attention.default)

__all__ = ["CallArgs", "FORWARD_OPS", "KernelPair", "NAMESPACE", "OpTarget", "dense_attention", "kernel_rng",
           "register_target", "run_dense", "run_packed", "target", "varlen_attention"]
