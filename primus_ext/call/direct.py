"""`DirectTarget`: what a direct-path op handle runs (``use_turbo_flex_attention: false``).

The Megatron core's direct path calls Primus-Turbo's fixed entries through `DirectRunner`
(`primus_ext.backends.direct`); this is the per-call side: the call's kernel route on the
plan's arch before it runs, and the kernel-level pair a compiled step's ops call.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor

from ..backends.base import CallArgs, KernelPair
from ..backends.call_route import CallRoutes
from ..backends.direct import DirectRunner
from ..backends.dispatch import BUILD_A6A16CD, DEFAULT_ORDER, Selection, TurboBuild
from ..backends.turbo_kernels import discover_kernels, kernel_pair


class DirectTarget:
    """What a direct-path op handle runs (see `primus_ext.call.ops`); on a known ``arch`` a call
    routed to AITER, FlyDSL or HipKittens gets that backend's kernel-level pair in compiled steps."""

    def __init__(self, runner: DirectRunner, arch: Optional[str] = None, selection: Selection = DEFAULT_ORDER,
                 equal_documents: bool = False, build: TurboBuild = BUILD_A6A16CD) -> None:
        self.runner = runner
        plain = runner.entries.dense == "flash_attn_func"
        self.kernels = discover_kernels() if plain else None
        self.routes = CallRoutes(arch, selection, equal_documents, build) if plain else None

    def check(self, a: CallArgs) -> None:
        """Refuse a call the kernels would fail or compute wrongly (its route on the plan's arch,
        its storage layout on any), as the flex adapter does (B33, B34)."""
        if self.routes is not None:
            self.routes.check("dense" if a.cu_q is None else "varlen", a, a.causal, a.window)

    def check_in_graph(self, a: CallArgs) -> None:
        """Nothing more inside a compiled graph: the direct path has no hooks."""

    def hook_state(self) -> None:
        """The direct path evaluates no hook."""

    def check_hook_state(self, state: Any) -> None:
        """Nothing to check: no hook."""

    def pair(self, a: CallArgs) -> Optional[KernelPair]:
        # The direct path passes Megatron's own causal / window to the entry: the same here.
        return kernel_pair(self.kernels, self.routes, a, a.causal, a.window)

    def run(self, a: CallArgs) -> Tensor:
        return self.runner.run(a)


__all__ = ["DirectTarget"]
