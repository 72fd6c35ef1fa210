"""Documents and chunks decided without the solver, by the shape of the mask's formula (B31).

A mask built only from comparisons of ``q_idx``, ``kv_idx`` and ``q_idx - kv_idx`` with constants
(documents cut at constant positions, also through a boundary table read with ``bucketize``), or
of ``q_idx // C`` with ``kv_idx // C`` (chunks) and of the distance with constants, is constant on
finitely many *cells* of the index domain: between consecutive constants each comparison keeps its
truth value.  Evaluating the formula once per cell therefore decides it exactly for every position,
as the solver would, only faster; a candidate pattern is derived the way the solver path derives it
(widest reach either side, first position where a document starts) and proven equal cell by cell.

The subset is recognised on the z3 formula itself (`hook_z3`'s exact encoding, after the obligations
were proven), term by term: integer constants, the two indices, sums, products with a constant, floor
division of an index by a positive constant, ``If`` on a condition about one index, comparisons and
boolean connectives.  Any other term, an atom mixing what the cells cannot separate (``q_idx + kv_idx``,
``q_idx // C`` next to a position cut), or a constant near the domain's edge raises `_Outside`: the
caller then asks the solver, whose verdict stands.  Nothing here ever refuses a hook.
"""

from __future__ import annotations

import math
import operator
from fractions import Fraction
from typing import Any, Callable, Iterator, Optional

import z3

from .ops import INDEX_BOUND
from ..attention.pattern import FULL, Pattern

MAX_CUTS = 64  # constant document boundaries looked for before giving up
_LIMIT = INDEX_BOUND - 1  # the largest index inside the proofs' domain
_ROOT_MAX = INDEX_BOUND // 4  # constants beyond: cells reach the domain's edge, so the solver decides
_UNBOUNDED = INDEX_BOUND // 2  # the solver path's threshold for an unbounded reach (`solver.extreme`)

Eval = Callable[[int, int], Any]


class _Outside(Exception):
    """The formula is not in the recognised subset: the solver decides."""


def pattern_formula(pattern: Pattern, q: z3.ArithRef, kv: z3.ArithRef) -> z3.BoolRef:
    """``pattern.allows(q, kv)`` as a z3 formula (length-free patterns only)."""
    ok: list[Any] = []
    if pattern.left >= 0:
        ok.append(q - kv <= pattern.left)
    if pattern.right >= 0:
        ok.append(kv - q <= pattern.right)
    if pattern.chunk is not None:
        ok.append(q / pattern.chunk == kv / pattern.chunk)
    for cut in pattern.cuts or ():
        ok.append((q >= cut) == (kv >= cut))
    if pattern.boundaries is not None:
        raise ValueError("fixed-length document patterns are not proven")
    return z3.And(*ok) if ok else z3.BoolVal(True)


_COMPARE = {z3.Z3_OP_LE: operator.le, z3.Z3_OP_LT: operator.lt, z3.Z3_OP_GE: operator.ge,
            z3.Z3_OP_GT: operator.gt, z3.Z3_OP_EQ: operator.eq, z3.Z3_OP_DISTINCT: operator.ne}


class _Term:
    """An integer term: how to evaluate it, its linear part (keys ``q``, ``kv``, ``q/C``, ``kv/C``, ``1``) and
    the indices it depends on only through conditions (a step function of that index: bucketize)."""

    def __init__(self, run: Eval, linear: dict[str, Fraction], steps: frozenset[str] = frozenset()) -> None:
        self.run, self.linear, self.steps = run, linear, steps

    def variables(self) -> set[str]:
        return {k for k, v in self.linear.items() if k != "1" and v != 0}


