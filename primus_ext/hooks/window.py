"""A mask that depends on ``q_idx - kv_idx`` only, decided without the solver (B31).

Most hooks people write (causal, sliding windows, bands, full) compare the distance
``d = q_idx - kv_idx`` with constants.  After the substitution ``kv_idx = q_idx - d``, z3's
simplifier leaves such a mask as a boolean combination of atoms ``d <op> c``, which is
constant between consecutive constants: evaluating it at every constant and one either
side decides it exactly on the whole index domain.  Anything else (``//``, a table, ``q_idx``
left over) returns ``None`` and the mask goes to the solver as before.
"""

from __future__ import annotations

from typing import Optional

import z3

from .ops import INDEX_BOUND
from ..attention.pattern import Pattern

_COMPARISONS = (z3.is_le, z3.is_lt, z3.is_ge, z3.is_gt, z3.is_eq, z3.is_distinct)
_LIMIT = INDEX_BOUND - 1  # |q_idx - kv_idx| reaches this inside the proofs' domain
_UNBOUNDED = INDEX_BOUND // 2  # the solver path's threshold for an unbounded reach


def _atoms(e: z3.ExprRef, d: z3.ArithRef, constants: set[int]) -> bool:
    """True when ``e`` is a boolean combination of ``d <op> constant``; collects the constants."""
    if z3.is_true(e) or z3.is_false(e):
        return True
    if z3.is_and(e) or z3.is_or(e) or z3.is_not(e) or (z3.is_app_of(e, z3.Z3_OP_ITE) and z3.is_bool(e)) or (
            z3.is_eq(e) and z3.is_bool(e.arg(0))):
        return all(_atoms(c, d, constants) for c in e.children())
    if any(test(e) for test in _COMPARISONS) and e.num_args() == 2:
        for side in e.children():
            if z3.is_int_value(side):
                constants.add(side.as_long())
            elif not side.eq(d):
                return False
        return True
    return False


def difference_window(mask: z3.BoolRef, q: z3.ArithRef, kv: z3.ArithRef) -> Optional[Pattern]:
    """The flash window ``mask`` (over ``q``, ``kv`` only) equals on the whole domain, if it depends on
    ``q - kv`` alone through comparisons with constants and is one interval around the diagonal."""
    d = z3.Int("q_minus_kv")
    g = z3.simplify(z3.substitute(mask, (kv, q - d)))
    constants: set[int] = set()
    if not _atoms(g, d, constants):
        return None
    points = sorted({p for c in constants | {0} for p in (c - 1, c, c + 1) if -_LIMIT <= p <= _LIMIT}
                    | {-_LIMIT, _LIMIT})
    # Between consecutive points no constant lies, so each value holds up to the next point.
    allowed = [z3.is_true(z3.simplify(z3.substitute(g, (d, z3.IntVal(p))))) for p in points]
    runs = [(points[i], (points[i + 1] - 1) if i + 1 < len(points) else _LIMIT)
            for i, ok in enumerate(allowed) if ok]
    merged: list[list[int]] = []
    for lo, hi in runs:
        if merged and lo == merged[-1][1] + 1:
            merged[-1][1] = hi
        else:
            merged.append([lo, hi])
    if len(merged) != 1 or not merged[0][0] <= 0 <= merged[0][1]:
        return None
    lo, hi = merged[0]
    if not (hi == _LIMIT or hi < _UNBOUNDED) or not (lo == -_LIMIT or -lo < _UNBOUNDED):
        return None  # a reach the solver path would call unbounded: leave the verdict to it
    return Pattern(-1 if hi == _LIMIT else hi, -1 if lo == -_LIMIT else -lo)


__all__ = ["difference_window"]
