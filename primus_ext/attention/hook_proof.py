"""Proofs that a user hook equals what a fixed Primus-Turbo kernel computes (B31).

A mask hook runs on a fixed kernel only when it is *proven* equal, for every batch
index, head of the layer, query and key position (no sequence length is assumed),
to one of the kernel patterns: full, a flash window ``(left, right)``, equal-length
chunks, or documents cut at constant positions, each optionally windowed inside.
A score hook is proven the identity, ALiBi ``score + slope[h] * (kv - q)`` or symmetric
ALiBi ``score - slope[h] * |q - kv|`` over the reals, one float32 slope per head.

The hook is traced (`hook_trace`), turned into a z3 formula (`hook_z3`) and the
candidate pattern is derived by the solver itself (the widest reach to either side,
the first position where a document starts), then proven equal.  Nothing is sampled:
either the solver proves equality, or the hook is not run on a kernel.

Proofs are cached per hook, by identity and by a fingerprint of its code and closure
constants (a factory called again with the same arguments reuses the proof), so a
model proves each hook once, whatever its layer count or sequence length.
"""

from __future__ import annotations

import dataclasses
import types
import weakref
from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, Optional, Union

import torch
import z3

from . import hook_crosscheck as crosscheck
from .hook_subset import Outside
from .hook_trace import Assumption, HookTrace, cell_assumptions, trace_hook
from .hook_z3 import INDEX_BOUND, Encoder, Unsupported, boolean, num
from .library import library_name, library_pattern
from .pattern import FULL, MaskMod, Pattern, ScoreMod

TIMEOUT_MS = 2000  # per solver query; a query that times out proves nothing
MAX_CUTS = 64  # constant document boundaries looked for before giving up
GUESS_ROW = 1 << 12  # query row a candidate window is read from (then proven, never trusted)
PROOFS: Counter = Counter()
"""How many proofs were run (``mask_mod`` / ``score_mod``): cache hits do not count."""


@dataclass(frozen=True)
class MaskProof:
    """``pattern``: what the hook provably computes, or ``None`` (evaluate it, or refuse)."""

    pattern: Optional[Pattern]
    reason: str
    reads: tuple[str, ...] = ()
    assumptions: tuple[Assumption, ...] = field(default=(), compare=False)
    outside: Optional[Outside] = None

    @property
    def hook_class(self) -> str:
        """``proven`` (runs on a fixed kernel), ``admitted`` (in the provable subset, not a fixed kernel's
        attention: evaluated exactly) or ``dynamic`` (outside the subset: evaluated exactly, or refused)."""
        return "dynamic" if self.outside is not None else "proven" if self.pattern is not None else "admitted"


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
        """``proven`` (runs on a fixed kernel), ``admitted`` (in the provable subset, not a fixed kernel's
        attention: evaluated exactly) or ``dynamic`` (outside the subset: evaluated exactly, or refused)."""
        return "dynamic" if self.outside is not None else "proven" if self.kind in ("identity", ALIBI, SYMMETRIC) else "admitted"


# ----------------------------------------------------------------------------- solver helpers
def _solve(*constraints: Any) -> tuple[str, Optional[z3.ModelRef]]:
    solver = z3.Solver()
    solver.set("timeout", TIMEOUT_MS)
    solver.add(*constraints)
    result = solver.check()
    return str(result), (solver.model() if result == z3.sat else None)


def _extreme(objective: z3.ArithRef, constraints: list[Any], *, minimize: bool = False) -> Union[int, str]:
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


def _where(model: z3.ModelRef, names: dict[str, z3.ExprRef]) -> str:
    parts = []
    for label, var in names.items():
        value = model.eval(var, model_completion=True)
        parts.append(f"{label}={value.as_decimal(6) if z3.is_real(value) else value}")
    return ", ".join(parts)


def _uses_reals(formula: z3.ExprRef) -> bool:
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