class Cells:
    """The formulas compiled so far, and the cells on which every one of them is constant."""

    def __init__(self, q: z3.ArithRef, kv: z3.ArithRef) -> None:
        self.q, self.kv = q, kv
        self.ids = (q.get_id(), kv.get_id())
        self.starts: dict[str, set[int]] = {"q": {0}, "kv": {0}, "d": set()}
        self.chunk: Optional[int] = None
        self.kinds: set[str] = set()  # atom kinds seen: q, kv, d, chunk, steps

    # -- compiling ------------------------------------------------------------------------------------------
    def compile(self, e: z3.ExprRef) -> Eval:
        """``e`` (a boolean formula over ``q``, ``kv``) as a Python function of two ints, exact, or `_Outside`."""
        run, kinds = self._bool(e)
        self.kinds |= kinds
        if self.chunk is not None and self.kinds - {"d", "chunk", "const"}:
            raise _Outside  # a chunk next to position cuts: cells of both would not be enough
        return run

    def _bool(self, e: z3.ExprRef) -> tuple[Eval, set[str]]:
        # Dispatched on the node's kind and its operands' sorts: each z3 query costs, so none is made twice.
        kind = e.decl().kind()
        if kind in (z3.Z3_OP_TRUE, z3.Z3_OP_FALSE):
            value = kind == z3.Z3_OP_TRUE
            return (lambda q, kv: value), set()
        kids = e.children()
        if kind == z3.Z3_OP_ITE:
            (c, ck), (a, ak), (b, bk) = (self._bool(x) for x in kids)
            return (lambda q, kv: a(q, kv) if c(q, kv) else b(q, kv)), ck | ak | bk
        sort = kids[0].sort_kind() if kids else None
        if sort == z3.Z3_BOOL_SORT:
            parts = [self._bool(c) for c in kids]
            runs, kinds = [r for r, _ in parts], set().union(*(k for _, k in parts))
            return self._connective(kind, runs), kinds
        if kind in _COMPARE and len(kids) == 2 and sort == z3.Z3_INT_SORT:
            for side, other in ((0, 1), (1, 0)):  # a <op> If(c, x, y) is If(c, a <op> x, a <op> y): |q - kv|
                if kids[side].decl().kind() == z3.Z3_OP_ITE:
                    c, x, y = kids[side].children()
                    pick = (lambda t: (t, kids[other])) if side == 0 else (lambda t: (kids[other], t))
                    return self._bool(z3.If(c, e.decl()(*pick(x)), e.decl()(*pick(y))))
            left, right = self._term(kids[0]), self._term(kids[1])
            op, lr, rr = _COMPARE[kind], left.run, right.run
            return (lambda q, kv: op(lr(q, kv), rr(q, kv))), {self._atom(left, right)}
        raise _Outside

    @staticmethod
    def _connective(kind: int, runs: list[Eval]) -> Eval:
        if kind == z3.Z3_OP_AND:
            return lambda q, kv: all(r(q, kv) for r in runs)
        if kind == z3.Z3_OP_OR:
            return lambda q, kv: any(r(q, kv) for r in runs)
        if kind == z3.Z3_OP_NOT and len(runs) == 1:
            return lambda q, kv: not runs[0](q, kv)
        if kind in (z3.Z3_OP_EQ, z3.Z3_OP_IFF) and len(runs) == 2:
            return lambda q, kv: runs[0](q, kv) == runs[1](q, kv)
        if kind in (z3.Z3_OP_DISTINCT, z3.Z3_OP_XOR) and len(runs) == 2:
            return lambda q, kv: runs[0](q, kv) != runs[1](q, kv)
        raise _Outside

    def _atom(self, left: _Term, right: _Term) -> str:
        """The kind of ``left <op> right`` (what it depends on); the cells it needs are recorded."""
        linear = {k: left.linear.get(k, Fraction(0)) - right.linear.get(k, Fraction(0))
                  for k in left.linear.keys() | right.linear.keys()}
        names = {k for k, v in linear.items() if k != "1" and v != 0}
        const = linear.get("1", Fraction(0))
        if left.steps | right.steps:
            if names:
                raise _Outside  # a step function of one index next to an index itself
            return "steps"
        if names & {"q/C", "kv/C"}:
            if names != {"q/C", "kv/C"} or linear["q/C"] != -linear["kv/C"] or const != 0:
                raise _Outside  # only the sign of q // C - kv // C: same chunk, earlier, later
            return "chunk"
        if not names:
            return "const"
        if names == {"q", "kv"} and linear["q"] == -linear["kv"]:
            self._root("d", -const / linear["q"])
            return "d"
        if len(names) == 1:
            (name,) = names
            self._root(name, -const / linear[name])
            return name
        raise _Outside

    def _root(self, axis: str, x: Fraction) -> None:
        """An atom of ``axis`` changes truth only between ``floor(x)`` and ``floor(x) + 1`` (or at ``x``)."""
        if abs(x) > _ROOT_MAX:
            raise _Outside
        r = math.floor(x)
        self.starts[axis] |= {r, r + 1}

    def _term(self, e: z3.ExprRef) -> _Term:
        # Integer terms only: a leaf is an integer numeral or an index, and no operation below turns a real
        # into an integer (z3's real division and to_real are other kinds), so checking leaves checks all.
        kind = e.decl().kind()
        if kind == z3.Z3_OP_ANUM:
            if e.sort_kind() != z3.Z3_INT_SORT:
                raise _Outside
            value = int(e.as_string())
            return _Term(lambda q, kv: value, {"1": Fraction(value)})
        if kind == z3.Z3_OP_UNINTERPRETED:
            if e.get_id() == self.ids[0]:
                return _Term(lambda q, kv: q, {"q": Fraction(1)})
            if e.get_id() == self.ids[1]:
                return _Term(lambda q, kv: kv, {"kv": Fraction(1)})
            raise _Outside
        kids = e.children()
        if kind == z3.Z3_OP_ITE:
            return self._step(*kids)
        if kind == z3.Z3_OP_IDIV and len(kids) == 2:
            return self._chunk(*kids)
        parts = [self._term(c) for c in kids]
        if kind in (z3.Z3_OP_ADD, z3.Z3_OP_SUB) and parts:
            sign = [1] + [1 if kind == z3.Z3_OP_ADD else -1] * (len(parts) - 1)
            runs = [(s, p.run) for s, p in zip(sign, parts)]
            return _Term(lambda q, kv: sum(s * r(q, kv) for s, r in runs), _combine(parts, sign),
                         frozenset().union(*(p.steps for p in parts)))
        if kind == z3.Z3_OP_UMINUS and len(parts) == 1:
            p = parts[0].run
            return _Term(lambda q, kv: -p(q, kv), _combine(parts, [-1]), parts[0].steps)
        if kind == z3.Z3_OP_MUL and parts:
            varying = [p for p in parts if p.variables() or p.steps]
            if len(varying) > 1:
                raise _Outside  # a product of two index terms
            factor = math.prod(int(p.linear.get("1", 0)) for p in parts if p not in varying)
            base = varying[0] if varying else _Term(lambda q, kv: 1, {"1": Fraction(1)})
            b = base.run
            return _Term(lambda q, kv: factor * b(q, kv), _combine([base], [factor]), base.steps)
        raise _Outside

    def _step(self, cond: z3.ExprRef, a: z3.ExprRef, b: z3.ExprRef) -> _Term:
        """``If(cond, a, b)`` where ``cond`` is about one index and ``a``, ``b`` are constant (or such steps)."""
        c, kinds = self._bool(cond)
        then, other = self._term(a), self._term(b)
        axes = kinds - {"const"}
        if len(axes) > 1 or not axes <= {"q", "kv"} or then.variables() or other.variables():
            raise _Outside
        steps = then.steps | other.steps | axes
        if len(steps) > 1:
            raise _Outside
        tr, orr = then.run, other.run
        return _Term(lambda q, kv: tr(q, kv) if c(q, kv) else orr(q, kv), {}, frozenset(steps))

    def _chunk(self, x: z3.ExprRef, d: z3.ExprRef) -> _Term:
        """``index / C`` in z3 (Euclidean division: floor for C > 0, Python's ``//``)."""
        if d.decl().kind() != z3.Z3_OP_ANUM or d.sort_kind() != z3.Z3_INT_SORT or not 0 < d.as_long() <= _ROOT_MAX:
            raise _Outside
        size = d.as_long()
        if self.chunk not in (None, size):
            raise _Outside
        self.chunk = size
        if x.get_id() == self.ids[0]:
            return _Term(lambda q, kv: q // size, {"q/C": Fraction(1)})
        if x.get_id() == self.ids[1]:
            return _Term(lambda q, kv: kv // size, {"kv/C": Fraction(1)})
        raise _Outside

    # -- the cells ------------------------------------------------------------------------------------------
    def points(self) -> Iterator[tuple[int, int, int, int]]:
        """``(q, kv, lowest d, highest d)``: one point per cell, and the distances ``q - kv`` the cell holds
        (every one of them at some point of the cell, where every compiled formula has the same value)."""
        if self.chunk is not None:
            yield from self._chunk_points(self.chunk)
            return
        kvs = _intervals(self.starts["kv"])
        for q1, q2 in _intervals(self.starts["q"]):
            for k1, k2 in kvs:
                for d1, d2 in _intervals(self.starts["d"], q1 - k2, q2 - k1):
                    q = max(q1, k1 + d1)
                    yield q, q - d1, d1, d2

    def _chunk_points(self, size: int) -> Iterator[tuple[int, int, int, int]]:
        """Atoms see only the distance and whether the key's chunk is the query's, earlier or later: the
        same chunk holds distances up to ``size - 1`` either way, another every distance of its side."""
        for lo, hi in ((-(size - 1), size - 1), (1, _LIMIT), (-_LIMIT, -1)):
            same = lo <= 0 <= hi  # the same chunk: the only class holding the distance 0
            for d1, d2 in _intervals(self.starts["d"], lo, hi):
                if same:
                    q, kv = (d1, 0) if d1 >= 0 else (0, -d1)
                elif d1 > 0:
                    q, kv = (size - 1 + d1, size - 1) if size - 1 + d1 <= _LIMIT else (d1, 0)
                else:
                    q, kv = (size - 1, size - 1 - d1) if size - 1 - d1 <= _LIMIT else (0, -d1)
                yield q, kv, d1, d2


def _combine(parts: list[_Term], signs: list[int]) -> dict[str, Fraction]:
    out: dict[str, Fraction] = {}
    for part, sign in zip(parts, signs):
        for k, v in part.linear.items():
            out[k] = out.get(k, Fraction(0)) + sign * v
    return out


def _intervals(starts: set[int], lo: int = 0, hi: int = _LIMIT) -> list[tuple[int, int]]:
    """``[lo, hi]`` split at each start inside it."""
    cut = sorted({lo} | {s for s in starts if lo < s <= hi})
    return [(a, b - 1) for a, b in zip(cut, cut[1:])] + [(cut[-1], hi)] if lo <= hi else []


# ----------------------------------------------------------------------------- the decision
def decide(mask: z3.BoolRef, q: z3.ArithRef, kv: z3.ArithRef) -> Optional[Pattern]:
    """The pattern ``mask`` equals on the whole domain, derived and proven cell by cell as the solver path
    derives and proves it (same candidate, same order: full, a window, chunks, documents); None when the
    formula is outside the recognised subset or no candidate is equal (the solver then gives its verdict)."""
    cells = Cells(q, kv)
    try:
        hook = cells.compile(mask)
        allowed = [(d1, d2) for a, b, d1, d2 in cells.points() if hook(a, b)]
        if not allowed:
            return None
        left, right = _reach(max(d2 for _, d2 in allowed)), _reach(max(-d1 for d1, _ in allowed))
        if left < -1 or right < -1:
            return None
        candidates = [FULL, Pattern(left, right)]
        if left != 0:  # the solver path looks for documents only beside a window that reaches back
            gaps = _gaps(cells, hook)
            if gaps and cells.chunk is not None:
                inside = lambda bound: bound if 0 <= bound < gaps[0] - 1 else -1  # noqa: E731 - as the solver's
                candidates.append(Pattern(inside(left), inside(right), chunk=gaps[0]))
            elif gaps and len(gaps) <= MAX_CUTS:
                candidates.append(Pattern(left, right, cuts=tuple(gaps)))
        for candidate in candidates:
            expected = cells.compile(pattern_formula(candidate, q, kv))
            if all(hook(a, b) == expected(a, b) for a, b, _, _ in cells.points()):
                return candidate
    except (_Outside, z3.Z3Exception, RecursionError):  # not modelled here: the solver decides
        return None
    return None


def _reach(value: int) -> int:
    """A widest reach as the solver path maps it: unbounded is -1, a negative one falls below -1."""
    return -1 if abs(value) >= _UNBOUNDED else value - (value < 0)


def _gaps(cells: Cells, hook: Eval) -> list[int]:
    """The first positions ``q >= 1`` whose key ``q - 1`` the mask blocks (where documents start), in order, up
    to one more than `MAX_CUTS`: the points the solver path finds one by one."""
    if cells.chunk is not None:  # the same chunk, or the next one, from each query's first key before it
        return [q for q in sorted({1, cells.chunk}) if not hook(q, q - 1)][:1]
    starts = {1} | cells.starts["q"] | {s + 1 for s in cells.starts["kv"]}
    found: list[int] = []
    for lo, hi in _intervals(starts, 1, _LIMIT):
        if not hook(lo, lo - 1):
            found.extend(range(lo, min(hi, lo + MAX_CUTS) + 1))
            if len(found) > MAX_CUTS:
                return found[:MAX_CUTS + 1]
    return found
