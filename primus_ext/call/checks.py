"""Checks of one attention call's own inputs, the same on every backend (B34).

What a caller hands the adapter per call (tensor dtypes and ranks, ``window_size``,
packed boundaries) is honoured or refused here with the project's error, before any
kernel sees it; a kernel's own ``ValueError`` or a torch ``RuntimeError`` from deep
inside would name neither the argument nor the way out.

Packed boundaries are checked without a host sync: the value checks (start at 0,
never decrease, end at the token count, no document longer than ``max_seqlen``) are
one on-device assertion.  On CPU it fails at once and is raised as our error; on a GPU
it fails as a device-side assert carrying the same text, asynchronously.
"""

from __future__ import annotations

import operator
from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from .. import refusals as R
from ..attention.pattern import Pattern
from ..backends.check_op import assert_on_device, check_same_boundaries, tensor_version  # noqa: F401 (re-exported)
from ..errors import short_repr
from ..refusals import Refusal, refuse
from .facts import FACTS

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_heads(q: Tensor, k: Tensor, heads: int, kv_heads: int) -> None:
    """The call's query and key/value head counts are those the layer was planned for."""
    if q.shape[-2] != heads or k.shape[-2] != kv_heads:
        # Hooks are proven for the planned heads only, and sinks / slopes are per head.
        raise refuse(R.HEADS, q_heads=q.shape[-2], kv_heads=k.shape[-2], heads=heads, planned_kv=kv_heads)


def check_qkv(q: Any, k: Any, v: Any, ranks: tuple[int, ...] = (3, 4), packed: bool = False,
              batch_dim: Optional[int] = None) -> None:
    """q, k, v are floating tensors of one dtype, one device and one rank (one of ``ranks``: thd or bshd), of
    shapes that fit (one batch size at ``batch_dim``, where the layout has one) and head dims of at least 1."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise refuse(R.QKV_TYPE, name=name, kind=type(t).__name__)
        if t.dtype not in _FLOATS:
            raise refuse(R.QKV_DTYPE, name=name, dtype=t.dtype)
    if not (q.dtype == k.dtype == v.dtype):
        raise refuse(R.MIXED_DTYPES, q=q.dtype, k=k.dtype, v=v.dtype)
    if not (q.device == k.device == v.device):
        raise refuse(R.MIXED_DEVICES, q=q.device, k=k.device, v=v.device)
    if not (q.dim() == k.dim() == v.dim()):
        raise refuse(R.MIXED_RANKS, q=q.dim(), k=k.dim(), v=v.dim())
    if q.dim() not in ranks:  # before any shape is read: a 0-d or 2-D call has no head axis
        raise refuse(R.PACKED_RANK if packed else R.DENSE_RANK, rank=q.dim())
    if q.shape[-1] != k.shape[-1] or k.shape[:-1] != v.shape[:-1] or (
            batch_dim is not None and q.shape[batch_dim] != k.shape[batch_dim]):
        raise refuse(R.QKV_SHAPES, q=tuple(q.shape), k=tuple(k.shape), v=tuple(v.shape))
    if q.shape[-1] == 0 or v.shape[-1] == 0:
        raise refuse(R.HEAD_DIM, q=tuple(q.shape), k=tuple(k.shape), v=tuple(v.shape))


def check_head_dims(q: Tensor, v: Tensor, head_dim: int, head_dim_v: int) -> None:
    """The call's head dims are those the layer was planned for (its routes, sinks and hooks were checked there)."""
    if q.shape[-1] != head_dim or v.shape[-1] != head_dim_v:
        raise refuse(R.PLANNED_DIMS, head_dim=head_dim, head_dim_v=head_dim_v, got=q.shape[-1], got_v=v.shape[-1])


def no_queries(q: Tensor, packed: bool) -> bool:
    """A call with nothing to compute: no batch row, or no query position (no token, packed)."""
    return q.shape[0] == 0 or (not packed and q.shape[1] == 0)


def empty_result(q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor], packed: bool, return_lse: bool) -> Any:
    """What the reference backend returns for a call without queries: an empty output (``[.., Dv]``) and lse,
    still part of the autograd graph of q, k, v and the sink (their gradients are zeros), with no kernel run."""
    shape = (*q.shape[:-1], v.shape[-1])
    out = q.new_zeros(shape) + (q.sum() + k.sum() + v.sum()).to(q.dtype) * 0
    if sink is not None:
        out = out + sink.sum().to(q.dtype) * 0
    if not return_lse:
        return out
    lse_shape = (q.shape[1], q.shape[0]) if packed else (q.shape[0], q.shape[2], q.shape[1])
    return out, q.new_zeros(lse_shape, dtype=torch.float32)


