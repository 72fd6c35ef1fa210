"""How q, k and v are stored, as Primus-Turbo reads it from their strides.

Upstream infers one storage layout from the strides of all three tensors and asserts on
any other (``_infer_qkv_format``, ``primus_turbo/pytorch/ops/attention/attention_utils.py``
l.28-83 at a6a16cd); FlyDSL's gate reads that order (sbhd, or bshd with batch 1) and its
kernel wrapper then asserts that each tensor is contiguous sbhd (docs/fidelity.md, fact `flydsl-contiguous`).
Part of the dispatch model (`primus_ext.backends.dispatch`).
"""

from __future__ import annotations

from typing import Any, NamedTuple


def infer_qkv_format(q: Any, k: Any, v: Any) -> str:
    """The storage order of ``[B, S, H, D]``-shaped q, k, v as upstream's ``_infer_qkv_format``
    reads it from the strides (``bshd``, ``sbhd`` or ``bhsd``; ties break toward bshd, so
    batch 1 is bshd); raises `LayoutError` where upstream asserts (attention_utils.py l.28-83)."""
    return _format((q.stride(), k.stride(), v.stride()))


def _format(strides: tuple) -> str:
    formats = []
    for name, stride in zip("qkv", strides):
        s0, s1, s2, s3 = stride
        if s3 != 1:
            raise LayoutError(f"{name} has a non-contiguous head dim (strides {tuple(stride)}); Primus-Turbo "
                              "asserts stride[-1] == 1")
        if s0 >= s1 >= s2:
            formats.append("bshd")
        elif s1 >= s0 >= s2:
            formats.append("sbhd")
        elif s0 >= s2 >= s1:
            formats.append("bhsd")
        else:
            raise LayoutError(f"the layout of {name} (strides {tuple(stride)}) is none of bshd, sbhd, bhsd")
    if formats[0] != formats[1] or formats[0] != formats[2]:
        raise LayoutError(f"q, k, v are stored as {', '.join(formats)}; Primus-Turbo asserts that all three share "
                          "one layout")
    return formats[0]


class LayoutError(ValueError):
    """q, k, v stored in a way upstream's layout inference asserts on (the caller refuses it)."""


class Storage(NamedTuple):
    """What the kernels read of how a dense call's bshd-shaped q, k, v are stored."""

    qkv_format: str
    """Upstream's inferred layout: ``bshd``, ``sbhd`` or ``bhsd``."""
    sbhd: bool
    """sbhd order, or bshd with batch 1: what FlyDSL's gate takes (``_sbhd_layout``)."""
    contiguous_sbhd: bool
    """Each sbhd view contiguous, as FlyDSL's wrapper then asserts."""
    contiguous_bshd: bool
    """Each tensor contiguous as bshd: what gfx942's AITER backward needs (it corrupts gradients of
    the strided view of sbhd memory; docs/fidelity.md, fact `gfx942-strided`)."""


def storage_features(q: Any, k: Any, v: Any) -> Storage:
    """The `Storage` of a dense call's q, k, v, as upstream reads it (raises `LayoutError` where it asserts)."""
    shapes, strides = (q.shape, k.shape, v.shape), (q.stride(), k.stride(), v.stride())
    fmt = _format(strides)
    sbhd = fmt == "sbhd" or (fmt == "bshd" and shapes[0][0] == 1)
    return Storage(fmt, sbhd, sbhd and all(map(_contiguous, shapes, strides, _SBHD)),
                   q.is_contiguous() and k.is_contiguous() and v.is_contiguous())


_SBHD = ((1, 0, 2, 3),) * 3


def _contiguous(shape: Any, stride: Any, order: tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` / ``stride``, permuted by ``order``, is contiguous, as torch's
    ``is_contiguous`` says (no view is made): every dimension of size above 1, innermost first,
    has the stride of those inside it; an empty tensor is contiguous."""
    if 0 in shape:
        return True
    expected = 1
    for dim in reversed(order):
        size = shape[dim]
        if size != 1:
            if stride[dim] != expected:
                return False
            expected *= size
    return True


def kernel_views(query: Any, key: Any, value: Any, storage: str, fmt: str = "sbhd") -> tuple[Any, Any, Any]:
    """The bshd q, k, v a Megatron module hands the kernels, from Megatron's ``fmt`` tensors and the
    plan's ``storage`` (`AttentionPlan.storage`): contiguous sbhd where FlyDSL runs (one copy per
    tensor not already so, before the transpose), contiguous bshd on gfx942, the views as given
    elsewhere.  One function for the modules and the self-test, so both feed the kernels alike."""
    if fmt == "sbhd":
        if storage == "contiguous-sbhd":
            query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
    elif storage == "contiguous-sbhd" and query.shape[0] == 1:
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()  # batch 1: sbhd alike
    if storage == "contiguous-bshd":
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    return query, key, value


def thd_views(query: Any, key: Any, value: Any, storage: str) -> tuple[Any, Any, Any]:
    """The ``[T, H, D]`` q, k, v a Megatron module hands the varlen kernel, as the plan's ``storage`` says:
    contiguous (one copy per tensor not already so) unless ``as-given``, since FlyDSL's varlen kernel reads
    them at fixed strides whatever their own (docs/fidelity.md, fact `flydsl-varlen-strides`), and
    megatron-core's value is a split view.  One function for the modules and the self-test."""
    if storage == "as-given":
        return query, key, value
    return query.contiguous(), key.contiguous(), value.contiguous()


__all__ = ["LayoutError", "Storage", "infer_qkv_format", "kernel_views", "storage_features", "thd_views"]
