"""The ``turbo`` backend: Primus-Turbo's fixed kernels on ROCm.

Every pattern the plan approves is a window inside documents, and Primus-Turbo's two
direct entries compute all of them exactly, so those are what runs, on every build:

* causal or full attention from the caller's own ``causal``/``window_size`` ->
  ``flash_attn_func`` with exactly the caller's arguments, i.e. the same kernel and
  arguments as the direct path (B6);
* any other window, causal or two-sided, from the caller or a proven hook ->
  ``flash_attn_func(causal, window_size)``, whose kernels honour both bounds (B8);
* documents (a proven hook's chunks or cuts) -> the batch flattened to one packed
  sequence on ``flash_attn_varlen_func``;
* packed (thd) calls -> ``flash_attn_varlen_func`` with the window inside each document.

The flex compat layer (``flex_attention*``, unmerged) adds no pattern these lack, only
a mask probe and a BlockMask per shape, so it is never called (B7).  (Its varlen entry
takes a sink only for documents of equal length, which no plan can know.)
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from ..attention.pattern import Pattern
from ..refusals import DOCUMENT_ALIGNMENT, DOCUMENTS_BIAS, refuse
from .base import HOOKS_PROVEN, TURBO_DISPATCH, AttentionBackend, BackendCapabilities, KernelCall, Output
from .check_op import check_same_boundaries
from .call_route import CallRoutes
from .capabilities import entry_accepts, entry_name, sink_kwargs_for, without_defaults
from .dispatch import Selection
from .turbo_build import BUILD_A6A16CD, TurboBuild, installed_build
from .base import CallArgs, KernelPair
from .turbo_kernels import discover_kernels, kernel_pair


def load_ops() -> Any:
    """Import Primus-Turbo's attention ops module (raises ImportError when absent)."""
    return importlib.import_module("primus_turbo.pytorch.ops")


def kernel_selection(autotune: bool = False) -> Selection:
    """How the installed Primus-Turbo will choose attention kernel backends (`Selection`).

    Asked of its own ``GlobalBackendManager``, which reads a backend set in code and the
    environment (``PRIMUS_TURBO_ATTN_BACKEND``, ``PRIMUS_TURBO_AUTO_TUNE``) as its dispatcher
    will; ``autotune`` is the ``use_turbo_autotune`` setting (Primus sets the variable from
    it).  A value the manager cannot read becomes a pin nothing takes, so the plan refuses it
    rather than guessing; without the manager (not installed, older builds) only the setting
    counts.
    """
    try:
        core = importlib.import_module("primus_turbo.pytorch.core.backend")
        manager, precision = core.GlobalBackendManager, core.PrecisionType.BF16_FP16_FP32
    except (ImportError, AttributeError):
        return Selection(autotune=autotune)
    try:
        pinned = manager.get_attn_backend(precision)
    except Exception:  # noqa: BLE001 - upstream raises for a name it does not know: so will its dispatcher
        pinned_name: Optional[str] = os.environ.get("PRIMUS_TURBO_ATTN_BACKEND", "unreadable").strip() or "unreadable"
    else:
        pinned_name = getattr(pinned, "name", None) if pinned is not None else None
    return Selection(pin=pinned_name, autotune=bool(autotune or manager.auto_tune_enabled()))


def kernel_build() -> TurboBuild:
    """The installed Primus-Turbo's build, read from its signatures (`turbo_build.installed_build`);
    a6a16cd, the newest stored one, where none is installed (``check --turbo-build`` names another)."""
    return installed_build() or BUILD_A6A16CD


def turbo_window_args(pattern: Pattern) -> tuple[bool, tuple[int, int]]:
    """``(causal, window_size)`` in flash convention for a window pattern."""
    causal = pattern.right == 0
    if pattern.window in ((-1, -1), (-1, 0)):
        return causal, (-1, -1)
    return causal, pattern.window


