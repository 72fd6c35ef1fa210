"""Each turbo call's own kernel route on the plan's arch, checked before the kernel (B33, B34).

The plan checks the routes of the layer's configured calls.  A caller using the adapter
as the drop-in ``flash_attn_func`` can still pass what the plan did not assume: another
storage layout (FlyDSL wants contiguous sbhd, and upstream asserts that q, k and v share one
layout), ``deterministic=True``, dropout, another dtype or
head dim.  Such a call could reach a kernel backend that asserts, or one that computes
it wrongly (AITER's sink backward).  So on a known arch each distinct call shape is routed
with the same dispatch model, once, and refused with our error when it would fail.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from ..errors import UnsupportedInputError
from ..refusals import LAYOUT, ROUTE, refuse, refuse_naming
from .base import CallArgs
from .dispatch import (ARCHES, BUILD_A6A16CD, DEFAULT_ORDER, CallFeatures, Route, Selection, TurboBuild, default_scale,
                       route)
from .layout import LayoutError, storage_features

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


class CallRoutes:
    """Memoised `route` of a layer's calls on one arch; raises for a call no backend runs right.

    With the arch unknown only what fails on every arch is checked: a dense call's storage
    layout, which upstream infers from q, k and v and asserts on before any dispatch."""

    def __init__(self, arch: Optional[str], selection: Selection = DEFAULT_ORDER, equal_documents: bool = False,
                 build: TurboBuild = BUILD_A6A16CD) -> None:
        self.arch = arch if arch in ARCHES else None
        self.selection = selection  # the plan's (a pin or autotune, read when the layer was built)
        self.build = build  # the plan's (the installed Primus-Turbo's, read by signature)
        # packed_equal_documents (B36): every varlen call's documents are of one length, which
        # `check_packed` proves per call before the call is routed.
        self.equal_documents = equal_documents

    def check(self, entry: str, a: CallArgs, causal: bool, window: Tuple[int, int]) -> None:
        """Refuse ``a`` where no kernel backend runs it right; ``causal`` / ``window`` are the mask the
        entry gets (a hook layer's proven pattern, not the call's flags)."""
        # Inside a graph being traced the memo would be a guarded, mutated dict: the custom op runs
        # this check itself when it executes (`OpTarget.check`), on the real tensors.
        if torch.compiler.is_compiling():
            return
        if self.arch is None:
            if entry == "dense" and a.q.numel() > 0:  # without queries no kernel is reached (the empty result)
                _storage(a.q, a.k, a.v)
            return
        problem = self._lookup(entry, a, causal, window)[1]
        if problem is not None:
            raise problem()

    def backend(self, entry: str, a: CallArgs, causal: bool, window: Tuple[int, int]) -> Optional[str]:
        """The kernel backend this call reaches and runs right on, or None (unknown arch, or refused)."""
        if self.arch is None:
            return None
        found, problem = self._lookup(entry, a, causal, window)
        return None if problem is not None else found.backend

    def _lookup(self, entry: str, a: CallArgs, causal: bool, window: Tuple[int, int]
                ) -> tuple[Route, Optional[Callable[[], UnsupportedInputError]]]:
        values = _feature_values(self.arch, entry, a, causal, window, build=self.build,
                                 equal_documents=True if self.equal_documents and entry == "varlen" else None)
        found = _routed(values, self.selection)
        if entry == "varlen" and values[_EQUAL] is None and found[1] is None:
            # upstream's FlyDSL gate reads each call's boundaries: equal documents (one included) may reach it
            equal = _routed(values[:_EQUAL] + (True,) + values[_EQUAL + 1:], self.selection, possible=True)
            if equal[1] is not None:
                return equal
        return found


@functools.lru_cache(maxsize=1024)
def _routed(values: tuple, selection: Selection, possible: bool = False
            ) -> tuple[Route, Optional[Callable[[], UnsupportedInputError]]]:
    """The dispatch model's verdict on one call's features: a pure function of its arguments (the
    `CallFeatures` field values `_feature_values` gives, in field order, compared by value), so its memo is
    keyed by them (a call site's own cache is `primus_ext.call.prepared`).  ``possible``: equal documents
    are not known, only possible (the refusal then says "when").

    The memo is keyed by the values, not by the frozen dataclass made of them: building and hashing that
    per call cost 6 µs here, more than the route check it serves; a hit builds no `CallFeatures`.

    A refusal is kept as what makes the error, never as the error: a raised exception keeps the frames
    it passed through, and with them the refused call's tensors, for as long as the memo keeps it."""
    features = CallFeatures(*values)
    found = route(features, selection)
    layout = () if features.entry != "dense" or features.sbhd_storage else (
        "pass q/k/v as bshd views of sbhd memory (Megatron's layout), as the plan assumed",)
    what = ("this call, whenever its documents are of one length (one document included: upstream's gate reads "
            "each call's boundaries, which the check does not)" if possible else "this call")
    reason = found.reason(what, alternatives=layout)
    if reason is None:
        return found, None
    # The dispatch model's wording, raised as the catalogue's B33 (its settings: the blocking checks').
    return found, functools.partial(refuse_naming, ROUTE, reason.settings, reason=reason.reason,
                                    alternative=reason.alternative)


def call_features(arch: str, entry: str, a: CallArgs, causal: bool, window: Tuple[int, int], *,
                  equal_documents: Optional[bool], build: TurboBuild) -> CallFeatures:
    """The dispatch model's view of one call reaching ``entry`` as ``(causal, window)``: its kernel route
    here, its kernel pair in `primus_ext.backends.turbo_kernels`.  A dense call's storage layout that upstream
    asserts on is refused (LAYOUT)."""
    return CallFeatures(*_feature_values(arch, entry, a, causal, window, equal_documents=equal_documents,
                                         build=build))


_FIELDS = ("arch", "entry", "dtype", "head_dim", "head_dim_v", "heads", "kv_heads", "causal", "window", "sink",
           "dropout", "bias", "alibi", "deterministic", "default_scale", "equal_documents", "sbhd_storage",
           "contiguous_sbhd", "contiguous_bshd", "q_within_kv", "contiguous_thd", "needs_backward", "build")
"""The order of `_feature_values`' tuple: `CallFeatures`' own field order, checked at import below."""
assert _FIELDS == tuple(field.name for field in dataclasses.fields(CallFeatures)), "CallFeatures' fields moved"
_EQUAL = _FIELDS.index("equal_documents")


def _feature_values(arch: str, entry: str, a: CallArgs, causal: bool, window: Tuple[int, int], *,
                    equal_documents: Optional[bool], build: TurboBuild) -> tuple:
    """The one description of a call's `CallFeatures`: their values in `_FIELDS` order."""
    q, k, v = a.q, a.k, a.v
    # a call without queries reaches no kernel (the core returns the empty result), and an empty
    # tensor's strides say nothing of a layout
    empty = q.numel() == 0
    sbhd, contiguous, bshd = _storage(q, k, v) if entry == "dense" and not empty else (True, True, True)
    # a dense call's documents are flattened to contiguous thd by the Turbo backend (`_documents_dense`)
    thd = entry == "dense" or empty or q.dim() == 4 or (q.is_contiguous() and k.is_contiguous() and v.is_contiguous())
    head_dim = q.shape[-1]
    return (arch, entry, _DTYPES.get(q.dtype, str(q.dtype)), head_dim, v.shape[-1], q.shape[-2], k.shape[-2],
            causal, window, a.sink is not None,
            0.1 if a.dropout_p > 0 else 0.0,  # the model reads only "any dropout"
            a.bias is not None, a.alibi is not None, a.deterministic, default_scale(a.scale, head_dim),
            equal_documents, sbhd, contiguous, bshd,
            entry != "dense" or q.shape[1] <= k.shape[1],  # q_within_kv; bshd: Sq <= Skv
            thd, True, build)  # needs_backward: every training call


def _storage(q: Tensor, k: Tensor, v: Tensor) -> Tuple[bool, bool, bool]:
    """``(sbhd_storage, contiguous_sbhd, contiguous_bshd)`` of a dense call; a layout upstream asserts on
    is refused."""
    try:
        return storage_features(q, k, v)[1:]
    except LayoutError as exc:
        raise refuse(LAYOUT, problem=exc) from None


__all__ = ["CallRoutes", "call_features"]
