"""The attention kernel call as ``torch.library`` custom ops (namespace ``primus_ext``).

Why ops: a compiled transformer block must not break its graph at attention, and
selective activation checkpointing must be able to *save* attention instead of
recomputing it.  Under ``torch.compile`` each call goes through one op per layout
(`run_call`; eager calls run the target directly, keeping the kernels'
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

import collections
import contextlib
import itertools
import weakref
from typing import Any, Optional, Protocol, Sequence

import torch
from torch import Tensor

from ..backends.base import CallArgs, KernelPair, kernel_rng
from ..backends.dispatch_keys import autograd_keys_lifted
from .checks import assert_boundaries, no_queries
from .op_rng import rng_restored, rng_size, rng_snapshot

NAMESPACE = "primus_ext"


class OpTarget(Protocol):
    """What a handle names: checks, runs and pairs one call (`PlanTarget`, `DirectTarget`)."""

    def check(self, a: CallArgs) -> None:
        """Refuse a call its kernels would fail or compute wrongly (its route on the plan's arch, its
        storage layout): run by the forward op itself, since a traced graph skips the eager check."""
        ...

    def check_in_graph(self, a: CallArgs) -> None:
        """Refuse what only an op inside a compiled graph cannot do (gradients to what hooks capture)."""
        ...

    def run(self, a: CallArgs) -> Any:
        """The call, eagerly, with the backend's own autograd."""
        ...

    def hook_state(self) -> Any:
        """What the hooks the target evaluates read, at a forward (None: it evaluates none)."""
        ...

    def check_hook_state(self, state: Any) -> None:
        """Refuse a backward whose hooks would read other values than the forward's ``state``."""
        ...

    def pair(self, a: CallArgs) -> Optional[KernelPair]:
        """The kernel-level pair of a compiled step, or None (the backward op recomputes)."""
        ...


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
    return target(handle).pair(a)


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


class _ForwardStates:
    """What the hooks read at each compiled forward still awaiting its backward, by the forward's ``rng_state``
    output, which the backward op receives as the same tensor.  An entry goes with that tensor: a forward whose
    graph keeps no backward (inference) frees it at once; the bound is for graphs kept without a backward."""

    LIMIT = 4096

    def __init__(self) -> None:
        self._states: "collections.OrderedDict[int, tuple]" = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._states)

    def put(self, rng: Tensor, state: Optional[tuple]) -> None:
        if state is None:
            return
        key = id(rng)
        self._states[key] = (weakref.ref(rng, lambda _, k=key: self._states.pop(k, None)), state)
        while len(self._states) > self.LIMIT:
            self._states.popitem(last=False)

    def pop(self, rng: Tensor) -> Optional[tuple]:
        found = self._states.pop(id(rng), None)
        return found[1] if found is not None and found[0]() is rng else None


FORWARD_STATES = _ForwardStates()


