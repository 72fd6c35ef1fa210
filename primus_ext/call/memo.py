"""The adapter's fast path: a call that looks like the last validated one skips the checks.

Every check the adapter makes per call (dtypes, devices, ranks, shapes, heads, window,
sink shape, the plan's binding of the call's causal/window, the arch's kernel route)
depends only on the tensors' metadata and the scalar arguments.  So once a call has
passed them, an eager call with the same metadata and scalars (compared by value, with
no host read) would pass them again and goes straight to a runner bound to the
backend's kernel entry with its keyword arguments prepared.  Packed boundaries are
values, not metadata: their on-device check still runs, memoised per tensor as on the
slow path (`call_checks`).  Anything else (a bias, explicit ALiBi slopes, hooks whose
proof rests on values that may change, int64 or missing-attribute boundaries,
``torch.compile``) takes the full path.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from .checks import assert_boundaries

Runner = Callable[..., Any]


class CallMemo:
    """The last validated call of one adapter, and the runner that makes it again."""

    __slots__ = ("q_shape", "k_shape", "v_shape", "dtype", "device", "strides", "scalars", "sink_shape",
                 "sink_dtype", "sink_cast", "same_cu", "max_given", "equal_documents", "run")

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, scalars: tuple, sink: Optional[Tensor], run: Runner,
                 packed: bool = False, same_cu: bool = False, max_given: tuple = (), equal_documents: bool = False
                 ) -> None:
        tail = slice(1, None) if packed else slice(None)
        self.q_shape, self.k_shape, self.v_shape = q.shape[tail], k.shape[tail], v.shape[tail]
        self.dtype, self.device = q.dtype, q.device
        # q, k and v each: the kernel route (FlyDSL's contiguous sbhd) and upstream's layout
        # inference read all three tensors' strides.
        self.strides = None if packed else (q.stride(), k.stride(), v.stride())
        self.scalars = scalars
        self.sink_shape = None if sink is None else sink.shape
        self.sink_dtype = None if sink is None else sink.dtype
        self.sink_cast = sink is not None and sink.dtype is not torch.float32
        self.same_cu, self.max_given, self.run = same_cu, max_given, run
        self.equal_documents = equal_documents  # packed_equal_documents (B36): checked as `check_packed` does

    def _tensors(self, q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor]) -> bool:
        """dtype, device and sink of q, k, v as remembered (shapes are the caller's part)."""
        # ``device`` itself, not ``get_device()``: that is -1 for the CPU and for meta alike.
        dtype, device = self.dtype, self.device
        if not (q.dtype is dtype and k.dtype is dtype and v.dtype is dtype
                and q.device == device and k.device == device and v.device == device):
            return False
        if sink is None:
            return self.sink_shape is None
        return sink.dtype is self.sink_dtype and sink.shape == self.sink_shape and sink.device == device

    def _same_scalars(self, dropout_p: Any, scale: Any, causal: Any, window_size: Any, deterministic: Any,
                      return_lse: Any) -> bool:
        # Identity for the flags and type checks first: a tensor argument never reaches an
        # ``==`` that would read it on the host, and (2.0, 0) equal to (2, 0) is still not
        # taken for it (the full path refuses a bound that is not an int).
        s = self.scalars
        return (causal is s[2] and deterministic is s[4] and return_lse is s[5]
                and (window_size is s[3] or (type(window_size) is tuple and window_size == s[3]
                                             and all(type(x) is int for x in window_size)))
                and type(dropout_p) is type(s[0]) and dropout_p == s[0]
                and (scale is s[1] or (type(scale) is float and scale == s[1])))

    def dense(self, q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor], dropout_p: Any, scale: Any,
              causal: Any, window_size: Any, deterministic: Any, return_lse: Any) -> Any:
        """The output of an equal call, or `MISS`."""
        # Each tensor attribute read costs ~0.1 us: the ten below are most of the fast path.
        try:
            same = (self._same_scalars(dropout_p, scale, causal, window_size, deterministic, return_lse)
                    and q.shape == self.q_shape and k.shape == self.k_shape and v.shape == self.v_shape
                    and (q.stride(), k.stride(), v.stride()) == self.strides and self._tensors(q, k, v, sink))
        except (AttributeError, TypeError):  # not tensors: the full path says what is wrong
            return MISS
        if not same:
            return MISS
        return self.run(q, k, v, sink.float() if self.sink_cast else sink)  # type: ignore[union-attr]

    def packed(self, q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor], cu_q: Any, cu_kv: Any, max_q: Any,
               max_kv: Any, dropout_p: Any, scale: Any, causal: Any, window_size: Any, deterministic: Any,
               return_lse: Any) -> Any:
        """Like `dense`, for a thd call; the boundaries' values are checked (memoised per tensor)."""
        try:
            same = (self._same_scalars(dropout_p, scale, causal, window_size, deterministic, return_lse)
                    and q.shape[1:] == self.q_shape and k.shape[1:] == self.k_shape and v.shape[1:] == self.v_shape
                    and k.shape[0] == v.shape[0] and self._tensors(q, k, v, sink))
        except (AttributeError, TypeError):
            return MISS
        if not same:
            return MISS
        if (cu_q is cu_kv) is not self.same_cu or (max_q is not None, max_kv is not None) != self.max_given:
            return MISS
        if not _boundaries_like(cu_q, self.device):
            return MISS
        if cu_q is cu_kv:
            if k.shape[0] != q.shape[0]:  # one boundary tensor cannot describe two token counts
                return MISS
        elif not (_boundaries_like(cu_kv, self.device) and cu_kv.shape == cu_q.shape):
            return MISS
        max_q = q.shape[0] if max_q is None else max_q
        max_kv = k.shape[0] if max_kv is None else max_kv
        if not (_positive_int(max_q) and _positive_int(max_kv)):
            return MISS
        if self.equal_documents and ((cu_q.shape[0] - 1) * max_q != q.shape[0]
                                     or (cu_kv.shape[0] - 1) * max_kv != k.shape[0]):
            return MISS  # the full path refuses it (B36)
        assert_boundaries("cu_seqlens_q", cu_q, q.shape[0], max_q)
        if cu_kv is not cu_q:
            assert_boundaries("cu_seqlens_kv", cu_kv, k.shape[0], max_kv)
        return self.run(q, k, v, cu_q, cu_kv, max_q, max_kv, sink.float() if self.sink_cast else sink)  # type: ignore[union-attr]


