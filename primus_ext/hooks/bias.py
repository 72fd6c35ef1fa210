"""What a score hook adds to the score, for every head at once, from one encoding with a symbolic head (B31).

A score hook that reads a per-head table (ALiBi's slopes) was encoded once per head, its head-only
values computed by torch.  Encoded once with the head index ``h`` symbolic instead, the table read
becomes an ``If`` chain on ``h``, and the hook's value is, for each head ``k``, a polynomial of degree
one in the score and the indices: evaluating its coefficients exactly for the vector of heads (one
rational per head, no sampling) decides ``hook == score + a[k] * q_idx + b[k] * kv_idx + c[k]`` for
every score and position at once.

Only what means the same encoded symbolically as computed by torch head by head is recognised:
integer arithmetic of the head index, comparisons of it (the chain's conditions), real constants and
``If`` chains choosing among them (a table read), and sums, differences and products with at most one
factor that depends on the score or the positions.  Real arithmetic among head-only values (``slope *
2.0``, ``(h + 1) * 0.5``), which torch rounds in float32 before it meets a position, is not: that hook
is proven head by head as before (`score.prove_score_trace`).
"""

from __future__ import annotations

import operator
from fractions import Fraction
from typing import Any, Callable, Optional, Sequence, Union

import z3

Value = Union[Fraction, list[Fraction]]
"""One coefficient: the same for every head (most of a formula), or one per head (a table read)."""
Poly = dict[str, Value]
"""Coefficients of ``score``, ``q``, ``kv`` and ``1`` (the constant)."""

KEYS = ("score", "q", "kv", "1")
_ZERO, _ONE = Fraction(0), Fraction(1)


class _Outside(Exception):
    """Not in the recognised subset: the hook is proven head by head."""


_COMPARE = {z3.Z3_OP_LE: operator.le, z3.Z3_OP_LT: operator.lt, z3.Z3_OP_GE: operator.ge,
            z3.Z3_OP_GT: operator.gt, z3.Z3_OP_EQ: operator.eq, z3.Z3_OP_DISTINCT: operator.ne}


def _zip(op: Callable[..., Any], *values: Any) -> Any:
    """``op`` on coefficients (or per-head truth values), head by head only where one differs per head."""
    if not any(isinstance(v, list) for v in values):
        return op(*values)
    n = next(len(v) for v in values if isinstance(v, list))
    return [op(*(v[i] if isinstance(v, list) else v for v in values)) for i in range(n)]


