"""What a score hook does to the score in float32, which a proof over the reals does not see (B31).

A score proof (`primus_ext.hooks.score`) is over the reals, but torch and the kernels compute the
score in float32: ``score * 1000.0 * ... / 1000.0`` is the score over the reals and ``inf`` in
float32 for ordinary scores.  So a score hook is proven only when its path from the score to its
result is exact in float32 for every finite score, given what it adds: an allow-list of steps,

* casts between float32 and float64 (exact one way; the other is the rounding of the one addition),
  ``clone`` / ``contiguous`` / ``detach`` / ``expand``, and ``torch.where`` between such values on a
  condition the score does not enter;
* at most one addition of a value the score does not enter (``score + bias``, ``score - bias``),
  computed in float32 or float64: one rounding, as the kernels round their own ALiBi bias into the
  score.

Anything else applied to the score (a product, a quotient, a second addition, a comparison) is not
proven, whatever the reals say.  The value a hook adds is a function of the indices whose floating
steps keep their rounding relative to their result, as the kernels' ``slope * (kv - q)`` does:
integers scaled, never a sum or difference of floating values (which can cancel), never float16 or
bfloat16 (`_bias_step`), and each step far from overflow (`SAFE_MAGNITUDE`, an obligation the
encoder adds).  So a value that is 0 over the reals is exactly 0 in float32 too (a product of
nonzero finite values is nonzero), and the identity adds nothing to the score.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx

SAFE_MAGNITUDE = 2.0 ** 100
"""Largest magnitude a floating step of a score hook's bias is proven to stay below (float32 overflows at
about 2**128): a bound on each step keeps every product of two steps finite too."""

_PASS_METHODS = frozenset({"float", "double", "half", "bfloat16", "int", "long", "bool", "to", "type_as", "clone",
                           "contiguous", "detach", "expand", "expand_as"})
_EXACT = (torch.float32, torch.float64)
"""Dtypes a score may pass through unrounded (float32 into float64 is exact; back, it is the one rounding)."""
_ADDS = frozenset({operator.add, torch.add, "add", "__add__", "__radd__"})
_SUBS = frozenset({operator.sub, torch.sub, "sub", "__sub__"})


@dataclass(frozen=True)
class ScorePath:
    """``problem``: why the score's float32 path is not proven (empty: it is)."""

    problem: str


def _label(node: fx.Node) -> str:
    target = node.target
    return f"Tensor.{target}" if node.op == "call_method" else getattr(target, "__name__", str(target))


def score_path(graph: fx.GraphModule, dtypes: Optional[dict]) -> ScorePath:
    """The allow-list above, walked over ``graph`` with each node's dtype (`encoder.node_dtypes`)."""
    if dtypes is None:
        return ScorePath("its dtypes could not be read from one run, so its float32 arithmetic cannot be checked")
    depends: dict[fx.Node, int] = {}  # node -> additions on its path from the score
    indexed: set[fx.Node] = set()  # nodes whose value comes from the indices (what a hook adds to the score)
    for node in graph.graph.nodes:
        if node.op == "placeholder":
            if node.target == "score":
                depends[node] = 0
            else:
                indexed.add(node)
            continue
        inputs = [n for n in node.all_input_nodes if n in depends]
        if node.op == "output":
            break
        if not inputs or _metadata_only(node, depends):
            if any(n in indexed for n in node.all_input_nodes):
                indexed.add(node)
                why = _bias_step(node, dtypes)
                if why:
                    return ScorePath(why)
            continue
        why = f"computes with the score by {_label(node)}"
        if node.op == "call_method" and node.target in _PASS_METHODS and node.args and node.args[0] in depends \
                and len(inputs) == 1:
            if dtypes.get(node) not in _EXACT:
                return ScorePath(f"{why} into {dtypes.get(node)}, which rounds or overflows it")
            depends[node] = depends[node.args[0]]
            continue
        if node.target is torch.where or (node.op == "call_method" and node.target == "where"):
            cond = node.args[0] if node.target is torch.where else node.args[1]
            if cond in depends:
                return ScorePath(f"{why} on a condition of the score")
            depends[node] = max(depends[n] for n in inputs)
            continue
        added = _added(node, depends)
        if added is None:
            return ScorePath(f"{why}, whose float32 rounding and overflow a proof over the reals does not model; "
                             "only the score plus a value of the indices (ALiBi) is proven")
        score_side, _ = added
        if depends[score_side] or dtypes.get(node) not in _EXACT or node.kwargs.get("alpha", 1) != 1:
            return ScorePath(f"{why} a second time, or in a dtype narrower than float32: each rounds, and only "
                             "one addition to the score is what the kernels compute")
        depends[node] = 1
    return ScorePath("")


_META_ATTRS = frozenset({"device", "dtype", "shape", "ndim", "is_cuda"})
_LIKE = frozenset({torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like})
_LIKE_METHODS = frozenset({"new_ones", "new_zeros", "new_full", "new_empty", "new_tensor", "size", "dim"})


def _metadata_only(node: fx.Node, depends: dict) -> bool:
    """A step that reads only the score's dtype, device or shape (``score.dtype``, ``zeros_like(score)``):
    its value is no function of the score's."""
    if node.target is getattr:
        return node.args[1] in _META_ATTRS
    if node.target in _LIKE:
        return not any(n in depends for n in node.all_input_nodes if n is not node.args[0])
    if node.op == "call_method" and node.target in _LIKE_METHODS:
        return not any(n in depends for n in node.all_input_nodes if n is not node.args[0])
    return False


def _added(node: fx.Node, depends: dict) -> Optional[tuple[fx.Node, Any]]:
    """``(the score side, the value added)`` of ``score + x`` / ``x + score`` / ``score - x`` whose ``x`` the
    score does not enter; None for any other step."""
    if node.op not in ("call_function", "call_method") or len(node.args) != 2:
        return None
    a, b = node.args
    if node.target in _ADDS:
        if a in depends and b not in depends:
            return a, b
        if b in depends and a not in depends:
            return b, a
    if node.target in _SUBS and a in depends and b not in depends:
        return a, b
    return None


_NARROW_FLOATS = (torch.float16, torch.bfloat16)


def _bias_step(node: fx.Node, dtypes: dict) -> str:
    """Why one floating step of what a hook adds to the score is not proven (empty: it is): in float16 or
    bfloat16 it rounds far more than the kernels' float32 bias; a sum or difference of floating values of the
    indices can cancel, leaving a rounding error as large as its operands (``d * 1.0 + 2**40 - 2**40``).  A
    product, quotient, cast, selection or absolute value keeps its error relative to its result, as the
    kernels' own ``slope * (kv - q)`` does."""
    dtype = dtypes.get(node)
    if dtype is None or not dtype.is_floating_point:
        return ""
    if dtype in _NARROW_FLOATS:
        return (f"computes a value of the indices in {dtype} by {_label(node)}, which rounds it more than the "
                "kernels' float32 bias does")
    if node.target in _ADDS or node.target in _SUBS or node.target in ("__rsub__", torch.rsub):
        return (f"adds or subtracts floating values of the indices by {_label(node)}, whose float32 rounding can "
                "cancel; compute the distance in integers and scale it once (slope * (kv_idx - q_idx))")
    return ""


__all__ = ["SAFE_MAGNITUDE", "ScorePath", "score_path"]
