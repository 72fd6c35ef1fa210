"""Proofs that a score hook is the identity or one of the two ALiBi forms the kernels compute (B31, B35)."""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Optional

import torch
import z3

from .ops import INDEX_BOUND, Unsupported, num
from .solver import broken_obligation, head_domain, solve, where_text
from .subset import Outside
from .trace import Assumption, HookTrace
from .encoder import Encoder, node_dtypes
from .floats import score_path
from .bias import per_head


@dataclass(frozen=True)
class ScoreProof:
    """``kind``: ``identity``, ``alibi`` (``score + slope * (kv - q)``, float32 slopes), ``alibi-symmetric``
    (``score - slope * |q - kv|``, the form bidirectional encoders use), ``softcap`` or ``other``."""

    kind: str
    alibi_slopes: Optional[tuple[float, ...]]
    reason: str
    reads: tuple[str, ...] = ()
    assumptions: tuple[Assumption, ...] = field(default=(), compare=False)
    outside: Optional[Outside] = None

    @property
    def hook_class(self) -> str:
        return hook_class(self.outside, self.kind in ("identity", ALIBI, SYMMETRIC))


def hook_class(outside: Optional[Outside], fixed: bool) -> str:
    """``proven`` (runs on a fixed kernel), ``admitted`` (in the provable subset, not a fixed kernel's
    attention: evaluated exactly) or ``dynamic`` (outside the subset: evaluated exactly, or refused)."""
    return "dynamic" if outside is not None else "proven" if fixed else "admitted"


def _float32(value: Fraction) -> bool:
    return Fraction(torch.tensor(float(value), dtype=torch.float32).item()) == value


def prove_score_trace(trace: HookTrace, num_heads: Optional[int], head_offset: int = 0) -> ScoreProof:
    reads, assumptions = tuple(trace.reads), tuple(trace.assumptions)

    def result(kind: str, reason: str, slopes: Optional[tuple[float, ...]] = None) -> ScoreProof:
        return ScoreProof(kind, slopes, reason, reads, assumptions, trace.outside)

    if trace.graph is not None and any(getattr(n.target, "__name__", n.target) == "tanh"
                                       for n in trace.graph.graph.nodes):
        return result("softcap", "uses tanh, a logit softcap")
    if trace.graph is None:
        return result("other", trace.problem)
    if trace.dynamic:
        return result("other", "reads " + "; ".join(trace.dynamic))
    path = score_path(trace.graph, node_dtypes(trace.graph))
    if path.problem:
        return result("other", path.problem)
    score = z3.Real("score")
    b, h, q, kv = z3.Ints("b h q_idx kv_idx")
    names = {"score": score, "b": b, "h": h, "q": q, "kv": kv}
    domain = [z3.And(v >= 0, v < INDEX_BOUND) for v in (b, h, q, kv)] + [head_domain(h, num_heads, head_offset)]
    per_head = "the head index" in trace.reads and bool(num_heads)
    first_head, count = head_offset, int(num_heads or 0)  # the rank's global heads, whose slopes these are
    if per_head:  # one encoding for every head; what it cannot decide is proven head by head below
        found = _all_heads(trace, names, domain, range(first_head, first_head + count))
        if found is not None:
            if all(slope == 0 for slope in found):
                return result("identity", "proven to return the score unchanged")
            values = tuple(float(s) for s in found)
            return result(ALIBI, f"proven ALiBi: score + slope[h] * (kv - q) with slopes {list(values)}", values)
    heads: list[Optional[int]] = list(range(first_head, first_head + count)) if per_head else [None]
    slopes: list[Fraction] = []
    forms: list[str] = []  # each head's candidate form
    cases: list[tuple[Optional[int], z3.ArithRef, z3.ArithRef, Encoder]] = []
    for head in heads:  # encode every head first: then one solver query covers them all
        encoder = Encoder(trace.graph, trace.tensor_names)
        h_value = h if head is None else z3.IntVal(head)
        try:
            out = num(encoder.run({"score": score, "b": b, "h": h_value, "q_idx": q, "kv_idx": kv}))
        except Unsupported as exc:
            return result("other", str(exc))
        out = z3.ToReal(out) if z3.is_int(out) else out
        right, left = (_offset(out - score, names, head, q_at, kv_at) for q_at, kv_at in ((0, 1), (1, 0)))
        if right is None or left is None:
            return result("other", "its offset from the score is not a constant times the distance (kv_idx - q_idx)")
        # The candidate form, from one key right and one left of the diagonal; the solver proves it.
        form = SYMMETRIC if (right == left and right != 0) else ALIBI
        slope = -right if form == SYMMETRIC else right
        if not _float32(slope):
            return result("other", f"has the ALiBi slope {float(slope)!r}"
                                   f"{'' if head is None else f' (head {head})'}, which is not a float32 value "
                                   "(Primus-Turbo's alibi_slopes are float32)")
        slopes.append(slope)
        forms.append(form)
        distance = z3.ToReal(kv - q)
        expected = score - z3.RealVal(slope) * z3.If(distance >= 0, distance, -distance) if form == SYMMETRIC \
            else score + z3.RealVal(slope) * distance
        cases.append((head, out, expected, encoder))
    if len({f for f, slope in zip(forms, slopes) if slope != 0}) > 1:  # one kernel formula serves all heads
        return result("other", "is ALiBi on some heads and symmetric ALiBi on others")
    symmetric = SYMMETRIC in forms
    merged = Encoder(trace.graph, trace.tensor_names)
    merged.obligations = [o for *_, enc in cases for o in enc.obligations]
    why = broken_obligation(merged, domain, names)
    if why:
        return result("other", why)
    status, model = solve(*domain, z3.Or([out != expected for _, out, expected, _ in cases]))
    if status != "unsat":
        if model is None:
            return result("other", "could not be decided by the solver within its time limit")
        for (head, out, expected, _), slope in zip(cases, slopes):
            if z3.is_true(model.eval(out != expected, model_completion=True)):
                got = model.eval(out, model_completion=True).as_decimal(6)
                form = "the score unchanged" if slope == 0 else (
                    f"score - {float(slope):g} * |q - kv|" if symmetric else f"score + {float(slope):g} * (kv - q)")
                where = where_text(model, names) if head is None else where_text(model, names).replace(
                    f"h={model.eval(h, model_completion=True)}", f"h={head}")
                return result("other", f"at {where} it gives {got}, not {form}: it is neither the "
                                       "identity nor ALiBi for every position and score")
    identity = all(slope == 0 for slope in slopes)
    if identity:
        return result("identity", "proven to return the score unchanged")
    values = tuple(float(s) for s in slopes) * (int(num_heads or 1) if len(slopes) == 1 else 1)
    if symmetric:
        return result(SYMMETRIC, f"proven symmetric ALiBi: score - slope[h] * |q - kv| with slopes {list(values)}",
                      values)
    return result(ALIBI, f"proven ALiBi: score + slope[h] * (kv - q) with slopes {list(values)}", values)