class _Heads:
    def __init__(self, names: dict[str, z3.ExprRef], heads: Sequence[int], tables: dict[int, Any]) -> None:
        self.heads = [Fraction(k) for k in heads]
        self.vars = {names[k].get_id(): k for k in ("score", "q", "kv")}
        self.h = names["h"].get_id()
        self.memo: dict[int, Poly] = {}
        self.tables = tables

    @staticmethod
    def scalar(p: Poly) -> bool:
        return set(p) <= {"1"}

    def table(self, values: list[Fraction], index: z3.ExprRef) -> Poly:
        """A table's ``If`` chain ``If(i == 0, v0, If(i == 1, v1, ... v[-1]))`` at each head's index."""
        at = self.term(index)
        if not self.scalar(at):
            raise _Outside
        last = len(values) - 1
        return {"1": _zip(lambda i: values[int(i)] if 0 <= i < last else values[last], at.get("1", _ZERO))}

    def term(self, e: z3.ExprRef) -> Poly:
        key = e.get_id()
        if key not in self.memo:
            self.memo[key] = self._term(e)
        return self.memo[key]

    def _term(self, e: z3.ExprRef) -> Poly:
        if e.get_id() in self.tables:
            _, values, index = self.tables[e.get_id()]
            return self.table(values, index)
        kind = e.decl().kind()
        if kind == z3.Z3_OP_ANUM:  # an integer or rational constant
            return {"1": Fraction(e.as_string())}
        if kind == z3.Z3_OP_UNINTERPRETED and e.num_args() == 0:
            if e.get_id() == self.h:
                return {"1": list(self.heads)}
            if e.get_id() in self.vars:
                return {self.vars[e.get_id()]: _ONE}
            raise _Outside  # the batch index, or a name no hook input has
        kids = e.children()
        if kind == z3.Z3_OP_ITE:
            cond, a, b = self.condition(kids[0]), self.term(kids[1]), self.term(kids[2])
            return {k: _zip(lambda c, x, y: x if c else y, cond, a.get(k, _ZERO), b.get(k, _ZERO))
                    for k in a.keys() | b.keys()}
        parts = [self.term(c) for c in kids]
        if kind == z3.Z3_OP_TO_REAL and len(parts) == 1:
            out = parts[0]
        elif kind in (z3.Z3_OP_ADD, z3.Z3_OP_SUB) and parts:
            out = parts[0]
            for p in parts[1:]:
                sub = kind == z3.Z3_OP_SUB
                out = {k: _zip(lambda x, y: x - y if sub else x + y, out.get(k, _ZERO), p.get(k, _ZERO))
                       for k in out.keys() | p.keys()}
        elif kind == z3.Z3_OP_UMINUS and len(parts) == 1:
            out = {k: _zip(operator.neg, v) for k, v in parts[0].items()}
        elif kind == z3.Z3_OP_MUL and parts:
            varying = [p for p in parts if not self.scalar(p)]
            if len(varying) > 1:
                raise _Outside  # a product of two position terms: not a bias of degree one
            factor: Value = _ONE
            for p in parts:
                if self.scalar(p):
                    factor = _zip(operator.mul, factor, p.get("1", _ZERO))
            base = varying[0] if varying else {"1": _ONE}
            out = {k: _zip(operator.mul, factor, v) for k, v in base.items()}
        else:
            raise _Outside
        if self.scalar(out) and e.sort_kind() == z3.Z3_REAL_SORT:
            raise _Outside  # torch computes this head-only value in floating point, rounding it
        return out

    def condition(self, e: z3.ExprRef) -> Any:
        """A condition on the head index alone: a truth value, or one per head."""
        kind, kids = e.decl().kind(), e.children()
        if kind in (z3.Z3_OP_TRUE, z3.Z3_OP_FALSE):
            return kind == z3.Z3_OP_TRUE
        if kind in _COMPARE and len(kids) == 2 and kids[0].sort_kind() != z3.Z3_BOOL_SORT:
            a, b = self.term(kids[0]), self.term(kids[1])
            if not (self.scalar(a) and self.scalar(b)):
                raise _Outside
            return _zip(_COMPARE[kind], a.get("1", _ZERO), b.get("1", _ZERO))
        parts = [self.condition(c) for c in kids]
        if kind == z3.Z3_OP_AND:
            return _zip(lambda *v: all(v), *parts)
        if kind == z3.Z3_OP_OR:
            return _zip(lambda *v: any(v), *parts)
        if kind == z3.Z3_OP_NOT and len(parts) == 1:
            return _zip(operator.not_, parts[0])
        if kind in (z3.Z3_OP_EQ, z3.Z3_OP_IFF) and len(parts) == 2:
            return _zip(operator.eq, *parts)
        raise _Outside


def per_head(out: z3.ExprRef, names: dict[str, z3.ExprRef], heads: Sequence[int],
             tables: Optional[dict[int, Any]] = None) -> Optional[dict[str, list[Fraction]]]:
    """``out`` (over ``names``' score, h, q, kv) as exact coefficients per head of ``score``, ``q``, ``kv``, ``1``
    (each a list over ``heads``); None when it is outside the recognised subset.  ``tables``: the encoder's
    table reads (`Encoder.tables`), each read in one step."""
    try:
        poly = _Heads(names, heads, tables or {}).term(out)
    except (_Outside, z3.Z3Exception):
        return None
    n = len(heads)
    return {k: (lambda v: v if isinstance(v, list) else [v] * n)(poly.get(k, _ZERO)) for k in KEYS}


__all__ = ["KEYS", "per_head"]
