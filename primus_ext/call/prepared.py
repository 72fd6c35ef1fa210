"""The prepared-call cache: a call equal to one already checked skips the checks.

Every check a call site (the adapter) makes per call depends only on the call's
`~primus_ext.call.spec.CallSpec`: the scalar arguments and the q, k, v and sink metadata
(shapes, strides, dtypes, devices), compared by value with no host read.  So a call whose spec
was checked once goes straight to the runner prepared for it (the backend's kernel entry with
its keyword arguments bound).  What the spec cannot hold is checked again at every hit:

* packed boundaries are values: they go through the full path's own check (`check_packed`, one
  implementation), whose on-device value check runs once per tensor, shared by every layer
  (`primus_ext.call.facts`), and ``max_seqlen`` is read as passed;
* a hook proof that rests on a module global or a captured tensor re-checks them
  (`primus_ext.hooks.trace.Assumption`): a broken one takes the full path,
  which refuses.

A call with a bias or explicit ALiBi slopes (tensors a runner would have to bind), with a
scalar that is not a plain Python value, or under ``torch.compile``, takes the full path.
One rule evicts: beyond `LIMIT` specs the oldest goes.  ``hits`` / ``misses`` count calls
served from the cache and calls that took the full path.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from .checks import check_packed
from .spec import CallSpec

Runner = Callable[..., Any]
LIMIT = 16
"""Specs one call site keeps: a layer makes one or two kinds of call, step after step."""


class Prepared:
    """One checked call: the runner that makes it again and what a hit must still check."""

    __slots__ = ("run", "cast_sink", "assumptions", "same_cu", "max_given", "equal_documents")

    def __init__(self, run: Runner, sink: Optional[Tensor], assumptions: tuple = (), *, same_cu: bool = False,
                 max_given: tuple = (), equal_documents: bool = False) -> None:
        self.run = run
        self.cast_sink = sink is not None and sink.dtype is not torch.float32  # fp32 for the kernels (B12)
        self.assumptions = assumptions
        self.same_cu, self.max_given, self.equal_documents = same_cu, max_given, equal_documents

    def holds(self) -> bool:
        """Whether every value a hook proof rests on is as it was."""
        for assumption in self.assumptions:
            if not assumption.holds():
                return False
        return True

    def dense(self, q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor]) -> Any:
        if self.assumptions and not self.holds():
            return MISS
        return self.run(q, k, v, sink.float() if self.cast_sink else sink)  # type: ignore[union-attr]

    def packed(self, q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor], cu_q: Any, cu_kv: Any, max_q: Any,
               max_kv: Any) -> Any:
        """Like `dense`, for a thd call: the boundaries as passed go through the full path's own check
        (`check_packed`: their values once per tensor and state, shared by every layer, `primus_ext.call.facts`),
        which refuses here what it refuses there.  What the runner was prepared for (one boundary tensor or two,
        ``max_seqlen`` given or not) and what the full path checks before the boundaries (tokens) take it."""
        if (cu_q is cu_kv) is not self.same_cu or (max_q is not None, max_kv is not None) != self.max_given:
            return MISS
        if q.shape[0] == 0 or k.shape[0] != v.shape[0]:  # no queries, or a k / v refusal of the full path
            return MISS
        cu_q, cu_kv, max_q, max_kv = check_packed(q, k, cu_q, cu_kv, max_q, max_kv,
                                                  equal_documents=self.equal_documents, kv="k")
        if self.assumptions and not self.holds():
            return MISS
        return self.run(q, k, v, cu_q, cu_kv, max_q, max_kv,
                        sink.float() if self.cast_sink else sink)  # type: ignore[union-attr]


MISS = object()
"""What `Prepared.dense` / `Prepared.packed` return when the call must take the full path."""


class PreparedCalls:
    """One call site's prepared calls, by spec (see the module doc)."""

    def __init__(self) -> None:
        self._entries: dict[CallSpec, Prepared] = {}
        self.get = self._entries.get  # a bound dict method: no Python frame on the hot path
        """The `Prepared` call of a spec, or None."""
        self.last_spec: Optional[CallSpec] = None
        """The spec put last: a layer makes the same call step after step, and comparing one spec costs
        less than hashing it."""
        self.last: Optional[Prepared] = None
        self.hits = 0
        """Calls served from the cache."""
        self.misses = 0
        """Calls that took the full path (a new spec, a call no spec can hold, or a failed re-check)."""

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, spec: CallSpec) -> Optional[Prepared]:
        """The `Prepared` call of ``spec``, or None: the last spec put is compared first, a layer making
        the same call step after step."""
        return self.last if spec == self.last_spec else self._entries.get(spec)

    def put(self, spec: CallSpec, prepared: Prepared) -> None:
        entries = self._entries
        if spec not in entries and len(entries) >= LIMIT:
            del entries[next(iter(entries))]
        entries[spec] = prepared
        self.last_spec, self.last = spec, prepared

    def clear(self) -> None:
        self._entries.clear()
        self.last_spec = self.last = None


__all__ = ["LIMIT", "MISS", "Prepared", "PreparedCalls", "Runner"]
