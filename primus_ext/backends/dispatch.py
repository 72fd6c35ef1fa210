"""Which Primus-Turbo kernel backend takes a call, per arch: one model, as data (B33).

``flash_attn_func`` and ``flash_attn_varlen_func`` pick a kernel backend per call:
FlyDSL first, then the fallbacks in order (dense: AITER, then HipKittens; varlen:
AITER), or ``ValueError("No compatible backend found ...")``.  A backend that takes
a call can still assert on it, or compute it wrongly.  A signature says none of this,
so the rows below model it, each citing its upstream source (Primus-Turbo at a6a16cd: files
under ``primus_turbo/pytorch/kernels/attention/``).  `route` answers for one call's features: which
backend runs, why the others do not, what the chosen one refuses, and which known
defect applies.  The plan refuses at build time whatever would fail or be wrong.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Tuple

from ..errors import Reason
from .layout import LayoutError, infer_qkv_format, storage_features  # re-exported: part of the model

ARCHES = ("gfx942", "gfx950")
ARCH_NAMES = {"gfx942": "MI300", "gfx950": "MI355"}
DENSE, VARLEN = "dense", "varlen"
_DTYPE = ("bf16", "fp16", "params_dtype")


@dataclass(frozen=True)
class CallFeatures:
    """What decides the kernel backend of one ``flash_attn_*`` call."""

    arch: str
    entry: str  # DENSE (flash_attn_func) or VARLEN (flash_attn_varlen_func)
    dtype: str  # "bf16", "fp16", "fp32", "fp64"
    head_dim: int
    head_dim_v: int
    heads: int
    kv_heads: int
    causal: bool = True
    window: Tuple[int, int] = (-1, -1)
    sink: bool = False
    dropout: float = 0.0
    bias: bool = False
    alibi: bool = False
    deterministic: bool = False
    default_scale: bool = True
    equal_documents: Optional[bool] = None
    """Varlen: every document has the same length (None: not known, so not assumed)."""
    sbhd_storage: bool = True
    """Dense: q/k/v are sbhd in memory (Megatron's layout), or bshd with batch 1: the order
    upstream's `infer_qkv_format` reads from the strides, contiguous or not."""
    contiguous_sbhd: bool = True
    """Dense: q, k and v are each contiguous in sbhd order (a split view of a fused QKV,
    megatron-core's key and value, is not)."""
    contiguous_bshd: bool = True
    """Dense: q, k and v are each contiguous as bshd (not the strided view of sbhd memory)."""
    q_within_kv: bool = True
    """Dense: the query is no longer than the key/value sequence (``Sq <= Skv``)."""

    @property
    def group(self) -> int:
        return self.heads // max(self.kv_heads, 1)


@dataclass(frozen=True)
class Check:
    """One condition of a row: ``ok(features)``, the words when it does not hold, the user
    settings that decide it and what to do instead."""

    ok: Callable[[CallFeatures], bool]
    text: str
    settings: Tuple[str, ...] = ()
    alternative: str = ""
    raises: Tuple[str, str] = ("ValueError", "")
    """How upstream fails a call this refusal row stops: the exception type (``ValueError`` or
    ``AssertionError``) and upstream's message; the CPU fake raises the same."""


@dataclass(frozen=True)
class KernelBackend:
    """A kernel backend: when it takes a call, what it then refuses, what it gets wrong."""

    name: str
    entries: Tuple[str, ...]
    takes: Tuple[Check, ...]
    refuses: Tuple[Check, ...] = ()
    defects: Tuple[Check, ...] = ()
    fact: str = ""


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _flydsl_window(f: CallFeatures) -> bool:
    left, right = f.window
    return right in (0, -1) and (left == -1 or left >= 64)


FLYDSL = KernelBackend(
    "FlyDSL", (DENSE, VARLEN),
    takes=(
        Check(lambda f: f.arch == "gfx950", "FlyDSL runs only on gfx950"),
        Check(lambda f: f.dtype == "bf16", "FlyDSL takes bf16 only", _DTYPE, "train in bf16"),
        Check(lambda f: f.causal, "FlyDSL takes causal attention only"),
        # _flydsl_common_ok reads q's head dim only (attention_impl.py l.87-92 at a6a16cd).
        Check(lambda f: f.head_dim in (64, 128), "FlyDSL takes head dim 64 or 128"),
        Check(_flydsl_window, "FlyDSL takes a window only with right bound 0 and left bound >= 64"),
        Check(lambda f: f.default_scale, "FlyDSL takes only the default softmax scale 1/sqrt(D)"),
        Check(lambda f: f.dropout == 0, "FlyDSL takes no dropout"),
        Check(lambda f: not f.bias and not f.alibi, "FlyDSL takes no bias or ALiBi"),
        Check(lambda f: _pow2(f.group) and 8 <= f.group <= 256,
              "FlyDSL needs a GQA group (query heads per key/value head) that is a power of two in 8..256",
              ("num_attention_heads", "num_query_groups"), "use 8 to 256 query heads per key/value group"),
        Check(lambda f: f.entry != DENSE or f.sbhd_storage, "FlyDSL dense needs sbhd storage (or batch 1)"),
        Check(lambda f: f.entry != VARLEN or f.equal_documents is True,
              "FlyDSL varlen needs every document of the same length", ("packed_sequences", "packed_equal_documents"),
              "pack documents of equal length and say so with packed_equal_documents: true"),
    ),
    # The gate reads the layout order only; the kernel wrapper then asserts contiguity, with
    # no fallback (attention_impl.py l.147-186, attention_flydsl_impl.py l.37-39, 55-58 at a6a16cd).
    refuses=(
        Check(lambda f: f.entry != DENSE or f.contiguous_sbhd,
              "FlyDSL asserts that q, k and v are contiguous sbhd (\"SBHD tensors must be contiguous\"), and a "
              "split view of a fused QKV is not", (),
              "make q, k and v contiguous in [S, B, H, D] order before the call (the Megatron modules do so on "
              "gfx950 when FlyDSL takes the layer's calls)",
              raises=("AssertionError", "SBHD tensors must be contiguous")),
    ),
    # Its forward allocates out like q and reads v with q's head dim (attention_flydsl_impl.py l.51-68,
    # l.376-398 at a6a16cd): a value head dim of its own is read out of bounds.
    defects=(
        Check(lambda f: f.head_dim_v == f.head_dim,
              "FlyDSL takes the value head dim to be q's (its output is allocated like q), so a value head dim of "
              "its own is read out of bounds", ("kv_channels",),
              "use one head dim for q, k and v, or turbo_flex_attention_backend: reference"),
    ),
    fact="attention_impl.py l.53-100 (gates), l.147-186 (dense), l.320-326, l.375-394 (varlen) at a6a16cd; "
         "docs/fidelity.md, facts `flydsl-gate-order`, `flydsl-contiguous`",
)
AITER_SINK_RIGHT_WINDOW = Check(
    lambda f: not (f.sink and f.window[1] > 0),
    "AITER's sink backward ignores a window's right bound: the gradients would be silently wrong",
    ("use_sink_attention", "window_size", "turbo_flex_attention_mask_mod"),
    "use a window with right bound 0, or use_sink_attention: false")
# aiter's Triton forward (the sink path) sets sliding_window = max(left, 0) and masks only when it is > 0,
# and its backward gets the same (aiter ops/triton/attention/mha.py l.110, _triton_kernels/attention/mha.py
# l.195 at e4048607; Primus-Turbo attention_aiter_impl.py l.323 at a6a16cd): a left bound of 0 is none.
AITER_SINK_LEFT_ZERO = Check(
    lambda f: not (f.sink and f.window[0] == 0),
    "AITER's sink path (Triton kernels) takes a left window bound of 0 as no bound: the layer would attend "
    "further left than asked", ("use_sink_attention", "window_size", "turbo_flex_attention_mask_mod"),
    "use a left window bound of at least 1, or use_sink_attention: false")
# docs/fidelity.md, fact `gfx942-strided`: upstream Primus feeds contiguous bshd on gfx942 only, for this.
AITER_GFX942_STRIDED = Check(
    lambda f: f.arch != "gfx942" or f.contiguous_bshd,
    "on gfx942 AITER's v3 backward mishandles strided q/k/v (the bshd view of sbhd memory) and corrupts the "
    "gradients", (),
    "make q, k and v contiguous bshd before the call (the Megatron modules do so on gfx942)")
AITER_DENSE = KernelBackend(
    "AITER", (DENSE,),
    takes=(Check(lambda f: f.dtype in ("bf16", "fp16"), "AITER takes fp16 or bf16 only", _DTYPE,
                 "train in bf16 (bf16: true) or fp16, or set use_turbo_flex_attention: true with "
                 "turbo_flex_attention_backend: reference"),),
    refuses=(
        Check(lambda f: not f.sink or (f.head_dim == f.head_dim_v and _pow2(f.head_dim)),
              "AITER's sink kernel needs equal q/k and v head dims and a power-of-two head dim",
              ("use_sink_attention", "kv_channels"), "choose kv_channels as a power of two"),
        Check(lambda f: not (f.sink and f.deterministic),
              "AITER asserts that deterministic and sink are not enabled together",
              ("deterministic_mode", "use_sink_attention"),
              "set deterministic_mode: false or use_sink_attention: false (on gfx950, FlyDSL takes both "
              "when its other conditions hold)",
              raises=("AssertionError", "deterministic and sink cannot be enabled together currently")),
    ),
    defects=(AITER_SINK_RIGHT_WINDOW, AITER_SINK_LEFT_ZERO, AITER_GFX942_STRIDED),
    fact="attention_impl.py l.107-110, attention_aiter_impl.py l.102-106 at a6a16cd; docs/fidelity.md, facts "
         "`aiter-deterministic-sink`, `aiter-sink-right-window`, `gfx942-strided`",
)
AITER_VARLEN = KernelBackend(
    "AITER", (VARLEN,),
    takes=(
        Check(lambda f: f.dtype in ("bf16", "fp16"), "AITER takes fp16 or bf16 only", _DTYPE,
              "train in bf16 (bf16: true) or fp16"),
        Check(lambda f: not f.sink, "AITER varlen takes no sink", ("use_sink_attention", "packed_sequences"),
              "drop the sink for packed batches, or on gfx950 pack documents of equal length "
              "(packed_equal_documents: true) with 8 to 256 query heads per key/value group in bf16 (FlyDSL)"),
    ),
    fact="attention_impl.py l.329-334 at a6a16cd; docs/fidelity.md, fact `aiter-varlen-no-sink`",
)
HIPKITTENS = KernelBackend(
    "HipKittens", (DENSE,),
    takes=(
        Check(lambda f: f.arch == "gfx950", "HipKittens runs only on gfx950"),
        Check(lambda f: f.dtype == "bf16", "HipKittens takes bf16 only"),
        Check(lambda f: f.causal and not f.sink, "HipKittens takes causal attention without a sink only"),
        Check(lambda f: f.dropout == 0 and not f.bias and not f.alibi, "HipKittens takes no dropout, bias or ALiBi"),
        Check(lambda f: f.window[1] in (0, -1) and f.head_dim in (64, 128), "HipKittens: right bound 0, D 64/128"),
        Check(lambda f: f.entry == DENSE and f.sbhd_storage and f.contiguous_sbhd,
              "HipKittens needs contiguous sbhd q, k and v"),
        # hipkittens_attn_supported: v shaped as k, and Sq <= Skv (its forward skips rows otherwise).
        Check(lambda f: f.head_dim_v == f.head_dim and f.q_within_kv,
              "HipKittens needs v shaped as k and a query no longer than the keys (Sq <= Skv)"),
    ),
    fact="attention_impl.py l.212-250; hipkittens_attn_supported (primus_turbo/hipkittens/attention/attention.py "
         "l.124-182) at a6a16cd",
)
ORDER = {DENSE: (FLYDSL, AITER_DENSE, HIPKITTENS), VARLEN: (FLYDSL, AITER_VARLEN)}
"""The dispatcher's order: FlyDSL (the default), then the fallbacks (docs/fidelity.md, fact `dispatch-order`)."""


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
        return Reason(tuple(dict.fromkeys(names)), f"{what}: {problem}.",
                      "; or ".join(dict.fromkeys(ways)) or "change the configuration", "B33")


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
    backend = next((b for b in ORDER[features.entry] if b.name.upper() == pin), None)
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
    attention_impl.py l.283-312 at a6a16cd) holds shapes, dtype, causal, window, layout, sink and
    return_softmax, not dropout, the scale, ALiBi, bias, deterministic or the value head dim."""
    return dataclasses.replace(features, dropout=0.0, default_scale=True, bias=False, alibi=False,
                               deterministic=False, head_dim_v=features.head_dim)


def _cached_unchecked(features: CallFeatures, backend: KernelBackend) -> Route:
    """``backend`` runs a call it does not take: a tuned cache hit is returned without can_handle
    (core/backend.py l.550-554 at a6a16cd), and FlyDSL's and HipKittens' entries read neither dropout,
    ALiBi nor bias (flash_attn_interface.py l.102-151)."""
    missed = [c for c in backend.takes if not c.ok(features)]
    why = "; ".join(c.text for c in missed)
    check = Check(lambda f: False, f"autotune may cache {backend.name} for this call's shape (its cache key leaves "
                  f"out dropout, the scale, ALiBi, bias and the value head dim) and then run this call on it "
                  f"unchecked, though {why}", tuple(s for c in missed for s in c.settings) + ("use_turbo_autotune",),
                  "set use_turbo_autotune: false")
    return Route(features, backend.name, defects=(check.text,), blocking=(check,))


def _autotuned(features: CallFeatures, selection: Selection) -> Optional[Route]:
    """Autotune may keep any backend that takes a call with this call's cache key (docs/fidelity.md,
    fact `autotune-cache-key`): the worst of them answers for all."""
    relaxed = _cache_key_features(features)
    taken = []
    for backend in ORDER[features.entry]:
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


__all__ = ["ARCHES", "ARCH_NAMES", "CallFeatures", "Check", "DEFAULT_ORDER", "DENSE", "KernelBackend", "LayoutError",
           "ORDER", "Route", "Selection", "VARLEN", "default_scale", "infer_qkv_format", "route", "route_on",
           "storage_features"]