ALIBI, SYMMETRIC = "alibi", "alibi-symmetric"
"""The two ALiBi forms a score hook is proven to be (`ScoreProof.kind`)."""


def _all_heads(trace: HookTrace, names: dict[str, Any], domain: list[Any],
               heads: range) -> Optional[list[Fraction]]:
    """The float32 ALiBi slope of each head when the hook, encoded once with a symbolic head, is exactly
    ``score + slope[h] * (kv - q)`` for every head (`bias.per_head`) and keeps its obligations; else None."""
    encoder = Encoder(trace.graph, trace.tensor_names)
    try:
        out = num(encoder.run({"score": names["score"], "b": names["b"], "h": names["h"], "q_idx": names["q"],
                               "kv_idx": names["kv"]}))
    except Unsupported:
        return None
    poly = per_head(out, names, heads, encoder.tables)
    if poly is None or any(c != 1 for c in poly["score"]) or any(c != 0 for c in poly["1"]) or any(
            a != -b for a, b in zip(poly["q"], poly["kv"])):
        return None
    slopes = poly["kv"]
    if not all(_float32(s) for s in slopes):
        return None
    if broken_obligation(encoder, domain, names, {"h": (heads.start, heads.stop - 1)}):
        return None
    return slopes


def _offset(diff: Any, names: dict, head: Optional[int], q_at: int, kv_at: int) -> Optional[Fraction]:
    """``hook - score`` at one cell (score 0, b 0), as an exact number, or None if it is no constant."""
    at = z3.simplify(z3.substitute(diff, (names["score"], z3.RealVal(0)), (names["b"], z3.IntVal(0)),
                                   (names["h"], z3.IntVal(head or 0)), (names["q"], z3.IntVal(q_at)),
                                   (names["kv"], z3.IntVal(kv_at))))
    if not (z3.is_rational_value(at) or z3.is_int_value(at)):
        return None
    return Fraction(str(at.as_fraction() if z3.is_rational_value(at) else at.as_long()))


__all__ = ["ALIBI", "SYMMETRIC", "ScoreProof", "hook_class", "prove_score_trace"]