def check_bias(bias: Any, q: Tensor, k: Tensor, *, kernel_shape: bool) -> None:
    """A bias is a floating tensor on q's device that broadcasts to ``[B, Hq, Sq, Skv]``; with
    ``kernel_shape`` (Primus-Turbo's kernels) exactly one ``[Sq, Skv]`` matrix in q's dtype."""
    if bias is None:
        return
    q_len, kv_len = q.shape[1], k.shape[1]
    if not isinstance(bias, Tensor) or bias.dtype not in _FLOATS or bias.device != q.device:
        got = f"{bias.dtype} on {bias.device}" if isinstance(bias, Tensor) else type(bias).__name__
        raise refuse(R.BIAS_TYPE, device=q.device, got=got)
    if kernel_shape:
        if tuple(bias.shape) != (q_len, kv_len) or bias.dtype != q.dtype:
            raise refuse(R.BIAS_KERNEL, q_len=q_len, kv_len=kv_len, dtype=q.dtype, shape=tuple(bias.shape),
                         got=bias.dtype)
        return
    full = (q.shape[0], q.shape[2], q_len, kv_len)
    if bias.dim() > 4 or any(b not in (1, f) for b, f in zip(reversed(bias.shape), reversed(full))):
        raise refuse(R.BIAS_SHAPE, shape=tuple(bias.shape), full=list(full))


def _per_head(t: Any, q: Tensor, kind: Refusal, shape: Refusal) -> None:
    """``t`` is a floating tensor of one value per query head, on q's device (else ``kind`` or
    ``shape`` refuses it)."""
    heads = q.shape[-2]
    if not isinstance(t, Tensor) or t.dtype not in _FLOATS:
        got = t.dtype if isinstance(t, Tensor) else type(t).__name__
        raise refuse(kind, got=got, heads=heads)
    if tuple(t.shape) != (heads,) or t.device != q.device:
        raise refuse(shape, heads=heads, device=q.device, shape=tuple(t.shape), got=t.device)


def check_sink(sink: Any, q: Tensor) -> None:
    """A sink: one floating logit per query head, on q's device."""
    _per_head(sink, q, R.SINK_TYPE, R.SINK_SHAPE)


def check_alibi(slopes: Any, q: Tensor, *, kernel_dtype: bool) -> None:
    """ALiBi slopes: one floating value per query head, on q's device; fp32 for Primus-Turbo."""
    _per_head(slopes, q, R.ALIBI_TYPE, R.ALIBI_SHAPE)
    if kernel_dtype and slopes.dtype != torch.float32:
        raise refuse(R.ALIBI_DTYPE, dtype=slopes.dtype)


def check_kernel_alibi(pattern: Pattern, return_lse: bool, *, symmetric: bool = False,
                       lengths: Optional[Tuple[int, int]] = None) -> None:
    """ALiBi on Primus-Turbo only where its kernels compute the hook's (or the slopes') bias (B35).

    AITER's CK kernels add ``-slope * |q - kv|`` for any mask but plain causal and ``+slope * kv`` for
    plain causal; with a sink its Triton kernels add ``-slope * |q + Skv - Sq - kv|`` for every mask
    (composable_kernel ``block_position_encoding.hpp``; aiter ``_compute_alibi_block``).  So ALiBi
    ``slope * (kv - q)`` (explicit slopes mean that here, as on the reference) runs where no key lies
    right of the diagonal, the symmetric form on every mask; both with equal q and kv lengths (the
    kernels align it bottom-right, a hook top-left); the lse never (plain causal CK adds ``slope * q``).
    """
    if not symmetric and pattern.right != 0:
        raise refuse(R.ALIBI_RIGHT, mask=pattern.describe())
    if lengths is not None and lengths[0] != lengths[1]:
        raise refuse(R.ALIBI_LENGTHS, q_len=lengths[0], kv_len=lengths[1])
    if return_lse:
        raise refuse(R.ALIBI_LSE)


