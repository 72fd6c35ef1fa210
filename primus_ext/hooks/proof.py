"""Proofs that a user hook equals what a fixed Primus-Turbo kernel computes (B31).

A mask hook runs on a fixed kernel only when it is *proven* equal, for every batch
index, head of the layer, query and key position (no sequence length is assumed),
to one of the kernel patterns: full, a flash window ``(left, right)``, equal-length
chunks, or documents cut at constant positions, each optionally windowed inside.
A score hook is proven the identity, ALiBi ``score + slope[h] * (kv - q)`` or symmetric
ALiBi ``score - slope[h] * |q - kv|`` over the reals, one float32 slope per head.

The hook is checked against the provable subset (`hook_subset`), traced (`hook_trace`),
turned into a z3 formula (`hook_z3`) and the candidate pattern is derived by the solver
itself (the widest reach to either side, the first position where a document starts),
then proven equal (score hooks: `hook_score`).  Formulas of a shape modelled exactly are
decided without it, with the same candidates: windows (`window`), documents and chunks
(`structure`), per-head score tables (`bias`); anything else goes to the solver.  Nothing is sampled: either the solver
proves equality, or the hook is not run on a kernel; a proof is then cross-checked
against the hook called as torch calls it (`hook_crosscheck`), which can only refuse.

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
from typing import Any, Callable, Optional, Union

import torch
import z3

from . import crosscheck
from .subset import Outside
from .trace import Assumption, HookTrace, cell_assumptions, trace_hook
from .ops import INDEX_BOUND, Unsupported, boolean
from .score import ALIBI, SYMMETRIC, ScoreProof, hook_class, prove_score_trace
from .solver import broken_obligation, extreme, head_domain, solve, uses_reals, where_text
from .window import difference_window
from .structure import MAX_CUTS, decide, pattern_formula
from .encoder import Encoder
from ..attention.library import library_name, library_pattern
from ..attention.pattern import FULL, MaskMod, Pattern, ScoreMod

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
        return hook_class(self.outside, self.pattern is not None)


# ----------------------------------------------------------------------------- masks
class _MaskProver:
    def __init__(self, trace: HookTrace, num_heads: Optional[int], head_offset: int = 0) -> None:
        self.trace = trace
        self.b, self.h, self.q, self.kv = z3.Ints("b h q_idx kv_idx")
        self.head_offset = head_offset  # the rank's first (global) head: `primus_ext.attention.heads`
        self.domain = [z3.And(v >= 0, v < INDEX_BOUND) for v in (self.b, self.h, self.q, self.kv)]
        self.domain.append(head_domain(self.h, num_heads, head_offset))
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
        if encoder.dtypes is None:  # torch's promotion of its values is then unknown: no integer width is checked
            return self.result(None, "cannot be run once as torch calls it (vmap over 0-d indices) to read the dtypes "
                                     "torch computes its values in")
        try:
            mask = boolean(encoder.run({"b": self.b, "h": self.h, "q_idx": self.q, "kv_idx": self.kv}))
        except Unsupported as exc:
            return self.result(None, str(exc))
        if uses_reals(mask):
            return self.result(None, "computes with floating-point values of the indices, which torch "
                                     "rounds (float32); write the mask with integer arithmetic")
        why = broken_obligation(encoder, self.domain, self.names)
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
        status, model = solve(*self.domain, mask != first)
        if status == "unsat":
            return ""
        if model is None:
            return "could not be proven independent of the batch and head indices within the time limit"
        allows = z3.is_true(model.eval(mask, model_completion=True))
        words = [w for w, v, at in (("batch", self.b, 0), ("head", self.h, self.head_offset))
                 if model.eval(v, model_completion=True).as_long() != at]
        return (f"depends on the {' and '.join(words)} index: at {where_text(model, self.names)} it "
                f"{'allows' if allows else 'blocks'} attention, at b=0, h={self.head_offset} it does not; fixed "
                "kernels share one mask across batch and heads")

    def classify(self, mask: z3.BoolRef) -> MaskProof:
        window = difference_window(mask, self.q, self.kv)  # the common hooks: exact without the solver
        if window is not None:
            return self.result(window, f"proven {window.describe()} for every position")
        decided = decide(mask, self.q, self.kv)  # documents and chunks: exact without the solver
        if decided is not None:
            return self.result(decided, "proven full attention" if decided == FULL else
                               f"proven {decided.describe()} for every position")
        guess = self.guess()
        if guess is not None and self.differs(mask, guess) is None:
            return self.result(guess, f"proven {guess.describe()} for every position")
        status, _ = solve(*self.domain, z3.Not(mask))
        if status == "unsat":
            return self.result(FULL, "proven full attention")
        status, _ = solve(*self.domain, mask)
        if status == "unsat":
            return self.result(None, "allows no key for any query")
        allowed = [*self.domain, mask]
        left = extreme(self.q - self.kv, allowed)
        right = extreme(self.kv - self.q, allowed)
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
        status, model = solve(*self.domain, mask != expected)
        if status == "unsat":
            return None
        if model is None:
            return f"could not be proven equal to {pattern.describe()} within the solver's time limit"
        allows = z3.is_true(model.eval(mask, model_completion=True))
        mine, theirs = ("allows", "blocks") if allows else ("blocks", "allows")
        return (f"differs from {pattern.describe()}: at {where_text(model, self.names)} the hook {mine} attention, "
                f"{pattern.describe()} {theirs} it")

    def documents(self, mask: z3.BoolRef, left: int, right: int) -> Union[Pattern, str]:
        if left == 0:
            return ""
        gap = z3.Not(z3.substitute(mask, (self.kv, self.q - 1)))
        first = extreme(self.q, [*self.domain, self.q >= 1, gap], minimize=True)
        if not isinstance(first, int):
            return ""
        inside = lambda bound: bound if 0 <= bound < first - 1 else -1  # noqa: E731 - a bound a chunk never reaches
        chunks = Pattern(inside(left), inside(right), chunk=first)
        if self.differs(mask, chunks) is None:
            return chunks
        cuts = [first]
        while len(cuts) <= MAX_CUTS:
            nxt = extreme(self.q, [*self.domain, self.q > cuts[-1], gap], minimize=True)
            if not isinstance(nxt, int):
                break
            cuts.append(nxt)
        if len(cuts) > MAX_CUTS:
            return f"; it has more than {MAX_CUTS} document boundaries (pack documents as THD instead)"
        documents = Pattern(left, right, cuts=tuple(cuts))
        why = self.differs(mask, documents)
        return documents if why is None else f"; as {documents.describe()}: {why}"


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
    trace = trace_hook(hook, kind)
    proof = _cross_checked(hook, kind, prove(trace, num_heads, head_offset), num_heads, head_offset,
                           graph_constants(trace))
    per_object[key] = proof
    if fingerprint is not None:
        if len(_BY_FINGERPRINT) >= _FINGERPRINTS_MAX:
            _BY_FINGERPRINT.clear()
        _BY_FINGERPRINT[fingerprint] = proof
    return proof


def graph_constants(trace: HookTrace) -> tuple[int, ...]:
    """The integer constants of a traced hook and the lengths of the tensors it reads: where its arithmetic may
    begin to wrap, a comparison to flip or an index to leave a table (points for the cross-check)."""
    if trace.graph is None:
        return ()
    found: set[int] = set()

    def visit(value: Any) -> None:
        if type(value) is int:
            found.add(value)
        elif isinstance(value, (tuple, list)):
            for v in value:
                visit(v)

    for node in trace.graph.graph.nodes:
        if node.op == "get_attr":
            table = getattr(trace.graph, node.target)
            if isinstance(table, torch.Tensor) and table.dim() == 1:
                found.add(table.numel())
            if isinstance(table, torch.Tensor) and table.numel() == 1 and not table.dtype.is_floating_point:
                found.add(int(table.reshape(())))  # a constant held in a tensor
        visit(node.args)
        visit(tuple(node.kwargs.values()))
    return tuple(sorted(found))


def _cross_checked(hook: Any, kind: str, proof: Any, num_heads: Optional[int], head_offset: int,
                   constants: tuple[int, ...] = ()) -> Any:
    """``proof`` unless the hook, called as torch calls it, disagrees with it (`hook_crosscheck`)."""
    if kind == "mask_mod" and proof.pattern is not None:
        why = crosscheck.check_mask(hook, proof.pattern, num_heads, head_offset, constants)
        return dataclasses.replace(proof, pattern=None, reason=why) if why else proof
    if kind == "score_mod" and proof.kind in ("identity", ALIBI, SYMMETRIC):
        why = crosscheck.check_score(hook, proof.kind, proof.alibi_slopes, num_heads, head_offset, constants)
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
    return _cached(score_mod, "score_mod", num_heads, head_offset, prove_score_trace)


__all__ = ["ALIBI", "SYMMETRIC", "MaskProof", "PROOFS", "ScoreProof", "pattern_formula", "prove_mask", "prove_score"]
