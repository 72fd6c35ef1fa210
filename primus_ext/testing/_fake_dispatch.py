"""The fake's kernel dispatch: which Primus-Turbo backend would run a call on one arch.

With ``fake_primus_turbo(arch="gfx942" | "gfx950")`` the entries ``flash_attn_func``,
``flash_attn_varlen_func``, ``flex_attention``, ``flex_attention_bshd`` and
``flex_attention_varlen`` describe each call as `CallFeatures`, read from the *actual*
call (q's dtype, the shapes, the normalised window, the sink, dropout, bias, ALiBi,
``deterministic``, the host boundaries, the storage order and contiguity of q, k and v,
read from all three as upstream reads them) and ask the project's model of the
dispatcher (`primus_ext.backends.dispatch.route`, docs/fidelity.md, fact `dispatch-order`) which
backend takes it.  Then the fake behaves like real Primus-Turbo:

* no backend takes it: ``ValueError("No compatible backend found for
  FlashAttnDenseDispatcher | FlashAttnVarlenDispatcher with inputs: ...")``;
* the chosen backend refuses it: what that backend raises (AITER asserts that
  deterministic and sink are not enabled together; its sink head-dim check is a
  ``ValueError``; FlyDSL asserts that q, k and v are contiguous sbhd);
* under autotune (``PRIMUS_TURBO_AUTO_TUNE=1``), a tune cache keyed as upstream's ``make_key`` (shapes,
  dtype, causal, window, layout, sink; varlen: token counts and ``max_seqlen``), which keeps the
  fastest backend that takes the first call of a key and does not raise while timed (the fake times
  FlyDSL, then HipKittens, then AITER; with none left, nothing is cached and the default order runs) and runs every later call of that key on it without asking whether it takes the call, as
  upstream's cache hit skips ``can_handle`` (core/backend.py l.552-554 at a6a16cd); a hit on a
  backend that does not take the call raises ``NotImplementedError`` (the fake cannot reproduce what
  it would compute unchecked) rather than computing a right answer;
* the chosen backend has a known silent defect for it (AITER's sink backward ignores the
  window's right bound): the matching fault of `._fake_math` is switched on for that call,
  whatever ``faults`` says, because the real library is silently wrong there and the fake
  must never be kinder than the real library.  A defect the fake cannot reproduce is a
  ``NotImplementedError`` rather than a correct answer.

The flex entries reach the same kernels: flex dense is a dense call, except that a
documents mask (classified from the BlockMask) goes to the varlen kernel, as the plan
assumes; flex varlen is a varlen call.  The fp8 and context-parallel (usp) entries are
not dispatched (their recorded ``backend`` stays None).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from ..attention.pattern import Pattern
from ..backends.dispatch import (AITER_DENSE, AITER_SINK_LEFT_ZERO, AITER_SINK_RIGHT_WINDOW, AITER_VARLEN, ARCHES,
                                 BUILD_A6A16CD, DEFAULT_ORDER, DENSE, FLYDSL, FLYDSL_VARLEN_STRIDES, HIPKITTENS, VARLEN,
                                 CallFeatures, Route, TurboBuild, default_scale, route, route_on)
from ..backends.layout import LayoutError, infer_qkv_format, storage_features
from ._fake_backend_manager import TUNE_CACHE, selection_now
from ._fake_math import SINK_BACKWARD_IGNORES_RIGHT_WINDOW, SINK_LEFT_WINDOW_ZERO_UNBOUNDED

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}
_DISPATCHER = {DENSE: "FlashAttnDenseDispatcher", VARLEN: "FlashAttnVarlenDispatcher"}
_FAULT_OF_DEFECT = {AITER_SINK_RIGHT_WINDOW.text: SINK_BACKWARD_IGNORES_RIGHT_WINDOW,
                    AITER_SINK_LEFT_ZERO.text: SINK_LEFT_WINDOW_ZERO_UNBOUNDED}
"""Each known silent defect of the dispatch model -> the `._fake_math` fault reproducing it."""
_COMPUTED_AS_UPSTREAM = frozenset({FLYDSL_VARLEN_STRIDES.text})
"""Defects the fake's kernels reproduce by computing as upstream does (FlyDSL's varlen reads at fixed strides,
`._fake_flydsl.fixed_strides`), with no fault to switch on."""

DISPATCHED = ("flash_attn_func", "flash_attn_varlen_func", "flex_attention", "flex_attention_bshd",
              "flex_attention_varlen")
"""The entries whose calls go through `Dispatcher` when an arch is set."""


def dtype_name(t: Tensor) -> str:
    return _DTYPES.get(t.dtype, str(t.dtype).replace("torch.", ""))


def equal_lengths(bounds: Sequence[int]) -> bool:
    return len({y - x for x, y in zip(bounds, bounds[1:])}) <= 1


def check_layout(name: str, q: Tensor, k: Tensor, v: Tensor) -> None:
    """Upstream infers one storage layout from all three tensors' strides and asserts on any
    other (``_infer_qkv_format``, attention_utils.py l.28-83 at a6a16cd), on every arch."""
    try:
        infer_qkv_format(q, k, v)
    except LayoutError as exc:
        raise AssertionError(f"{name}: {exc}") from None


def check_arch(arch: Optional[str]) -> Optional[str]:
    if arch is not None and arch not in ARCHES:
        raise ValueError(f"fake Primus-Turbo: arch must be None or one of {ARCHES}, got {arch!r}")
    return arch


class Dispatcher:
    """Routes the calls of one fake entry on ``arch``; ``on_backend(name)`` records the winner."""

    def __init__(self, arch: str, on_backend: Callable[[str], None], build: TurboBuild = BUILD_A6A16CD) -> None:
        self.arch = check_arch(arch)
        self.build = build
        self.on_backend = on_backend
        self.last: Optional[str] = None  # the backend that took the latest call

    def dense(self, a: dict[str, Any], q: Tensor, k: Tensor, v: Tensor, pattern: Pattern,
              scale: Optional[float]) -> frozenset[str]:
        """A dense call with bshd views q, k, v; returns the faults its backend brings."""
        if pattern.documents:  # a flex documents mask: the flex layer hands it to the varlen kernel
            bounds = pattern.at_length(q.shape[1]).boundaries or (0, q.shape[1])
            longest = max(y - x for x, y in zip(bounds, bounds[1:]))
            key = (q.shape[0] * q.shape[1], k.shape[0] * k.shape[1], longest, longest)
            return self._run(self._features(VARLEN, a, q, k, v, pattern, scale, equal_documents=equal_lengths(bounds)),
                             key)
        fmt, sbhd, contiguous, bshd = storage_features(q, k, v)
        return self._run(self._features(DENSE, a, q, k, v, pattern, scale, sbhd_storage=sbhd,
                                        contiguous_sbhd=contiguous, contiguous_bshd=bshd,
                                        q_within_kv=q.shape[1] <= k.shape[1]), (q.shape[0], q.shape[1], fmt))

    def varlen(self, a: dict[str, Any], q: Tensor, k: Tensor, v: Tensor, pattern: Pattern,
               scale: Optional[float], bounds_q: Sequence[int], bounds_k: Sequence[int]) -> frozenset[str]:
        """A packed call with thd q, k, v and host boundaries (FlyDSL reads them on the host too)."""
        equal = equal_lengths(bounds_q) and equal_lengths(bounds_k)
        key = (q.shape[0], k.shape[0], int(a["max_seqlen_q"]), int(a["max_seqlen_k"]))
        return self._run(self._features(VARLEN, a, q[None], k[None], v[None], pattern, scale, equal_documents=equal,
                                        contiguous_thd=all(t.is_contiguous() for t in (q, k, v))), key)

    def _features(self, entry: str, a: dict[str, Any], q: Tensor, k: Tensor, v: Tensor, pattern: Pattern,
                  scale: Optional[float], **layout: Any) -> CallFeatures:
        return CallFeatures(
            arch=self.arch, entry=entry, dtype=dtype_name(q), head_dim=int(q.shape[-1]),
            head_dim_v=int(v.shape[-1]), heads=int(q.shape[2]), kv_heads=int(k.shape[2]),
            causal=pattern.right == 0, window=pattern.window, sink=a.get("sink") is not None,
            dropout=float(a.get("dropout_p") or 0.0), bias=a.get("bias") is not None,
            alibi=a.get("alibi_slopes") is not None, deterministic=bool(a.get("deterministic", False)),
            default_scale=default_scale(scale, int(q.shape[-1])), build=self.build, **layout,
        )

    def _run(self, features: CallFeatures, shapes: tuple) -> frozenset[str]:
        selection = selection_now()  # re-read at every call, as upstream does
        found = self._tuned(features, shapes) if selection.autotune and selection.pin is None else None
        if found is None:
            found = route(features, DEFAULT_ORDER if selection.autotune and selection.pin is None else selection)
        if found.backend is not None:  # recorded before a refusal: the backend took the call, then failed it
            self.last = found.backend
            self.on_backend(found.backend)
        return faults_of(found)

    def _tuned(self, features: CallFeatures, shapes: tuple) -> Optional[Route]:
        """Autotune: the cached backend of this call's key, run unchecked on a hit; else None (no backend
        takes the call: the default order says why)."""
        key = (features.entry, shapes, features.heads, features.kv_heads, features.head_dim, features.dtype,
               features.causal, features.window, features.sink)
        cached = TUNE_CACHE.get(key)
        if cached is None:
            # Profiling times each backend whose can_handle takes the call and skips one that raises while
            # timed (core/backend.py l.561-566 at a6a16cd); with none left nothing is cached and the call
            # goes the default way.
            timed = [b for b in _TIMED[features.entry]
                     if (r := route_on(features, b)) is not None and not r.failure]
            if not timed:
                return None
            cached = TUNE_CACHE[key] = timed[0].name
        backend = next(b for b in _TIMED[features.entry] if b.name == cached)
        found = route_on(features, backend)
        if found is None:
            self.last = cached
            self.on_backend(cached)
            raise NotImplementedError(f"fake Primus-Turbo: the autotune cache holds {cached} for this call's key, and "
                                      "a hit runs it without can_handle, though it does not take this call; the fake "
                                      "cannot reproduce what it computes")
        return found


_TIMED = {DENSE: (FLYDSL, HIPKITTENS, AITER_DENSE), VARLEN: (FLYDSL, AITER_VARLEN)}
"""The order the fake's autotune finds the backends fastest in (Gluon is never autotuned)."""


