"""A layer's shared-prefix call: a packed row of prompts, their responses and documents
(`primus_ext.backends.shared_prefix`), on the layer's plan and backend.

The plan decided at build time that the layer can merge (``packed_shared_prefix``, B37); here the
self call goes through the adapter's own checks as any packed causal call of the layer would, the
cross call is made of it and routed the same way (the plan's arch, its kernel pairs), and what the
kernels cannot take is refused before any of them runs.  Eager calls run the merge as one autograd
function; under ``torch.compile`` it is one custom op (`primus_ext.call.shared_prefix_ops`), whose
backward op runs the two kernel backwards, so a compiled step has no graph break and no recompute.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from .. import refusals as R
from ..backends.base import CallArgs
from ..backends.shared_prefix import SharedPrefixAttention, SharedPrefixLayout
from .adapter import TurboFlexAttention
from .checks import empty_result, no_queries
from .shared_prefix_ops import checked_calls, pairs_of, run_compiled


def shared_prefix_attention(adapter: TurboFlexAttention, q: Tensor, k: Tensor, v: Tensor,
                            layout: SharedPrefixLayout, *, softmax_scale: Optional[float] = None,
                            sink: Optional[Tensor] = None, deterministic: bool = False) -> Tensor:
    """Attention of one packed shared-prefix row: q, k, v ``[T, H, D]`` (thd), the row's ``layout``;
    returns ``[T, Hq, Dv]``.  ``adapter``'s plan must be built with ``packed_shared_prefix: true``."""
    check_planned(adapter.plan)
    check_tokens(q, k, v, layout)
    raw = CallArgs(q, k, v, layout.segments, layout.segments, layout.max_segment, layout.max_segment, sink, None,
                   None, None, None, softmax_scale, 0.0, deterministic, True)
    a, _ = adapter._checked(raw, False, True)
    return run_shared_prefix(adapter._target, adapter.handle, a, layout)


def check_planned(plan: Any) -> None:
    """Refuse a shared-prefix row on a layer not planned for one (it would attend as plain documents)."""
    if not getattr(plan, "shared_prefix", False):
        raise R.refuse(R.PREFIX_CALL, what=f"a layer planned with packed_shared_prefix: true (layer "
                                           f"{getattr(plan, 'layer_number', '?')} is not)")


def check_tokens(q: Tensor, k: Tensor, v: Tensor, layout: Any) -> None:
    if not isinstance(layout, SharedPrefixLayout):
        raise R.refuse(R.PREFIX_LAYOUT, got=f"a {type(layout).__name__} where a SharedPrefixLayout was expected")
    for t in (q, k, v):
        if isinstance(t, Tensor) and t.dim() >= 1 and t.shape[0] != layout.total:
            raise R.refuse(R.PREFIX_TOKENS, got=t.shape[0], total=layout.total)


def run_shared_prefix(target: Any, handle: int, a: CallArgs, layout: SharedPrefixLayout) -> Tensor:
    """The checked self call ``a`` (packed, causal) of ``target`` (`PlanTarget` or `DirectTarget`, registered for the
    compiled op as ``handle``) merged with its cross call."""
    if layout.segments.device != a.q.device:
        raise R.refuse(R.PREFIX_LAYOUT, got=f"a layout on {layout.segments.device} for tokens on {a.q.device}")
    if a.dropout_p:  # the plan refuses dropout on such a layer (B37-dropout); a call cannot bring it either
        raise R.refuse(R.PREFIX_CALL, what="no attention dropout (dropout_p=0.0)")
    a = a._replace(return_lse=True)
    if no_queries(a.q, True) and not torch.compiler.is_compiling():  # a row without tokens: no kernel
        return empty_result(a.q, a.k, a.v, a.sink, True, False)
    caps = getattr(target, "caps", None)
    if caps is not None and caps.tree_mask:  # the backend computes the tree mask itself, as one call
        return target.backend.tree(a.q, a.k, a.v, layout, target.kernel_call(a))
    cross = checked_calls(target, a, layout)
    if torch.compiler.is_compiling():
        # Not the pairs here: their lookup builds the dispatch model's objects, which Dynamo cannot trace once the
        # row's lengths are dynamic (a second layout broke the graph); the op pairs the calls when it runs.
        return run_compiled(handle, a, layout)
    return SharedPrefixAttention.apply(a.q, a.k, a.v, a.sink, layout, a, *pairs_of(target, a, cross))


__all__ = ["check_planned", "check_tokens", "run_shared_prefix", "shared_prefix_attention"]