class TurboBackend(AttentionBackend):
    """Runs recognised patterns on Primus-Turbo; entries are chosen by signature."""

    name = "turbo"

    def __init__(self, ops: Any = None) -> None:
        self.ops = ops if ops is not None else load_ops()
        self.direct: Callable[..., Any] = self.ops.flash_attn_func
        self.flash_varlen: Callable[..., Any] = self.ops.flash_attn_varlen_func
        self.kernels = discover_kernels()

    def capabilities(self) -> BackendCapabilities:
        varlen = self.flash_varlen
        return BackendCapabilities(
            name=self.name,
            hooks=HOOKS_PROVEN,
            softcap=False,
            dense_entry=entry_name(self.direct),
            packed_entry=entry_name(varlen),
            direct_entry="flash_attn_func",
            sink_dense=entry_accepts(self.direct, "sink"),
            sink_packed=entry_accepts(varlen, "sink"),
            deterministic_dense=entry_accepts(self.direct, "deterministic"),
            deterministic_packed=entry_accepts(varlen, "deterministic"),
            alibi=True, bias=True,  # flash_attn_func's alibi_slopes and bias (the varlen entry refuses a bias)
            learned_tables=False,  # a fixed kernel computes no gradient for what a hook captures
            dispatch=TURBO_DISPATCH,
        )

    def kernel_pair(self, a: CallArgs, call: KernelCall, routes: Optional[CallRoutes]) -> Optional[KernelPair]:
        """The kernel-level pair (AITER, FlyDSL, HipKittens) of the backend the dispatch model sends
        the call to on the plan's arch, so that compiled and eager steps run the same kernels
        (`turbo_kernels`)."""
        pattern = call.pattern
        if pattern is None or pattern.boundaries is not None:
            return None  # documents flattened onto the varlen kernel keep the recompute
        causal, window = turbo_window_args(pattern)
        pair = kernel_pair(self.kernels, routes, a, causal, window)
        if pair is not None and a.cu_q is not None and pattern.window != (-1, -1):
            _check_same_boundaries(a.cu_q, a.cu_kv, pattern)
        return pair

    # -- dense ---------------------------------------------------------------
    def dense(self, q: Tensor, k: Tensor, v: Tensor, call: KernelCall) -> Output:
        return self.bind_dense(call)(q, k, v, call.sink)

    def bind_dense(self, call: KernelCall) -> Callable[[Tensor, Tensor, Tensor, Optional[Tensor]], Output]:
        """``run(q, k, v, sink)`` for this call, its kernel keywords prepared once (the adapter
        keeps it for equal calls)."""
        pattern = call.pattern
        assert pattern is not None, "the plan never sends a custom mask to the turbo backend"
        if pattern.boundaries is not None:
            return lambda q, k, v, sink: self._documents_dense(
                q, k, v, call if sink is call.sink else dataclasses.replace(call, sink=sink))
        # Normalised always (causal=False with (-1, 0) is causal): the kernel's dispatcher reads
        # the flags as given, and the plan routed the normalised call; Megatron's own causal /
        # full calls are unchanged by it (B6).
        causal, window = turbo_window_args(pattern)
        direct = self.direct
        kwargs = without_defaults(direct, dict(
            dropout_p=call.dropout_p, softmax_scale=call.scale, causal=causal, window_size=window, bias=call.bias,
            alibi_slopes=call.alibi_slopes, deterministic=call.deterministic, return_lse=call.return_lse,
            return_attn_probs=False))
        if entry_accepts(direct, "sink"):
            return lambda q, k, v, sink: direct(q, k, v, sink=sink, **kwargs)
        return lambda q, k, v, sink: direct(q, k, v, **kwargs, **sink_kwargs_for(direct, sink, where="dense"))

    def _documents_dense(self, q: Tensor, k: Tensor, v: Tensor, call: KernelCall) -> Output:
        """Same documents in every sequence: flatten the batch and run the varlen kernel."""
        pattern = call.pattern
        assert pattern is not None and pattern.boundaries is not None
        if call.bias is not None:
            # The varlen kernel takes no bias: passing the call on would drop it silently.
            raise refuse(DOCUMENTS_BIAS, mask=pattern.describe())
        batch, seq = q.shape[0], q.shape[1]
        bounds = torch.tensor(pattern.boundaries, dtype=torch.int32)
        starts = torch.arange(batch, dtype=torch.int32).repeat_interleave(len(bounds) - 1) * seq
        cu = torch.cat([(starts + bounds[:-1].repeat(batch)), torch.tensor([batch * seq], dtype=torch.int32)])
        cu = cu.to(q.device)
        longest = max(b - a for a, b in zip(pattern.boundaries, pattern.boundaries[1:]))
        # bshd -> thd, contiguous: FlyDSL's varlen kernel reads fixed strides whatever the tensors' own, and
        # one sequence of a split view flattens to a view (a copy only then; docs/performance.md)
        q_thd, k_thd, v_thd = (t.reshape(batch * t.shape[1], *t.shape[2:]).contiguous() for t in (q, k, v))
        result = self.packed(q_thd, k_thd, v_thd, cu, cu, longest, longest, call)
        if call.return_lse:
            out_thd, lse = result  # [H, T] from `packed`
            lse = lse.reshape(lse.shape[0], batch, seq).transpose(0, 1)
            return out_thd.reshape(batch, seq, *out_thd.shape[1:]), lse
        return result.reshape(batch, seq, *result.shape[1:])  # thd -> bshd

    # -- packed --------------------------------------------------------------
    def packed(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_kv: Tensor,
               max_seqlen_q: Any, max_seqlen_kv: Any, call: KernelCall) -> Output:
        return self.bind_packed(call)(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, call.sink)

    def bind_packed(self, call: KernelCall) -> Callable[..., Output]:
        """``run(q, k, v, cu_q, cu_kv, max_q, max_kv, sink)`` for this call (see `bind_dense`)."""
        pattern = call.pattern
        assert pattern is not None
        causal, window = turbo_window_args(pattern)
        check = pattern.window != (-1, -1)
        varlen, accepts, lse = self.flash_varlen, entry_accepts(self.flash_varlen, "sink"), call.return_lse
        kwargs = without_defaults(varlen, dict(
            dropout_p=call.dropout_p, softmax_scale=call.scale, causal=causal, window_size=window,
            alibi_slopes=call.alibi_slopes, deterministic=call.deterministic, return_lse=call.return_lse,
            return_attn_probs=False))

        def run(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_kv: Tensor, max_q: Any, max_kv: Any,
                sink: Optional[Tensor]) -> Output:
            if check:
                _check_same_boundaries(cu_q, cu_kv, pattern)
            extra = {"sink": sink} if accepts else sink_kwargs_for(varlen, sink, where="packed")
            result = varlen(q, k, v, cu_q, cu_kv, max_q, max_kv, **kwargs, **extra)
            return varlen_lse_as_heads_tokens(result) if lse else result

        return run


def varlen_lse_as_heads_tokens(result: Any) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` with lse as ``[Hq, T]``: AITER returns that, FlyDSL ``[B, Hq, Sq]``
    over its equal-length documents (Primus-Turbo ``attention_aiter_impl.py`` l.764, ``flash_attn_interface.py``
    l.631-632 at a6a16cd); callers get one layout."""
    out, lse = result
    if lse.dim() == 3:
        lse = lse.transpose(0, 1).reshape(lse.shape[1], -1)
    return out, lse


def _check_same_boundaries(cu_q: Tensor, cu_kv: Tensor, pattern: Pattern) -> None:
    """Refuse a causal / windowed packed call whose q and kv documents differ in length: the
    varlen kernel aligns such a window bottom-right inside each document (flash convention),
    a mask_mod (and so the reference backend) top-left."""
    check_same_boundaries(cu_q, cu_kv, lambda: refuse(DOCUMENT_ALIGNMENT, mask=pattern.describe()))


__all__ = ["TurboBackend", "kernel_build", "kernel_selection", "load_ops", "turbo_window_args"]