def describe(features: CallFeatures) -> str:
    return ", ".join(f"{f.name}={getattr(features, f.name)!r}" for f in fields(features) if f.name != "entry")


def faults_of(found: Route) -> frozenset[str]:
    """Raise what real Primus-Turbo raises for ``found`` (`raise_refusal`); else the `._fake_math`
    faults reproducing its backend's known silent defects for the call."""
    raise_refusal(found)
    unknown = [d for d in found.defects if d not in _FAULT_OF_DEFECT and d not in _COMPUTED_AS_UPSTREAM]
    if unknown:
        raise NotImplementedError(f"fake Primus-Turbo cannot reproduce the known defect of {found.backend}: "
                                  f"{unknown[0]}")
    return frozenset(_FAULT_OF_DEFECT[d] for d in found.defects if d in _FAULT_OF_DEFECT)


def raise_refusal(found: Route) -> None:
    """Raise what real Primus-Turbo raises for a call no backend runs, or its backend refuses."""
    if found.backend is None and found.selection.pin is not None:
        pin, why = found.selection.pin.upper(), "; ".join(w for _, w in found.passed_over)
        if found.failure == "not registered":
            raise ValueError(f"User specified backend {pin} is not registered for {_DISPATCHER[found.features.entry]} "
                             f"(fake Primus-Turbo: {why})")
        raise ValueError(f"User specified backend {pin} cannot handle the given inputs: {describe(found.features)}. "
                         f"Please check input constraints or choose a different backend. (fake Primus-Turbo: {why})")
    if found.backend is None:
        reasons = "; ".join(f"{name}: {why}" for name, why in found.passed_over)
        raise ValueError(f"No compatible backend found for {_DISPATCHER[found.features.entry]} with inputs: "
                         f"{describe(found.features)} (fake Primus-Turbo, {reasons})")
    if not found.failure:
        return
    kind, message = found.blocking[0].raises if found.blocking else ("ValueError", "")
    error = _ERRORS.get(kind, ValueError)
    raise error(f"{message or found.failure} ({found.backend}, fake Primus-Turbo on {found.features.arch})")



