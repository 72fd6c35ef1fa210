"""The solver queries every hook proof makes: one place for the timeout and the counterexample text."""

from __future__ import annotations

from fractions import Fraction
from typing import Any, Optional, Union

import z3

from .ops import INDEX_BOUND
from .encoder import Encoder

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


def broken_obligation(encoder: Encoder, domain: list[Any], names: dict[str, z3.ExprRef],
                      ranges: Optional[dict[str, tuple[int, int]]] = None) -> str:
    """Empty when every obligation (index ranges, no overflow) holds for all inputs: one query, unless interval
    bounds of each obligation's terms already show it.  ``ranges``: an index variable's bounds where the domain
    narrows it (the rank's heads), by name; any other index lies in ``[0, INDEX_BOUND)``."""
    # bounds by term: a table's If chain (between its least and greatest value) recurs in several obligations
    seen: dict[int, Any] = {key: (min(values), max(values)) for key, (_, values, _) in encoder.tables.items()}
    if not encoder.obligations or all(_by_intervals(o, ranges or {}, seen) for o, _ in encoder.obligations):
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


def _number(e: z3.ExprRef) -> Optional[Fraction]:
    """An integer or rational constant's exact value, else None."""
    return Fraction(e.as_string()) if z3.is_app_of(e, z3.Z3_OP_ANUM) else None


def _interval(e: z3.ExprRef, ranges: dict[str, tuple[int, int]],
              seen: dict[int, Any]) -> Optional[tuple[Fraction, Fraction]]:
    """Bounds of a term when every index lies in its range (``ranges``, else ``[0, INDEX_BOUND)``); None if
    not simple.  An ``If`` lies between its branches' bounds (a table read: its values)."""
    key = e.get_id()
    if key not in seen:
        seen[key] = _bounds(e, ranges, seen)
    return seen[key]


def _bounds(e: z3.ExprRef, ranges: dict[str, tuple[int, int]],
            seen: dict[int, Any]) -> Optional[tuple[Fraction, Fraction]]:
    value = _number(e)
    if value is not None:
        return value, value
    if z3.is_const(e) and z3.is_int(e):
        lo, hi = ranges.get(str(e), (0, INDEX_BOUND - 1))  # an index variable
        return Fraction(lo), Fraction(hi)
    if z3.is_app_of(e, z3.Z3_OP_ITE):
        branches = [_interval(c, ranges, seen) for c in e.children()[1:]]
        if any(b is None for b in branches):
            return None
        return min(b[0] for b in branches), max(b[1] for b in branches)  # type: ignore[index]
    parts = [_interval(c, ranges, seen) for c in e.children()]
    if not parts or any(p is None for p in parts):
        return None
    if z3.is_app_of(e, z3.Z3_OP_TO_REAL):
        return parts[0]
    if z3.is_add(e) or z3.is_sub(e):
        lo, hi = parts[0]  # type: ignore[misc]
        for plo, phi in parts[1:]:  # type: ignore[misc]
            lo, hi = (lo + plo, hi + phi) if z3.is_add(e) else (lo - phi, hi - plo)
        return lo, hi
    if z3.is_mul(e):
        lo, hi = parts[0]  # type: ignore[misc]
        for plo, phi in parts[1:]:  # type: ignore[misc]
            products = (lo * plo, lo * phi, hi * plo, hi * phi)
            lo, hi = min(products), max(products)
        return lo, hi
    if z3.is_app_of(e, z3.Z3_OP_UMINUS):
        lo, hi = parts[0]  # type: ignore[misc]
        return -hi, -lo
    return None


def _by_intervals(obligation: z3.BoolRef, ranges: dict[str, tuple[int, int]], seen: dict[int, Any]) -> bool:
    """True when interval bounds alone show ``obligation`` (a conjunction of ``term <op> constant``) holds."""
    atoms = obligation.children() if z3.is_and(obligation) else [obligation]
    for atom in atoms:
        c = _number(atom.arg(1)) if atom.num_args() == 2 else None
        if c is None:
            return False
        bounds = _interval(atom.arg(0), ranges, seen)
        if bounds is None:
            return False
        lo, hi = bounds
        ok = {z3.Z3_OP_LE: hi <= c, z3.Z3_OP_LT: hi < c, z3.Z3_OP_GE: lo >= c, z3.Z3_OP_GT: lo > c}
        if not ok.get(atom.decl().kind(), False):
            return False
    return True


def head_domain(h: z3.ArithRef, num_heads: Optional[int], head_offset: int) -> z3.BoolRef:
    """``h`` is one of the rank's global heads, ``head_offset .. head_offset + num_heads - 1``."""
    return z3.And(h >= head_offset, h < head_offset + num_heads) if num_heads else h >= head_offset


__all__ = ["TIMEOUT_MS", "broken_obligation", "extreme", "head_domain", "solve", "uses_reals", "where_text"]
