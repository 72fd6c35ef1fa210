"""The ``turbo`` backend: Primus-Turbo's fixed kernels on ROCm.

Routing of a dense call (the plan guarantees a recognised pattern):

* the caller's own ``causal``/``window_size`` giving causal or full attention ->
  ``flash_attn_func`` with exactly the caller's arguments, i.e. the same kernel and
  arguments as the direct path (B6);
* a window with a right bound (not causal) -> ``flash_attn_func`` with
  ``window_size=(left, right)``, whose kernel honours both bounds (B8);
* packed documents -> ``flex_attention_varlen`` on the flattened batch;
* everything else (masks from hooks or a causal window) -> the flex entry with a
  cached, analytically built BlockMask: ``flex_attention_bshd`` where the build has
  it, else ``flex_attention`` on bhsd views (B7).

Packed (thd) calls go to ``flex_attention_varlen`` and never touch the BlockMask
cache (B16).

A build without the flex compat layer (Primus-Turbo main, the build Primus pins) runs
the same patterns on the entries it has: windows on ``flash_attn_func(causal,
window_size)``, documents and packed calls on ``flash_attn_varlen_func``.  Every pattern
the plan proves is a window inside documents, which those two take, so such a build
refuses nothing the flex layer would run.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from ..attention.block_mask_cache import BlockMaskCache
from ..attention.pattern import Pattern
from ..errors import Reason, UnsupportedInputError
from .base import BackendCapabilities, KernelCall, Output
from .capabilities import deterministic_kwargs_for, entry_accepts, sink_kwargs_for


def load_ops() -> Any:
    """Import Primus-Turbo's attention ops module (raises ImportError when absent)."""
    return importlib.import_module("primus_turbo.pytorch.ops")


def turbo_window_args(pattern: Pattern) -> tuple[bool, tuple[int, int]]:
    """``(causal, window_size)`` in flash convention for a window pattern."""
    causal = pattern.right == 0
    if pattern.window in ((-1, -1), (-1, 0)):
        return causal, (-1, -1)
    return causal, pattern.window