def _broken_obligation(encoder: Encoder, domain: list[Any], names: dict[str, z3.ExprRef]) -> str:
    """Empty when every obligation (index ranges, no overflow) holds for all inputs: one query."""
    if not encoder.obligations:
        return ""
    status, model = _solve(*domain, z3.Not(z3.And(*[o for o, _ in encoder.obligations])))
    if status == "unsat":
        return ""
    if model is None:
        return "could not be checked within the solver's time limit"
    for obligation, text in encoder.obligations:
        if not z3.is_true(model.eval(obligation, model_completion=True)):
            return f"{text} at {_where(model, names)}"
    return "breaks an obligation"


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


def _head_domain(h: z3.ArithRef, num_heads: Optional[int], head_offset: int) -> z3.BoolRef:
    """``h`` is one of the rank's global heads, ``head_offset .. head_offset + num_heads - 1``."""
    return z3.And(h >= head_offset, h < head_offset + num_heads) if num_heads else h >= head_offset


# ----------------------------------------------------------------------------- masks
class _MaskProver:
    def __init__(self, trace: HookTrace, num_heads: Optional[int], head_offset: int = 0) -> None:
        self.trace = trace
        self.b, self.h, self.q, self.kv = z3.Ints("b h q_idx kv_idx")
        self.head_offset = head_offset  # the rank's first (global) head: `primus_ext.attention.heads`
        self.domain = [z3.And(v >= 0, v < INDEX_BOUND) for v in (self.b, self.h, self.q, self.kv)]
        self.domain.append(_head_domain(self.h, num_heads, head_offset))
        self.names = {"b": self.b, "h": self.h, "q": self.q, "kv": self.kv}

    def result(self, pattern: Optional[Pattern], reason: str) -> MaskProof:
        trace = self.trace
        return MaskProof(pattern, reason, tuple(trace.reads), tuple(trace.assumptions), trace.outside)

    def run(self) -> MaskProof:
        trace = self.trace
        if trace.graph is None:
            return self.result(None, trace.problem)
        if trace.dynamic:
            return self.result(None, "reads " + "; ".join(trace.dynamic))
        encoder = Encoder(trace.graph, trace.tensor_names)
        try:
            mask = boolean(encoder.run({"b": self.b, "h": self.h, "q_idx": self.q, "kv_idx": self.kv}))
        except Unsupported as exc:
            return self.result(None, str(exc))
        if _uses_reals(mask):
            return self.result(None, "computes with floating-point values of the indices, which torch "
                                     "rounds (float32); write the mask with integer arithmetic")
        why = _broken_obligation(encoder, self.domain, self.names)
        if why:
            return self.result(None, why)
        first = z3.substitute(mask, (self.b, z3.IntVal(0)), (self.h, z3.IntVal(self.head_offset)))
        why = self.shared_across_batch_and_heads(mask, first)
        if why:
            return self.result(None, why)
        return self.classify(first)

    def shared_across_batch_and_heads(self, mask: z3.BoolRef, first: z3.BoolRef) -> str:
        """Empty when ``mask`` equals ``first`` (its b = 0, first-head slice) everywhere: kernels share one."""
        if not {"the batch index", "the head index"} & set(self.trace.reads):
            return ""
        status, model = _solve(*self.domain, mask != first)
        if status == "unsat":
            return ""
        if model is None:
            return "could not be proven independent of the batch and head indices within the time limit"
        allows = z3.is_true(model.eval(mask, model_completion=True))
        words = [w for w, v, at in (("batch", self.b, 0), ("head", self.h, self.head_offset))
                 if model.eval(v, model_completion=True).as_long() != at]
        return (f"depends on the {' and '.join(words)} index: at {_where(model, self.names)} it "
                f"{'allows' if allows else 'blocks'} attention, at b=0, h={self.head_offset} it does not; fixed "
                "kernels share one mask across batch and heads")

    def classify(self, mask: z3.BoolRef) -> MaskProof:
        guess = self.guess()
        if guess is not None and self.differs(mask, guess) is None:
            return self.result(guess, f"proven {guess.describe()} for every position")
        status, _ = _solve(*self.domain, z3.Not(mask))
        if status == "unsat":
            return self.result(FULL, "proven full attention")
        status, _ = _solve(*self.domain, mask)
        if status == "unsat":
            return self.result(None, "allows no key for any query")
        allowed = [*self.domain, mask]
        left = _extreme(self.q - self.kv, allowed)
        right = _extreme(self.kv - self.q, allowed)
        if "unknown" in (left, right):
            return self.result(None, "could not be decided by the solver within its time limit")
        left = -1 if left == "unbounded" else left - (left < 0)  # a negative reach maps below -1
        right = -1 if right == "unbounded" else right - (right < 0)
        if left < -1 or right < -1:  # e.g. kv < q: the diagonal itself is excluded
            return self.result(None, "never lets a query see its own position (no flash window has that shape)")
        window = Pattern(left, right)
        why = self.differs(mask, window)
        if why is None:
            return self.result(window, f"proven {window.describe()} for every position")
        docs = self.documents(mask, left, right)
        if isinstance(docs, Pattern):
            return self.result(docs, f"proven {docs.describe()} for every position")
        return self.result(None, why + docs)

    def guess(self) -> Optional[Pattern]:
        """A window read off one row of the hook, evaluated: only a candidate to prove.

        Most hooks are a window, and one equality proof is far cheaper than deriving the
        candidate with the solver.  The row sits far from both ends, so windows up to
        `GUESS_ROW` keys wide show their bounds; a wrong guess just falls back to the
        derivation.
        """
        q, kv = GUESS_ROW, torch.arange(2 * GUESS_ROW + 1)
        zero = torch.zeros((), dtype=torch.long)
        try:
            with torch.no_grad():
                row = self.trace.graph(zero, torch.tensor(self.head_offset), torch.tensor(q), kv)
            allowed = torch.broadcast_to(torch.as_tensor(row, dtype=torch.bool), kv.shape)
        except Exception:  # noqa: BLE001 - the hook as traced cannot run concretely: no guess
            return None
        keys = kv[allowed]
        if keys.numel() == 0 or keys.numel() != int(keys[-1] - keys[0]) + 1:
            return None  # not one run of keys: not a window
        first, last = int(keys[0]), int(keys[-1])
        if first > q or last < q:
            return None
        left = -1 if first == 0 else q - first
        right = -1 if last == 2 * GUESS_ROW else last - q
        return Pattern(left, right)

    def differs(self, mask: z3.BoolRef, pattern: Pattern) -> Optional[str]:
        expected = pattern_formula(pattern, self.q, self.kv)
        status, model = _solve(*self.domain, mask != expected)
        if status == "unsat":
            return None
        if model is None:
            return f"could not be proven equal to {pattern.describe()} within the solver's time limit"
        allows = z3.is_true(model.eval(mask, model_completion=True))
        mine, theirs = ("allows", "blocks") if allows else ("blocks", "allows")
        return f"at {_where(model, self.names)} the hook {mine} attention but {pattern.describe()} {theirs} it"

    def documents(self, mask: z3.BoolRef, left: int, right: int) -> Union[Pattern, str]:
        if left == 0:
            return ""
        gap = z3.Not(z3.substitute(mask, (self.kv, self.q - 1)))
        first = _extreme(self.q, [*self.domain, self.q >= 1, gap], minimize=True)
        if not isinstance(first, int):
            return ""
        inside = lambda bound: bound if 0 <= bound < first - 1 else -1  # noqa: E731 - a bound a chunk never reaches
        chunks = Pattern(inside(left), inside(right), chunk=first)
        if self.differs(mask, chunks) is None:
            return chunks
        cuts = [first]
        while len(cuts) <= MAX_CUTS:
            nxt = _extreme(self.q, [*self.domain, self.q > cuts[-1], gap], minimize=True)
            if not isinstance(nxt, int):
                break
            cuts.append(nxt)
        if len(cuts) > MAX_CUTS:
            return f"; it has more than {MAX_CUTS} document boundaries (pack documents as THD instead)"
        documents = Pattern(left, right, cuts=tuple(cuts))
        why = self.differs(mask, documents)
        return documents if why is None else f"; as {documents.describe()}: {why}"


