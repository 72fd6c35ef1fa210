"""Which Primus-Turbo kernel backend takes a call, per arch: one model, as data (B33).

``flash_attn_func`` and ``flash_attn_varlen_func`` pick a kernel backend per call:
FlyDSL first, then the fallbacks in order (dense: AITER, then HipKittens; varlen:
AITER), or ``ValueError("No compatible backend found ...")``.  A backend that takes
a call can still assert on it, or compute it wrongly.  A signature says none of this,
so the rows of `primus_ext.backends.dispatch_rows` model it, each citing its upstream source,
per Primus-Turbo build (`primus_ext.backends.turbo_build`).  `route` answers for one call's features: which
backend runs, why the others do not, what the chosen one refuses, and which known
defect applies.  The plan refuses at build time whatever would fail or be wrong.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple

from .. import refusals as R
from ..errors import Reason
# re-exported: parts of the model
from .dispatch_rows import (AITER_DENSE, AITER_GFX942_STRIDED, AITER_SINK_LEFT_ZERO, AITER_SINK_RIGHT_WINDOW,
                            AITER_VARLEN, DENSE, FLYDSL, FLYDSL_VARLEN_STRIDES, GLUON, HIPKITTENS, ORDER, VARLEN,
                            CallFeatures, Check, KernelBackend, flydsl_group_ok, registered)
from .layout import LayoutError, infer_qkv_format, storage_features
from .turbo_build import BUILD_A6A16CD, BUILD_PT509, BUILDS, TurboBuild

ARCHES = ("gfx942", "gfx950")
ARCH_NAMES = {"gfx942": "MI300", "gfx950": "MI355"}


@dataclass(frozen=True)
class Selection:
    """How Primus-Turbo chooses among the backends that take a call (docs/fidelity.md, fact `dispatch-order`): a
    user pin (``PRIMUS_TURBO_ATTN_BACKEND`` / ``GlobalBackendManager.set_attn_backend``) first,
    then autotune (``PRIMUS_TURBO_AUTO_TUNE=1``, which Primus's ``use_turbo_autotune`` sets),
    then FlyDSL and the fallbacks in order.  Autotune times every backend that takes the call
    and keeps the fastest, which no model knows: the plan must hold for each of them."""

    pin: Optional[str] = None
    """Upstream's backend name (``AITER``, ``FLYDSL``, ``HIPKITTENS``), or None."""
    autotune: bool = False

    def describe(self) -> str:
        if self.pin is not None:
            return f"pinned to {self.pin} (PRIMUS_TURBO_ATTN_BACKEND)"
        return "autotuned (PRIMUS_TURBO_AUTO_TUNE / use_turbo_autotune)" if self.autotune else "the default order"


DEFAULT_ORDER = Selection()

_SELECTION_SETTINGS = ("PRIMUS_TURBO_ATTN_BACKEND", "use_turbo_autotune")


@dataclass(frozen=True)
class Route:
    """The outcome of `route`: the backend that runs, or why none can, and what goes wrong."""

    features: CallFeatures
    backend: Optional[str]
    passed_over: Tuple[Tuple[str, str], ...] = ()
    """(backend, first reason it did not take the call), in dispatch order."""
    blocking: Tuple[Check, ...] = ()
    """The checks that make the call fail or compute wrongly (their settings and alternatives)."""
    failure: str = ""
    """Set when no backend takes the call, or the one that does refuses it."""
    defects: Tuple[str, ...] = field(default=())
    selection: Selection = DEFAULT_ORDER
    """How the backend was chosen; under autotune `backend` is the worst of `candidates`."""
    candidates: Tuple[str, ...] = ()
    """Under autotune, every backend that takes the call (any of them may run it)."""

    @property
    def ok(self) -> bool:
        return self.backend is not None and not self.failure and not self.defects

    @property
    def fallback_note(self) -> str:
        """Why the fast FlyDSL path was passed over, for a backend that still runs it."""
        if self.backend is None or self.backend == FLYDSL.name:
            return ""
        why = dict(self.passed_over).get(FLYDSL.name, "").split("; ")[0]
        return f"{self.backend}: {why}" if why else self.backend

    def problem(self) -> str:
        """One sentence for a refusal ("" when the call runs and computes exactly)."""
        entry = "flash_attn_func" if self.features.entry == DENSE else "flash_attn_varlen_func"
        arch = f"{self.features.arch} ({ARCH_NAMES.get(self.features.arch, '?')})"
        pin = self.selection.pin
        if self.backend is None and pin is not None:
            reasons = "; ".join(why for _, why in self.passed_over)
            return f"on {arch} the backend pinned for {entry} ({pin}) cannot take this call ({reasons})"
        if self.backend is None:
            reasons = "; ".join(why for _, why in self.passed_over)
            return f"on {arch} no Primus-Turbo kernel backend takes this {entry} call ({reasons})"
        runs = (f"may run on any of {', '.join(self.candidates)} (autotune), among them {self.backend}"
                if len(self.candidates) > 1 else f"runs on {self.backend}")
        if self.failure:
            return f"on {arch} {entry} {runs}, which refuses it: {self.failure}"
        if self.defects:
            return f"on {arch} {entry} {runs}: {'; '.join(self.defects)}"
        return ""

    def reason(self, what: str, *, settings: Sequence[str] = (), alternatives: Sequence[str] = ()) -> Optional[Reason]:
        """The B33 refusal of this route ("{what}: {problem}"), or None when it runs right;
        ``settings`` / ``alternatives`` add to those of the blocking checks."""
        problem = self.problem()
        if not problem:
            return None
        chosen = _SELECTION_SETTINGS if self.selection != DEFAULT_ORDER else ()
        names = ("turbo_arch",) + chosen + tuple(s for c in self.blocking for s in c.settings) + tuple(settings)
        ways = [c.alternative for c in self.blocking if c.alternative] + list(alternatives)
        if self.selection != DEFAULT_ORDER:
            ways.append("unset PRIMUS_TURBO_ATTN_BACKEND and set use_turbo_autotune: false (PRIMUS_TURBO_AUTO_TUNE=0) "
                        "for attention, so Primus-Turbo picks FlyDSL and its fallbacks in order")
        return R.ROUTE_BLOCKED.reason_for(names=tuple(dict.fromkeys(names)), what=what, problem=problem,
                                          ways="; or ".join(dict.fromkeys(ways)) or "change the configuration")


def route_on(features: CallFeatures, backend: KernelBackend) -> Optional[Route]:
    """``backend``'s answer for this call alone: None when it does not take the call, else the
    route with what it refuses and which known defect applies (a kernel-level op has no
    dispatcher in front of it, so only its own backend's rows apply)."""
    if any(not c.ok(features) for c in backend.takes):
        return None
    refused = [c for c in backend.refuses if not c.ok(features)]
    defects = [c for c in backend.defects if not c.ok(features)]
    return Route(features, backend.name, failure=refused[0].text if refused else "",
                 defects=tuple(c.text for c in defects), blocking=tuple(refused + defects))


def _pinned(features: CallFeatures, selection: Selection) -> Route:
    """A pinned backend: it takes the call or upstream raises ``ValueError`` (no fallback)."""
    pin = str(selection.pin).upper()
    backend = next((b for b in ORDER[features.entry] if b.name.upper() == pin and registered(b, features.build)), None)
    if backend is None:
        return Route(features, None, passed_over=((pin, f"{pin} is not registered for {features.entry} attention"),),
                     failure="not registered", selection=selection)
    taken = route_on(features, backend)
    if taken is None:
        failed = [c for c in backend.takes if not c.ok(features)]
        return Route(features, None, passed_over=((backend.name, "; ".join(c.text for c in failed)),),
                     failure="the pinned backend cannot handle the inputs", blocking=tuple(failed), selection=selection)
    return dataclasses.replace(taken, selection=selection)


def _cache_key_features(features: CallFeatures) -> CallFeatures:
    """The most permissive call with ``features``' autotune cache key: the key (``make_key``,
    attention_impl.py l.283-312, l.436-454 at a6a16cd) holds q's shape, Hkv, dtype, causal, window,
    layout, sink and return_softmax (varlen: token counts and max_seqlen), not dropout, the scale,
    ALiBi, bias, deterministic, the value head dim, the kv length, contiguity or (varlen) the
    document count, so equal documents may share a key with unequal ones."""
    return dataclasses.replace(features, dropout=0.0, default_scale=True, bias=False, alibi=False,
                               deterministic=False, head_dim_v=features.head_dim, q_within_kv=True,
                               contiguous_sbhd=True, contiguous_bshd=True, contiguous_thd=True,
                               equal_documents=True if features.entry == VARLEN else features.equal_documents)


def _cached_unchecked(features: CallFeatures, backend: KernelBackend) -> Route:
    """``backend`` runs a call it does not take: a tuned cache hit is returned without can_handle
    (core/backend.py l.550-554 at a6a16cd), and FlyDSL's and HipKittens' entries read neither dropout,
    ALiBi nor bias (flash_attn_interface.py l.102-151)."""
    missed = [c for c in backend.takes if not c.ok(features)]
    why = "; ".join(c.text for c in missed)
    check = Check(lambda f: False, f"autotune may cache {backend.name} for this call's shape (its cache key leaves "
                  f"out dropout, the scale, ALiBi, bias, the value head dim, the kv length, contiguity and the "
                  f"document count) and then run this call on it "
                  f"unchecked, though {why}", tuple(s for c in missed for s in c.settings) + ("use_turbo_autotune",),
                  "set use_turbo_autotune: false")
    return Route(features, backend.name, defects=(check.text,), blocking=(check,))


def _autotuned(features: CallFeatures, selection: Selection) -> Optional[Route]:
    """Autotune may keep any backend that takes a call with this call's cache key (docs/fidelity.md,
    fact `autotune-cache-key`): the worst of them answers for all."""
    relaxed = _cache_key_features(features)
    taken = []
    for backend in ORDER[features.entry]:
        if not backend.autotune or not registered(backend, features.build):
            continue
        found = route_on(features, backend)
        if found is None and route_on(relaxed, backend) is not None:
            found = _cached_unchecked(features, backend)
        if found is not None:
            taken.append(found)
    if not taken:
        return None
    worst = next((r for r in taken if not r.ok), taken[0])
    return dataclasses.replace(worst, selection=selection, candidates=tuple(r.backend for r in taken))


def route(features: CallFeatures, selection: Selection = DEFAULT_ORDER) -> Route:
    """Which backend takes this call on its arch: the pin, else (under autotune) the worst
    backend that takes it, else the first in the dispatch order (docs/fidelity.md, fact `dispatch-order`)."""
    if features.arch not in ARCHES:
        raise ValueError(f"arch must be one of {ARCHES}, got {features.arch!r}")
    if selection.pin is not None:
        return _pinned(features, selection)
    if selection.autotune:
        tuned = _autotuned(features, selection)
        if tuned is not None:
            return tuned
    passed: list[tuple[str, str]] = []
    closest: list[Check] = []  # the failing checks of the backend that came closest to taking it
    for backend in ORDER[features.entry]:
        if not registered(backend, features.build):
            continue
        taken = route_on(features, backend)
        if taken is not None:
            return dataclasses.replace(taken, passed_over=tuple(passed))
        failed = [c for c in backend.takes if not c.ok(features)]
        passed.append((backend.name, "; ".join(c.text for c in failed)))
        if not closest or len(failed) < len(closest):
            closest = failed
    return Route(features, None, passed_over=tuple(passed), failure="no compatible backend",
                 blocking=tuple(closest))


def default_scale(scale: Optional[float], head_dim: int) -> bool:
    """FlyDSL's own test of the scale it bakes in: None, or within 1e-6 of 1/sqrt(D), absolute
    (``_scale_ok``, attention_impl.py at a6a16cd)."""
    return scale is None or abs(scale - 1.0 / math.sqrt(head_dim)) < 1e-6


__all__ = ["AITER_DENSE", "AITER_GFX942_STRIDED", "AITER_SINK_LEFT_ZERO", "AITER_SINK_RIGHT_WINDOW", "AITER_VARLEN",
           "ARCHES", "ARCH_NAMES", "BUILDS", "BUILD_A6A16CD", "BUILD_PT509", "CallFeatures", "Check", "DEFAULT_ORDER",
           "DENSE", "FLYDSL", "FLYDSL_VARLEN_STRIDES", "GLUON", "HIPKITTENS", "KernelBackend", "LayoutError", "ORDER",
           "Route", "Selection", "TurboBuild", "VARLEN", "default_scale", "flydsl_group_ok", "infer_qkv_format",
           "registered", "route", "route_on", "storage_features"]