class TurboBackend:
    """Runs recognised patterns on Primus-Turbo; entries are chosen by signature."""

    name = "turbo"

    def __init__(self, ops: Any = None, cache: Optional[BlockMaskCache] = None) -> None:
        self.ops = ops if ops is not None else load_ops()
        self.cache = cache if cache is not None else BlockMaskCache()
        self.direct: Callable[..., Any] = self.ops.flash_attn_func
        bshd = getattr(self.ops, "flex_attention_bshd", None)
        self.flex: Optional[Callable[..., Any]] = bshd or getattr(self.ops, "flex_attention", None)
        self.flex_is_bshd = bshd is not None
        self.varlen: Optional[Callable[..., Any]] = getattr(self.ops, "flex_attention_varlen", None)
        # Builds without the flex compat layer (Primus-Turbo main, the build Primus pins) still
        # compute every pattern the plan proves: windows on flash_attn_func, documents on
        # flash_attn_varlen_func, each taking (causal, window_size) for the same kernels.
        self.flash_varlen: Optional[Callable[..., Any]] = getattr(self.ops, "flash_attn_varlen_func", None)

    def capabilities(self) -> BackendCapabilities:
        def has(entry: Optional[Callable[..., Any]], name: str) -> bool:
            return entry is not None and entry_accepts(entry, name)

        return BackendCapabilities(
            name=self.name,
            runs_any_mask=False,
            softcap=False,
            dense_entry=getattr(self.flex or self.direct, "__name__", None),
            packed_entry=getattr(self.varlen or self.flash_varlen, "__name__", None),
            direct_entry="flash_attn_func",
            sink_dense=has(self.flex or self.direct, "sink") and has(self.direct, "sink"),
            sink_packed=has(self.varlen or self.flash_varlen, "sink"),
            deterministic_dense=has(self.flex or self.direct, "deterministic"),
            deterministic_packed=has(self.varlen or self.flash_varlen, "deterministic"),
        )

    # -- dense ---------------------------------------------------------------
    def dense(self, q: Tensor, k: Tensor, v: Tensor, call: KernelCall) -> Output:
        pattern = call.pattern
        assert pattern is not None, "the plan never sends a custom mask to the turbo backend"
        if call.flash_args is not None and pattern.kind in ("causal", "full"):
            causal, window = call.flash_args
            return self._flash(q, k, v, call, causal=causal, window=window)
        if pattern.boundaries is not None:
            return self._documents_dense(q, k, v, call)
        if pattern.kind == "window" and pattern.right != 0:
            return self._flash(q, k, v, call, causal=False, window=pattern.window)
        return self._flex_dense(q, k, v, call)

    def _flash(self, q: Tensor, k: Tensor, v: Tensor, call: KernelCall, *, causal: bool,
               window: tuple[int, int]) -> Output:
        return self.direct(
            q, k, v,
            dropout_p=call.dropout_p,
            softmax_scale=call.scale,
            causal=causal,
            window_size=window,
            bias=call.bias,
            alibi_slopes=call.alibi_slopes,
            deterministic=call.deterministic,
            return_lse=call.return_lse,
            return_attn_probs=False,
            **sink_kwargs_for(self.direct, call.sink, where="dense"),
        )

    def _flex_dense(self, q: Tensor, k: Tensor, v: Tensor, call: KernelCall) -> Output:
        if self.flex is None:  # no flex layer in this build: the same window on flash_attn_func
            causal, window = turbo_window_args(call.pattern)  # type: ignore[arg-type]
            return self._flash(q, k, v, call, causal=causal, window=window)
        block_mask = self.cache.get(call.pattern, q.shape[1], k.shape[1], q.device)
        kwargs = dict(
            block_mask=block_mask,
            scale=call.scale,
            enable_gqa=q.shape[2] != k.shape[2],
            return_lse=call.return_lse,
            alibi_slopes=call.alibi_slopes,
            dropout_p=call.dropout_p,
            bias=call.bias,
            **sink_kwargs_for(self.flex, call.sink, where="dense"),
            **deterministic_kwargs_for(self.flex, call.deterministic, where="dense"),
        )
        if self.flex_is_bshd:
            return self.flex(q, k, v, **kwargs)
        # bhsd entry: transposes are views in, and the exact inverse on the way out.
        result = self.flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kwargs)
        if call.return_lse:
            out, lse = result
            return out.transpose(1, 2), lse
        return result.transpose(1, 2)

    def _documents_dense(self, q: Tensor, k: Tensor, v: Tensor, call: KernelCall) -> Output:
        """Same documents in every sequence: flatten the batch and run the varlen kernel."""
        pattern = call.pattern
        assert pattern is not None and pattern.boundaries is not None
        if call.bias is not None:
            # The varlen kernel takes no bias: passing the call on would drop it silently.
            raise UnsupportedInputError(Reason(
                ("turbo_flex_attention_mask_mod", "bias"),
                f"a {pattern.describe()} mask runs on Primus-Turbo's varlen kernel, which takes no bias; "
                "the bias would be dropped (B17).",
                "remove the bias, or set turbo_flex_attention_backend: reference."))
        batch, seq = q.shape[0], q.shape[1]
        bounds = torch.tensor(pattern.boundaries, dtype=torch.int32)
        starts = torch.arange(batch, dtype=torch.int32).repeat_interleave(len(bounds) - 1) * seq
        cu = torch.cat([(starts + bounds[:-1].repeat(batch)), torch.tensor([batch * seq], dtype=torch.int32)])
        cu = cu.to(q.device)
        longest = max(b - a for a, b in zip(pattern.boundaries, pattern.boundaries[1:]))
        flat = lambda t: t.reshape(batch * t.shape[1], *t.shape[2:])  # noqa: E731
        result = self.packed(flat(q), flat(k), flat(v), cu, cu, longest, longest, call)
        if call.return_lse:
            out, lse = result  # varlen lse is [H, T]
            lse = lse.reshape(lse.shape[0], batch, seq).transpose(0, 1)
            return out.reshape(batch, seq, *out.shape[1:]), lse
        return result.reshape(batch, seq, *result.shape[1:])

    # -- packed --------------------------------------------------------------
    def packed(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_kv: Tensor,
               max_seqlen_q: Any, max_seqlen_kv: Any, call: KernelCall) -> Output:
        assert call.pattern is not None
        if call.pattern.window != (-1, -1):
            _check_same_boundaries(cu_seqlens_q, cu_seqlens_kv, call.pattern)
        causal, window = turbo_window_args(call.pattern)
        if self.varlen is None:  # no flex layer in this build: the same kernels via flash_attn_varlen_func
            assert self.flash_varlen is not None, "every Primus-Turbo build has flash_attn_varlen_func"
            return self.flash_varlen(
                q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                dropout_p=call.dropout_p, softmax_scale=call.scale, causal=causal, window_size=window,
                alibi_slopes=call.alibi_slopes, deterministic=call.deterministic, return_lse=call.return_lse,
                return_attn_probs=False, **sink_kwargs_for(self.flash_varlen, call.sink, where="packed"),
            )
        return self.varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
            causal=causal,
            window_size=window,
            scale=call.scale,
            alibi_slopes=call.alibi_slopes,
            dropout_p=call.dropout_p,
            return_lse=call.return_lse,
            **sink_kwargs_for(self.varlen, call.sink, where="packed"),
            **deterministic_kwargs_for(self.varlen, call.deterministic, where="packed"),
        )


def _same_tensor(a: Tensor, b: Tensor) -> bool:
    """The same boundaries without reading them: one tensor, or two views of the same memory."""
    return a is b or (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape
                      and a.stride() == b.stride() and a.data_ptr() == b.data_ptr())


def _check_same_boundaries(cu_q: Tensor, cu_kv: Tensor, pattern: Pattern) -> None:
    """Refuse a causal / windowed packed call whose q and kv documents differ in length.

    The varlen kernel aligns such a window bottom-right inside each document (flash
    convention) while a mask_mod, and so the reference backend, aligns it top-left: the
    same call would give two different answers.  The boundaries are read on the host only
    when two distinct tensors are given (Megatron passes one tensor for both).
    """
    if _same_tensor(cu_q, cu_kv):
        return
    why = ("cu_seqlens_q and cu_seqlens_kv differ, so documents have different q and kv lengths; "
           f"Primus-Turbo's varlen kernel aligns the {pattern.describe()} mask bottom-right inside "
           "each document, a mask_mod (and the reference backend) top-left.")
    if torch.compiler.is_compiling() and cu_q.shape == cu_kv.shape:
        torch._assert_async((cu_q == cu_kv.to(cu_q.device)).all(), why)
        return
    if cu_q.shape != cu_kv.shape or not torch.equal(cu_q, cu_kv.to(cu_q.device)):
        raise UnsupportedInputError(Reason(
            ("cu_seqlens_q", "cu_seqlens_kv"), why,
            "pass equal q and kv boundaries, use a full (non-causal, unwindowed) mask, or set "
            "turbo_flex_attention_backend: reference."))


__all__ = ["TurboBackend", "load_ops", "turbo_window_args"]