def check_packing(declared: Optional[bool], packed_call: bool, eod_documents: bool = False,
                  mask_documents: bool = False) -> None:
    """A call of the kind the layer declared (``packed_sequences``): the plan checked only those
    calls' kernels, and a dense call on a layer whose documents come from EOD tokens
    (``reset_attention_mask``) would attend across them (B25, B34).  A plan whose documents come
    in Megatron's mask (``mask_documents``) gets its dense calls as THD from the Megatron core: a
    dense flash-style call has no mask to read them from."""
    if mask_documents:
        if not packed_call:
            raise refuse(R.DOCUMENT_MASK_MISSING)
        return  # the Megatron core's conversion of a dense call (its own check refused a thd call not declared)
    if declared is None or declared is packed_call:
        return
    if packed_call:
        raise refuse(R.PACKED_CALL)
    raise refuse(R.EOD_DENSE_CALL if eod_documents else R.DENSE_CALL)


def check_dropout(dropout_p: Any) -> float:
    """The dropout probability as a float in [0, 1)."""
    try:
        p = float(dropout_p)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        p = float("nan")
    if not 0.0 <= p < 1.0:
        raise refuse(R.DROPOUT, got=dropout_p)
    return p


def check_window(window_size: Any) -> Tuple[int, int]:
    """``window_size`` as two ints, each -1 (unbounded) or >= 0."""
    try:  # operator.index: integers only, so 2.5 is refused rather than truncated to 2
        left, right = (operator.index(window_size[0]), operator.index(window_size[1]))
        if len(window_size) != 2:
            raise ValueError
    except (TypeError, ValueError, IndexError, OverflowError, RuntimeError):
        raise refuse(R.WINDOW, got=window_size) from None
    if left < -1 or right < -1 or left > INT32_MAX or right > INT32_MAX:
        raise refuse(R.WINDOW_BOUND, got=window_size)
    return left, right


INT32_MAX = 2**31 - 1
"""The kernels take lengths and window bounds as int32."""