# ----------------------------------------------------------------------------- scores
def _float32(value: Fraction) -> bool:
    return Fraction(torch.tensor(float(value), dtype=torch.float32).item()) == value


def _prove_score(trace: HookTrace, num_heads: Optional[int], head_offset: int = 0) -> ScoreProof:
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
    score = z3.Real("score")
    b, h, q, kv = z3.Ints("b h q_idx kv_idx")
    names = {"score": score, "b": b, "h": h, "q": q, "kv": kv}
    domain = [z3.And(v >= 0, v < INDEX_BOUND) for v in (b, h, q, kv)] + [_head_domain(h, num_heads, head_offset)]
    per_head = "the head index" in trace.reads and bool(num_heads)
    first_head, count = head_offset, int(num_heads or 0)  # the rank's global heads, whose slopes these are
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
    why = _broken_obligation(merged, domain, names)
    if why:
        return result("other", why)
    status, model = _solve(*domain, z3.Or([out != expected for _, out, expected, _ in cases]))
    if status != "unsat":
        if model is None:
            return result("other", "could not be decided by the solver within its time limit")
        for (head, out, expected, _), slope in zip(cases, slopes):
            if z3.is_true(model.eval(out != expected, model_completion=True)):
                got = model.eval(out, model_completion=True).as_decimal(6)
                form = "the score unchanged" if slope == 0 else (
                    f"score - {float(slope):g} * |q - kv|" if symmetric else f"score + {float(slope):g} * (kv - q)")
                where = _where(model, names) if head is None else _where(model, names).replace(
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


def _offset(diff: Any, names: dict, head: Optional[int], q_at: int, kv_at: int) -> Optional[Fraction]:
    """``hook - score`` at one cell (score 0, b 0), as an exact number, or None if it is no constant."""
    at = z3.simplify(z3.substitute(diff, (names["score"], z3.RealVal(0)), (names["b"], z3.IntVal(0)),
                                   (names["h"], z3.IntVal(head or 0)), (names["q"], z3.IntVal(q_at)),
                                   (names["kv"], z3.IntVal(kv_at))))
    if not (z3.is_rational_value(at) or z3.is_int_value(at)):
        return None
    return Fraction(str(at.as_fraction() if z3.is_rational_value(at) else at.as_long()))


# ----------------------------------------------------------------------------- cache
_BY_OBJECT: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
_BY_FINGERPRINT: dict[Any, Any] = {}
_FINGERPRINTS_MAX = 1024


class _Unhashable(Exception):
    pass


_SCALARS = (bool, int, str, type(None))


def _value_key(value: Any, seen: frozenset[int] = frozenset()) -> Any:
    """A hashable key that differs whenever two closure values could differ (exact types)."""
    if id(value) in seen:
        raise _Unhashable  # a closure that refers to itself
    if type(value) is types.FunctionType:
        return _fingerprint(value, seen | {id(value)})
    if type(value) is tuple:
        return tuple(_value_key(v, seen | {id(value)}) for v in value)
    if type(value) in _SCALARS:
        return (type(value), value)
    if type(value) is float:
        return (float, value.hex())  # -0.0 and 0.0 differ
    if isinstance(value, torch.dtype) or type(value) is Pattern:
        return (type(value), value)
    raise _Unhashable


def _fingerprint(fn: types.FunctionType, seen: frozenset[int] = frozenset()) -> Any:
    cells = tuple(_value_key(c.cell_contents, seen) for c in fn.__closure__ or ())
    kwdefaults = tuple(sorted((fn.__kwdefaults__ or {}).items()))
    return (fn.__code__, id(fn.__globals__), cells, _value_key(fn.__defaults__, seen),
            _value_key(kwdefaults, seen))


def _cached(hook: Any, kind: str, num_heads: Optional[int], head_offset: int,
            prove: Callable[[HookTrace, Optional[int], int], Any]) -> Any:
    key = (kind, num_heads, head_offset)
    fingerprint = None
    if isinstance(hook, types.FunctionType):
        try:
            fingerprint = (_fingerprint(hook), key)
        except (_Unhashable, ValueError, RecursionError):  # ValueError: an empty closure cell
            fingerprint = None
    try:
        per_object = _BY_OBJECT.setdefault(hook, {})
    except TypeError:
        per_object = {}
    found = per_object.get(key)
    if found is None and fingerprint is not None and fingerprint in _BY_FINGERPRINT:
        shared = _BY_FINGERPRINT[fingerprint]  # proven for an equal closure: check this one's cells too
        found = dataclasses.replace(shared, assumptions=shared.assumptions + cell_assumptions(hook))
    if found is not None and all(a.holds() for a in found.assumptions):
        per_object[key] = found
        return found
    PROOFS[kind] += 1
    proof = _cross_checked(hook, kind, prove(trace_hook(hook, kind), num_heads, head_offset), num_heads, head_offset)
    per_object[key] = proof
    if fingerprint is not None:
        if len(_BY_FINGERPRINT) >= _FINGERPRINTS_MAX:
            _BY_FINGERPRINT.clear()
        _BY_FINGERPRINT[fingerprint] = proof
    return proof


def _cross_checked(hook: Any, kind: str, proof: Any, num_heads: Optional[int], head_offset: int) -> Any:
    """``proof`` unless the hook, called as torch calls it, disagrees with it (`hook_crosscheck`)."""
    if kind == "mask_mod" and proof.pattern is not None:
        why = crosscheck.check_mask(hook, proof.pattern, num_heads, head_offset)
        return dataclasses.replace(proof, pattern=None, reason=why) if why else proof
    if kind == "score_mod" and proof.kind in ("identity", ALIBI, SYMMETRIC):
        why = crosscheck.check_score(hook, proof.kind, proof.alibi_slopes, num_heads, head_offset)
        return dataclasses.replace(proof, kind="other", alibi_slopes=None, reason=why) if why else proof
    return proof


# ----------------------------------------------------------------------------- public
def prove_mask(mask_mod: Optional[MaskMod], *, num_heads: Optional[int] = None, head_offset: int = 0) -> MaskProof:
    """What ``mask_mod`` provably computes for the global heads ``head_offset .. head_offset + num_heads - 1``
    (a rank's heads, `primus_ext.attention.heads`; every head from ``head_offset`` on if ``num_heads`` is None)."""
    if mask_mod is None:
        return MaskProof(FULL, "no mask_mod: full attention")
    known = library_pattern(mask_mod)
    if known is not None:
        return MaskProof(known, f"library mask {library_name(mask_mod)}: {known.describe()}")
    return _cached(mask_mod, "mask_mod", num_heads, head_offset, lambda t, n, o: _MaskProver(t, n, o).run())


def prove_score(score_mod: Optional[ScoreMod], *, num_heads: Optional[int] = None,
                head_offset: int = 0) -> ScoreProof:
    """Whether ``score_mod`` is provably the identity or ALiBi for the global heads ``head_offset ..
    head_offset + num_heads - 1`` (the slopes are those heads' own, in order)."""
    if score_mod is None:
        return ScoreProof("identity", None, "no score_mod")
    return _cached(score_mod, "score_mod", num_heads, head_offset, _prove_score)


__all__ = ["MaskProof", "PROOFS", "ScoreProof", "pattern_formula", "prove_mask", "prove_score"]
