"""A hook's torch.fx trace, at the cost of what a proof needs of it (B31)."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch.fx as fx
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module

from .allowlist import MATH_FUNCTIONS


class _Tracer(fx.Tracer):
    """fx's tracer, whose autowrap of ``math`` patches only the allow-listed math functions for the trace: a hook
    calls no other (`hook_subset` checked it first), so patching the rest of the module at every trace was
    cost without meaning."""

    def __init__(self) -> None:
        super().__init__(autowrap_modules=(math,))
        self._autowrap_function_ids = {id(f) for f in MATH_FUNCTIONS}


def symbolic_trace(root: Callable[..., Any]) -> fx.GraphModule:
    """`torch.fx.symbolic_trace` with `_Tracer`; the module's Python code is generated when first called (a
    proof reads the graph's nodes, and runs the module only to guess a window)."""
    tracer = _Tracer()
    graph = tracer.trace(root)
    with _use_lazy_graph_module(True):
        return _make_graph_module(tracer.root, graph, root.__name__)


__all__ = ["symbolic_trace"]