MISS = object()
"""What `CallMemo.dense` / `CallMemo.packed` return when the call must take the full path."""


def _boundaries_like(cu: Any, device: torch.device) -> bool:
    return (type(cu) is Tensor and cu.dtype is torch.int32 and cu.dim() == 1 and cu.shape[0] >= 2
            and cu.device == device)


def _positive_int(value: Any) -> bool:
    return type(value) is int and value >= 1


def scalars_key(dropout_p: Any, scale: Any, causal: Any, window_size: Any, deterministic: Any,
                return_lse: Any) -> Optional[tuple]:
    """The scalar arguments as a memo key, or None when one is not a plain value (then no memo).
    ``causal`` / ``window_size`` None (the plan's, the adapter's default) are plain values too."""
    if causal is not None and type(causal) is not bool:
        return None
    if window_size is not None and (type(window_size) is not tuple or len(window_size) != 2
                                    or not all(type(x) is int for x in window_size)):
        return None
    if type(deterministic) is not bool:
        return None
    if type(return_lse) is not bool or type(dropout_p) not in (float, int):
        return None
    if scale is not None and type(scale) is not float:
        return None
    return (dropout_p, scale, causal, window_size, deterministic, return_lse)


__all__ = ["CallMemo", "MISS", "Runner", "scalars_key"]