_ERRORS = {"AssertionError": AssertionError, "IndexError": IndexError, "RuntimeError": RuntimeError}


def check_cu_seqlens(name: str, which: str, cu: Any, max_seqlen: Any, total: int,
                      device: torch.device) -> list[int]:
    """Validate one boundary vector like the flex layer does, returning it on the host."""
    label = f"cu_seqlens_{which}"
    if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.dtype != torch.int32:
        got = (cu.dtype, tuple(cu.shape)) if isinstance(cu, Tensor) else type(cu).__name__
        raise ValueError(f"{name}: {label} must be a 1-D int32 tensor, got {got}")
    if cu.device != device:
        raise ValueError(f"{name}: {label} is on {cu.device}, q is on {device}")
    # The real layer copies the boundaries to the host too (one sync per call).
    bounds = [int(x) for x in cu.tolist()]
    if len(bounds) < 2 or bounds[0] != 0 or any(x > y for x, y in zip(bounds, bounds[1:])):
        raise ValueError(f"{name}: {label} must start at 0 and not decrease, got {bounds}")
    if bounds[-1] != total:
        raise ValueError(f"{name}: {label}[-1]={bounds[-1]} but there are {total} tokens")
    longest = max(y - x for x, y in zip(bounds, bounds[1:]))
    if int(max_seqlen) < longest:
        raise ValueError(f"{name}: max_seqlen_{which}={max_seqlen} < longest segment {longest}")
    return bounds

__all__ = ["DISPATCHED", "Dispatcher", "check_arch", "check_cu_seqlens", "check_layout", "describe", "dtype_name",
           "equal_lengths", "faults_of", "raise_refusal"]
