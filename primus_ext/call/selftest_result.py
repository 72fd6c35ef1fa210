"""What a self-test route gives (`RouteResult`) and the error each dtype may show (`TOLERANCE`): shared by the
routes of `primus_ext.call.selftest` and a shared-prefix layer's merge (`primus_ext.call.selftest_shared_prefix`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 2e-4, torch.float64: 1e-9}
"""Max error, relative to the largest reference value, that a route may show per dtype
(bf16's 8-bit mantissa rounds each product to ~4e-3; blockwise and one-pass softmax
round differently, and errors add over a 64-key row)."""


@dataclass(frozen=True)
class RouteResult:
    """One route's self-test: ``error`` is set when it could not run or disagreed.  ``pinned``: the
    kernel backend pinned for the run (autotune), "" when the dispatcher chose; ``skipped``: why a
    pinned backend did not run (upstream's "cannot handle" ``ValueError``: it does not take the
    call, so autotune cannot keep it either), which is no failure; ``unchecked``: what the run could
    not check and why (a flex route's backward on the CPU, `selftest_flex.FORWARD_ONLY`), no failure."""

    route: str
    kernels: str
    forward_error: float
    backward_error: float
    ms: float
    error: str = ""
    pinned: str = ""
    skipped: str = ""
    unchecked: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


__all__ = ["RouteResult", "TOLERANCE"]
