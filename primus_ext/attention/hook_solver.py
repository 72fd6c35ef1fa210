"""The solver queries every hook proof makes: one place for the timeout and the counterexample text."""

from __future__ import annotations

from typing import Any, Optional, Union

import z3

from .hook_ops import INDEX_BOUND
from .hook_z3 import Encoder

TIMEOUT_MS = 2000  # per solver query; a query that times out proves nothing


def solve(*constraints: Any) -> tuple[str, Optional[z3.ModelRef]]:
    solver = z3.Solver()
    solver.set("timeout", TIMEOUT_MS)
    solver.add(*constraints)
    result = solver.check()
    return str(result), (solver.model() if result == z3.sat else None)


def extreme(objective: z3.ArithRef, constraints: list[Any], *, minimize: bool = False) -> Union[int, str]:
    """The largest (smallest) value of ``objective``: an int, ``"unbounded"`` or ``"unknown"``."""
    opt = z3.Optimize()
    opt.set("timeout", TIMEOUT_MS)
    opt.add(*constraints)
    handle = opt.minimize(objective) if minimize else opt.maximize(objective)
    if opt.check() != z3.sat:
        return "unknown"
    value = opt.lower(handle) if minimize else opt.upper(handle)
    if not z3.is_int_value(value) or abs(value.as_long()) >= INDEX_BOUND // 2:
        return "unbounded"  # indices are bounded only to check int64 overflow
    return value.as_long()


def where_text(model: z3.ModelRef, names: dict[str, z3.ExprRef]) -> str:
    parts = []
    for label, var in names.items():
        value = model.eval(var, model_completion=True)
        parts.append(f"{label}={value.as_decimal(6) if z3.is_real(value) else value}")
    return ", ".join(parts)


def uses_reals(formula: z3.ExprRef) -> bool:
    """True when any subterm is real-valued (a mask's float arithmetic is rounded by torch)."""
    stack, seen = [formula], set()
    while stack:
        e = stack.pop()
        if e.get_id() in seen:
            continue
        seen.add(e.get_id())
        if z3.is_real(e):
            return True
        stack.extend(e.children())
    return False


def broken_obligation(encoder: Encoder, domain: list[Any], names: dict[str, z3.ExprRef]) -> str:
    """Empty when every obligation (index ranges, no overflow) holds for all inputs: one query."""
    if not encoder.obligations:
        return ""
    status, model = solve(*domain, z3.Not(z3.And(*[o for o, _ in encoder.obligations])))
    if status == "unsat":
        return ""
    if model is None:
        return "could not be checked within the solver's time limit"
    for obligation, text in encoder.obligations:
        if not z3.is_true(model.eval(obligation, model_completion=True)):
            return f"{text} at {where_text(model, names)}"
    return "breaks an obligation"


def head_domain(h: z3.ArithRef, num_heads: Optional[int], head_offset: int) -> z3.BoolRef:
    """``h`` is one of the rank's global heads, ``head_offset .. head_offset + num_heads - 1``."""
    return z3.And(h >= head_offset, h < head_offset + num_heads) if num_heads else h >= head_offset


__all__ = ["TIMEOUT_MS", "broken_obligation", "extreme", "head_domain", "solve", "uses_reals", "where_text"]