def check_scale(scale: Any) -> Optional[float]:
    """``softmax_scale`` as a finite positive Python float, or None (the plan's)."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0.0 < float(scale) < float("inf"):
        raise refuse(R.SCALE, got=short_repr(scale))
    return float(scale)


def _boundaries(name: str, cu: Any, device: torch.device) -> Tensor:
    if type(cu) is Tensor and cu.dtype is torch.int32 and cu.dim() == 1 and cu.shape[0] >= 2 and cu.device == device:
        return cu  # the kernels' own form, what almost every call brings: one test of each
    if not isinstance(cu, Tensor):
        raise refuse(R.CU_TYPE, name=name, kind=type(cu).__name__)
    if cu.dim() != 1 or cu.numel() < 2:
        raise refuse(R.CU_SHAPE, name=name, shape=tuple(cu.shape))
    if cu.dtype not in (torch.int32, torch.int64):
        raise refuse(R.CU_DTYPE, name=name, dtype=cu.dtype)
    if cu.device != device:
        raise refuse(R.CU_DEVICE, name=name, device=cu.device, inputs=device)
    return cu


def _int32(cu: Tensor) -> Tensor:
    """torch's default integer type cast for the kernels: one small on-device cast, documented.
    Done after the value check, which bounds every entry by the token count, so nothing wraps."""
    return cu.to(torch.int32) if cu.dtype is torch.int64 else cu


def _max_seqlen(name: str, value: Any, tokens: int, device: torch.device) -> Any:
    if type(value) is int and 1 <= value <= INT32_MAX:
        return value
    if value is None:
        return tokens  # bounds every document, with no host read of the boundaries
    if isinstance(value, Tensor):
        if torch.compiler.is_compiling():
            raise refuse(R.MAX_SEQLEN_TRACED, name=name)
        if value.numel() != 1 or value.dtype.is_floating_point or value.device != device:
            raise refuse(R.MAX_SEQLEN_TENSOR, name=name, shape=tuple(value.shape), dtype=value.dtype,
                         device=value.device)
        return value
    if isinstance(value, bool) or not isinstance(value, int) or not (1 if tokens else 0) <= value <= INT32_MAX:
        raise refuse(R.MAX_SEQLEN, name=name, got=short_repr(value))
    return value


def check_packed(q: Tensor, k: Tensor, cu_q: Any, cu_kv: Any, max_q: Any, max_kv: Any, *,
                 equal_documents: bool = False, kv: str = "kv") -> Tuple[Tensor, Tensor, Any, Any]:
    """Validated ``(cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv)`` of a thd call.

    The same object comes back for q and kv when one tensor was given for both, so a
    kernel (and `turbo`'s same-boundaries check) still sees one tensor.  With
    ``equal_documents`` (``packed_equal_documents``, B36) every document must be
    ``max_seqlen`` long: ``documents * max_seqlen == tokens`` here, from the shapes, and
    the on-device check that no document is longer make that exact, without a host read.
    ``kv`` names the key side as the caller's API does: ``kv`` (Megatron's ``cu_seqlens_kv``),
    ``k`` (``flash_attn_varlen_func``'s ``cu_seqlens_k``).
    """
    same = cu_q is cu_kv
    tokens_q, tokens_kv, device = q.shape[0], k.shape[0], q.device
    if same and tokens_kv != tokens_q:
        raise refuse(R.SHARED_BOUNDARIES, q_tokens=tokens_q, kv_tokens=tokens_kv, kv_name=f"cu_seqlens_{kv}")
    cu_q = _boundaries("cu_seqlens_q", cu_q, device)
    if same:
        cu_kv = cu_q
    else:
        cu_kv = _boundaries(f"cu_seqlens_{kv}", cu_kv, device)
        if cu_q.shape[0] != cu_kv.shape[0]:
            raise refuse(R.DOCUMENT_COUNT, q_documents=cu_q.shape[0] - 1, kv_documents=cu_kv.shape[0] - 1,
                         kv_name=f"cu_seqlens_{kv}")
    max_q = _max_seqlen("max_seqlen_q", max_q, tokens_q, device)
    max_kv = _max_seqlen(f"max_seqlen_{kv}", max_kv, tokens_kv, device)
    if equal_documents:
        _check_equal_documents("q", cu_q, tokens_q, max_q)
        _check_equal_documents(kv, cu_kv, tokens_kv, max_kv)
    assert_boundaries("cu_seqlens_q", cu_q, tokens_q, max_q)
    if not same:
        assert_boundaries(f"cu_seqlens_{kv}", cu_kv, tokens_kv, max_kv)
    cu_q = _int32(cu_q)
    return cu_q, (cu_q if same else _int32(cu_kv)), max_q, max_kv


def _check_equal_documents(side: str, cu: Tensor, tokens: int, longest: Any) -> None:
    documents = cu.numel() - 1
    if isinstance(longest, Tensor):
        raise refuse(R.EQUAL_MAX_TENSOR, side=side)
    if documents * longest != tokens:
        raise refuse(R.EQUAL_LENGTHS, side=side, documents=documents, longest=longest, total=documents * longest,
                     tokens=tokens)


def assert_boundaries(name: str, cu: Tensor, tokens: int, longest: Any) -> None:
    """The values of ``cu`` (start 0, no decrease, end at ``tokens``, no document over ``longest``),
    checked on the device once per tensor: every layer of a step gets the same tensor, so the
    value check runs once per step, not once per layer and call (`facts.FACTS`, shared with
    every other call site).  A tensor ``longest`` is checked every time.  Under
    ``torch.compile`` nothing is traced: the varlen op checks its boundaries itself when it
    runs (`ops.varlen_attention`)."""
    if torch.compiler.is_compiling():
        return
    if isinstance(longest, Tensor):
        _check_boundaries(name, cu, tokens, longest)
        return
    if boundaries_proven(cu, tokens, longest):
        return
    _check_boundaries(name, cu, tokens, longest)
    FACTS.learn(cu, ("boundaries", tokens, longest))


def boundaries_proven(cu: Tensor, tokens: int, longest: int) -> bool:
    """Whether `assert_boundaries` proved ``cu`` for these ``tokens`` and ``longest``, as it is now."""
    return FACTS.known(cu, ("boundaries", tokens, longest))


def _check_boundaries(name: str, cu: Tensor, tokens: int, longest: Any) -> None:
    # Lengths at full size (entry 0 set to 0): a slice of n - 1 entries would make a compiled
    # graph specialise on n == 2, one more recompile per batch shape.
    first = torch.arange(cu.numel(), device=cu.device) == 0
    lengths = torch.where(first, torch.zeros_like(cu), cu - cu.roll(1))
    ok = (cu[0] == 0) & (cu[-1] == tokens) & (lengths >= 0).all() & (lengths.max() <= longest)
    values = dict(name=name, max_name=name.replace("cu_seqlens", "max_seqlen"), tokens=tokens,
                  longest=longest if not isinstance(longest, Tensor) else "the tensor given")
    why = R.BOUNDARIES.reason_for(**values).reason.removesuffix(".")  # the device assert's text
    assert_on_device(ok, why, lambda: refuse(R.BOUNDARIES, **values))


__all__ = ["assert_boundaries", "assert_on_device", "boundaries_proven", "check_alibi", "check_bias", "check_dropout",
           "check_heads", "check_kernel_alibi", "check_packed", "check_packing", "check_qkv", "check_scale",
           "check_sink", "check_window", "tensor_version"]