def _run_forward(handle: int, a: CallArgs, lse_shape: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
    """The forward ops' body: the kernel pair's forward, or the target's eager call."""
    if no_queries(a.q, a.cu_q is not None):  # what an eager call returns, after what it checks of the plan
        target(handle).check_in_graph(a)
        rng = rng_snapshot(a.q.device, a.dropout_p) if a.dropout_p > 0 else kernel_rng(a)
        return (a.q.new_zeros((*a.q.shape[:-1], a.v.shape[-1])), a.q.new_zeros(lse_shape, dtype=_lse_dtype(a.q)),
                rng)
    target(handle).check(a)
    target(handle).check_in_graph(a)
    out, lse, rng = _forward(handle, a, lse_shape)
    FORWARD_STATES.put(rng, target(handle).hook_state())
    return out, lse, rng


def _forward(handle: int, a: CallArgs, lse_shape: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
    pair = _pair(handle, a)
    if pair is not None:
        with torch.no_grad(), autograd_keys_lifted():  # a pair that evaluates a hook vmaps it, as below
            out, lse, rng = pair.forward(a)
        return _contiguous(out), _contiguous(lse.to(_lse_dtype(a.q))), rng
    rng = rng_snapshot(a.q.device, a.dropout_p) if a.dropout_p > 0 else kernel_rng(a)
    with torch.no_grad(), autograd_keys_lifted():  # hooks run under vmap here, which needs functorch's keys
        result = target(handle).run(a)
    out, lse = result if a.return_lse else (result, None)
    # zeros, not garbage: an output nobody asked for must still be deterministic
    lse = lse.to(_lse_dtype(a.q)) if lse is not None else a.q.new_zeros(lse_shape, dtype=_lse_dtype(a.q))
    return _contiguous(out), _contiguous(lse), rng


def _run_backward(handle: int, a: CallArgs, grad_out: Tensor, out: Tensor, lse: Tensor,
                  rng_state: Tensor) -> tuple[Tensor, ...]:
    """The backward ops' body: ``(dq, dk, dv, dsink, dalibi[, dbias])`` from the kernel pair's
    backward, or by differentiating a recompute of the forward (dropout mask replayed)."""
    target(handle).check_hook_state(FORWARD_STATES.pop(rng_state))  # before the hooks are evaluated again
    dense = a.cu_q is None
    like = [a.q, a.k, a.v, a.sink, a.alibi] + ([a.bias] if dense else [])
    if no_queries(a.q, not dense):
        return tuple(_fit(None, t, a.q) for t in like)
    pair = _pair(handle, a)
    if pair is not None:
        with torch.no_grad(), autograd_keys_lifted():
            dq, dk, dv, dsink, dalibi, dbias = pair.backward(a, grad_out, out, lse, rng_state)
        grads = [dq, dk, dv, dsink, dalibi] + ([dbias] if dense else [])
        return tuple(_fit(g, t, a.q) for g, t in zip(grads, like))
    leaves = [_leaf(t) for t in like]
    with _autograd_inside_op(), rng_restored(rng_state if a.dropout_p > 0 else None, a.q.device):
        q, k, v, sink, alibi = leaves[:5]
        again = target(handle).run(a._replace(q=q, k=k, v=v, sink=sink, alibi=alibi, bias=leaves[5] if dense else None))
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
    """Record autograd inside an op implementation: the backward ops recompute the forward to
    differentiate it, and ops below the Autograd keys build no graph even under ``enable_grad``."""
    with autograd_keys_lifted(), torch.enable_grad():
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
    a = _dense_call(locals())
    return _run_forward(handle, a, (q.shape[0], q.shape[2], q.shape[1]))


# The ops' parameters are named as `CallArgs`' fields, but for these: one place maps them, read by name.
_OP_NAMES = {"cu_seqlens_q": "cu_q", "cu_seqlens_kv": "cu_kv", "max_seqlen_q": "max_q", "max_seqlen_kv": "max_kv",
             "alibi_slopes": "alibi"}


def _call(named: dict) -> CallArgs:
    """The `CallArgs` of an op's arguments by their schema names (``window_left`` / ``window_right`` the
    window).  Every field must be named: a field no op parameter carries raises here rather than reach the
    kernels as None (`_dense_call` / `_varlen_call` give what their op does not take)."""
    fields = {_OP_NAMES.get(name, name): value for name, value in named.items()}
    fields["window"] = (fields.pop("window_left"), fields.pop("window_right"))
    return CallArgs(**{name: fields[name] for name in CallArgs._fields})


def _dense_call(named: dict) -> CallArgs:
    q, k = named["q"], named["k"]
    return _call({"cu_seqlens_q": None, "cu_seqlens_kv": None, "max_seqlen_q": q.shape[1],
                  "max_seqlen_kv": k.shape[1], **{n: named[n] for n in _DENSE_ARGS}})


def _varlen_call(named: dict) -> CallArgs:
    return _call({"bias": None, **{n: named[n] for n in _VARLEN_ARGS}})


def _schema_names(op: Any) -> tuple[str, ...]:
    """An op's parameter names, in its schema's order (what the positional calls below follow)."""
    return tuple(argument.name for argument in op._opoverload._schema.arguments)


def _by_name(names: Sequence[str], args: tuple) -> dict:
    return dict(zip(names, args))


_DENSE_NAMES = _schema_names(dense_attention)  # read once: a traced call reads the constant, not the schema
_DENSE_ARGS = tuple(n for n in _DENSE_NAMES if n != "handle")


@dense_attention.register_fake
def _(*args):
    a = _dense_call(_by_name(_DENSE_NAMES, args))
    batch, q_len, heads = a.q.shape[0], a.q.shape[1], a.q.shape[2]
    out = a.q.new_empty(batch, q_len, heads, a.v.shape[-1])
    lse = a.q.new_empty((batch, heads, q_len), dtype=_lse_dtype(a.q))
    return out, lse, _fake_rng(a)


@torch.library.custom_op(f"{NAMESPACE}::dense_attention_backward", mutates_args=())
def dense_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                             sink: Optional[Tensor], alibi_slopes: Optional[Tensor], bias: Optional[Tensor],
                             rng_state: Tensor, handle: int, causal: bool, window_left: int, window_right: int,
                             scale: Optional[float], dropout_p: float, deterministic: bool,
                             return_lse: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    a = _dense_call(locals())
    return _run_backward(handle, a, grad_out, out, lse, rng_state)  # type: ignore[return-value]


def _like(t: Optional[Tensor], q: Tensor) -> Tensor:
    """A gradient's metadata: ``empty_like(t)``, or empty where there is no ``t``."""
    return torch.empty_like(t) if t is not None else q.new_empty(0)


_DENSE_BACKWARD_NAMES = _schema_names(dense_attention_backward)


@dense_attention_backward.register_fake
def _(*args):
    a = _dense_call(_by_name(_DENSE_BACKWARD_NAMES, args))
    return _like(a.q, a.q), _like(a.k, a.q), _like(a.v, a.q), _like(a.sink, a.q), _like(a.alibi, a.q), _like(a.bias, a.q)


def _setup(names: Sequence[str], ctx, inputs, output) -> None:
    """Saves a forward op's inputs (``names``: its schema's) by name and its ``(out, lse, rng_state)`` as the
    backward op names them."""
    named = _by_name(names, inputs)
    named.update(out=output[0], lse=output[1], rng_state=output[2])
    ctx.mark_non_differentiable(output[1], output[2])
    tensors = [n for n, value in named.items() if value is None or isinstance(value, Tensor)]
    ctx.save_for_backward(*(named[n] for n in tensors))
    ctx.tensor_names = tensors
    ctx.others = {n: value for n, value in named.items() if n not in tensors}


def _backward(names: Sequence[str], backward: Any, backward_names: Sequence[str], ctx, grad_out: Tensor) -> tuple:
    """The backward op on what `_setup` saved; a gradient for each forward input (``names``), by name (None for
    what is not differentiable, an empty gradient for a tensor not given)."""
    named = dict(zip(ctx.tensor_names, ctx.saved_tensors), grad_out=grad_out, **ctx.others)
    grads = backward(*[named[n] for n in backward_names])
    by_input = dict(zip(_GRADIENTS, grads))
    return tuple((by_input[n] if n in ("q", "k", "v") else _none_if_empty(by_input[n])) if n in by_input else None
                 for n in names)  # q, k, v always have a gradient, empty with them; an optional input's empty one is none


_GRADIENTS = ("q", "k", "v", "sink", "alibi_slopes", "bias")
"""The inputs the backward ops return a gradient for, in their order (a varlen op takes no bias)."""


def _dense_setup(ctx, inputs, output) -> None:
    _setup(_DENSE_NAMES, ctx, inputs, output)


def _dense_backward(ctx, grad_out, _grad_lse, _grad_rng):
    return _backward(_DENSE_NAMES, torch.ops.primus_ext.dense_attention_backward, _DENSE_BACKWARD_NAMES, ctx,
                     grad_out)


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
    a = _varlen_call(locals())
    return _run_forward(handle, a, (q.shape[1], q.shape[0]))


_VARLEN_NAMES = _schema_names(varlen_attention)
_VARLEN_ARGS = tuple(n for n in _VARLEN_NAMES if n != "handle")


@varlen_attention.register_fake
def _(*args):
    a = _varlen_call(_by_name(_VARLEN_NAMES, args))
    tokens, heads = a.q.shape[0], a.q.shape[1]
    out = a.q.new_empty(tokens, heads, a.v.shape[-1])
    lse = a.q.new_empty((heads, tokens), dtype=_lse_dtype(a.q))
    return out, lse, _fake_rng(a)


@torch.library.custom_op(f"{NAMESPACE}::varlen_attention_backward", mutates_args=())
def varlen_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                              cu_seqlens_q: Tensor, cu_seqlens_kv: Tensor, sink: Optional[Tensor],
                              alibi_slopes: Optional[Tensor], rng_state: Tensor, handle: int, max_seqlen_q: int,
                              max_seqlen_kv: int, causal: bool, window_left: int, window_right: int,
                              scale: Optional[float], dropout_p: float, deterministic: bool,
                              return_lse: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    a = _varlen_call(locals())
    return _run_backward(handle, a, grad_out, out, lse, rng_state)  # type: ignore[return-value]


_VARLEN_BACKWARD_NAMES = _schema_names(varlen_attention_backward)


@varlen_attention_backward.register_fake
def _(*args):
    a = _varlen_call(_by_name(_VARLEN_BACKWARD_NAMES, args))
    return _like(a.q, a.q), _like(a.k, a.q), _like(a.v, a.q), _like(a.sink, a.q), _like(a.alibi, a.q)


def _varlen_setup(ctx, inputs, output) -> None:
    _setup(_VARLEN_NAMES, ctx, inputs, output)


def _varlen_backward(ctx, grad_out, _grad_lse, _grad_rng):
    return _backward(_VARLEN_NAMES, torch.ops.primus_ext.varlen_attention_backward, _VARLEN_BACKWARD_NAMES, ctx,
                     grad_out)


varlen_attention.register_autograd(_varlen_backward, setup_context=_varlen_setup)


# How max_seqlen reaches the kernel without a recompile per micro-batch: it is an
# ``int`` argument of the op (``SymInt`` in the schema), passed as the caller gives it.
# Dynamo's automatic dynamic shapes turn it symbolic the first time it changes, so a
# compiled graph recompiles once and then serves every value, and the kernel still gets
# the exact bound (no bucketing, which would waste kernel blocks, and no host read of
# cu_seqlens, which would sync).  A caller without max_seqlen passes the token count,
# a static shape.  docs/compile.md shows how to declare both dynamic up front.
def run_call(handle: int, a: CallArgs) -> Any:
    """One checked call: the op of its layout under ``torch.compile``, the target's own autograd in eager.

    Eager keeps the kernels' native backward (no recompute); a compiled graph gets one
    opaque op that selective checkpointing can save.
    """
    if not torch.compiler.is_compiling():
        return target(handle).run(a)
    fields = dict(a._asdict(), handle=handle, window_left=a.window[0], window_right=a.window[1])
    op, names = ((torch.ops.primus_ext.dense_attention, _DENSE_NAMES) if a.cu_q is None else
                 (torch.ops.primus_ext.varlen_attention, _VARLEN_NAMES))
    out, lse, _ = op(*[fields[_OP_NAMES.get(name, name)] for name in names])
    return (out, lse.float()) if a.return_lse else out


FORWARD_OPS = (torch.ops.primus_ext.dense_attention.default, torch.ops.primus_ext.varlen_attention.default)

__all__ = ["CallArgs", "FORWARD_OPS", "KernelPair", "NAMESPACE", "OpTarget", "dense_attention", "kernel_rng",
           "register_target", "run_call", "target", "varlen_attention"]
