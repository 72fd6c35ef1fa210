"""`CallSpec`: one call's scalars and its tensors' metadata, as one value compared by value.

Every check a call site makes on a call before its kernel depends only on this value (the
packed boundaries' values and a hook proof's assumptions excepted, re-checked at every hit:
`primus_ext.call.prepared`), so it is the key of the prepared-call cache: two calls with equal
specs are checked once.

It is a `typing.NamedTuple`, not a frozen dataclass, for the hot path's sake: building it is one
tuple allocation (a frozen dataclass of as many fields took 1.3 µs to build here, against 0.17 µs,
more than half the budget of a cache hit), and comparing or hashing it is the tuple's own C code.
Its fields are read by name, flat: a nested tuple per tensor cost another 0.3 µs per call here.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor


class CallSpec(NamedTuple):
    """One call as the caller passed it: scalars as given (``causal`` / ``scale`` None where left to
    the plan) and q, k, v and sink metadata."""

    packed: bool
    dropout_p: float
    scale: Optional[float]
    causal: Optional[bool]
    window: Optional[tuple]
    deterministic: bool
    return_lse: bool
    q_shape: tuple
    """q's shape; a packed call's token count is left out (it changes per batch), as for k and v."""
    q_stride: tuple
    q_dtype: torch.dtype
    q_device: torch.device
    k_shape: tuple
    k_stride: tuple
    k_dtype: torch.dtype
    k_device: torch.device
    v_shape: tuple
    v_stride: tuple
    v_dtype: torch.dtype
    v_device: torch.device
    sink: Optional[tuple]
    """The sink's ``(shape, dtype, device)``, or None: its strides reach no kernel (it is read as a vector)."""


def call_spec(packed: bool, dropout_p: Any, scale: Any, causal: Any, window: Any, deterministic: Any,
              return_lse: Any, q: Any, k: Any, v: Any, sink: Any) -> Optional[CallSpec]:
    """The spec of a call, or None where a value cannot be part of one (the call then takes the full path,
    which checks and refuses it).

    Types are checked, not just values: ``(2.0, 0) == (2, 0)`` and ``True == 1`` in Python, but the full
    path refuses a float window bound and reads ``causal=1`` as an int, not a flag."""
    if ((causal is not None and type(causal) is not bool) or type(deterministic) is not bool
            or type(return_lse) is not bool or (type(dropout_p) is not float and type(dropout_p) is not int)
            or (scale is not None and type(scale) is not float)):
        return None
    if window is not None and (type(window) is not tuple or len(window) != 2 or type(window[0]) is not int
                               or type(window[1]) is not int):
        return None
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)):
        return None
    if sink is None:
        sink_spec = None
    elif isinstance(sink, Tensor):
        sink_spec = (sink.shape, sink.dtype, sink.device)
    else:
        return None
    # q, k and v each: the kernel route and upstream's layout inference read all three.
    if packed:
        return _new(CallSpec, (True, dropout_p, scale, causal, window, deterministic, return_lse,
                               q.shape[1:], q.stride(), q.dtype, q.device, k.shape[1:], k.stride(), k.dtype, k.device,
                               v.shape[1:], v.stride(), v.dtype, v.device, sink_spec))
    return _new(CallSpec, (False, dropout_p, scale, causal, window, deterministic, return_lse,
                           q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,
                           v.shape, v.stride(), v.dtype, v.device, sink_spec))


_new = tuple.__new__
"""How `call_spec` builds a spec: the tuple's own constructor, without the named one's Python frame."""


__all__ = ["CallSpec", "call_spec"]
