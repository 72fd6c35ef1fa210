"""The direct path (``use_turbo_flex_attention: false``): Primus-Turbo's fixed entries.

Entry choice follows upstream Primus: fp8 -> ``flash_attn_fp8_func`` (context
parallel: ``flash_attn_fp8_usp_func``); context parallel -> ``flash_attn_usp_func``;
otherwise ``flash_attn_func``.  Packed (thd) batches go to ``flash_attn_varlen_func``
and only at context-parallel size 1 (B18).  Which entries take ``sink`` is read
from their signatures (B13).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

from torch import Tensor

from .base import fp32_sink
from .capabilities import entry_accepts, sink_kwargs_for

CP_GROUP_KWARGS = ("ulysses_group", "ring_group")


@dataclass(frozen=True)
class DirectEntries:
    """The direct-path entries chosen for a layer, and what their signatures accept."""

    dense: str
    packed: Optional[str]
    sink_dense: bool
    sink_packed: bool
    takes_window: bool

    @property
    def context_parallel(self) -> bool:
        return self.dense.endswith("_usp_func")


def choose_direct(ops: Any, *, fp8: bool, context_parallel: bool) -> DirectEntries:
    """Pick the direct entries of this build for the layer's fp8 / CP settings."""
    if fp8:
        dense = "flash_attn_fp8_usp_func" if context_parallel else "flash_attn_fp8_func"
    else:
        dense = "flash_attn_usp_func" if context_parallel else "flash_attn_func"
    packed = None if (fp8 or context_parallel) else "flash_attn_varlen_func"
    dense_entry = getattr(ops, dense)
    packed_entry = getattr(ops, packed) if packed else None
    return DirectEntries(
        dense=dense,
        packed=packed,
        sink_dense=entry_accepts(dense_entry, "sink"),
        sink_packed=packed_entry is not None and entry_accepts(packed_entry, "sink"),
        takes_window=not fp8,
    )


class DirectRunner:
    """Calls the chosen direct entries with Megatron's arguments, nothing dropped."""

    def __init__(self, ops: Any, entries: DirectEntries, cp_groups: Optional[dict] = None) -> None:
        self.entries = entries
        self.dense = getattr(ops, entries.dense)
        self.packed_entry = getattr(ops, entries.packed) if entries.packed else None
        self.cp_groups = dict(cp_groups or {})
        # B28: process-group kwargs only ever reach the usp entries, never the varlen binding.
        if self.cp_groups and self.packed_entry is not None:
            raise AssertionError(
                "primus_ext invariant broken: context-parallel process groups "
                f"{sorted(self.cp_groups)} coexist with the varlen binding {entries.packed}"
            )

    def dense_call(self, q: Tensor, k: Tensor, v: Tensor, *, dropout_p: float, scale: Optional[float],
                   causal: bool, window: Tuple[int, int], sink: Optional[Tensor], deterministic: bool) -> Tensor:
        kwargs: dict[str, Any] = dict(
            dropout_p=dropout_p, softmax_scale=scale, causal=causal, deterministic=deterministic,
        )
        if self.entries.takes_window:
            kwargs["window_size"] = window
        kwargs.update(self.cp_groups)
        kwargs.update(sink_kwargs_for(self.dense, fp32_sink(sink), where="dense"))
        return self.dense(q, k, v, **kwargs)

    def packed_call(self, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_kv: Tensor, max_q: Any,
                    max_kv: Any, *, dropout_p: float, scale: Optional[float], causal: bool,
                    window: Tuple[int, int], sink: Optional[Tensor], deterministic: bool) -> Tensor:
        assert self.packed_entry is not None and not self.cp_groups, "B28"
        return self.packed_entry(
            q, k, v, cu_q, cu_kv, max_q, max_kv,
            dropout_p=dropout_p, softmax_scale=scale, causal=causal, window_size=window,
            deterministic=deterministic, **sink_kwargs_for(self.packed_entry, fp32_sink(sink), where="packed"),
        )


class DirectTarget:
    """What a direct-path op handle runs (see `primus_ext.backends.ops`)."""

    def __init__(self, runner: DirectRunner) -> None:
        self.runner = runner

    def dense(self, q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor], alibi: Optional[Tensor],
              bias: Optional[Tensor], causal: bool, window: Tuple[int, int], scale: Optional[float],
              dropout_p: float, deterministic: bool, return_lse: bool) -> Tensor:
        assert alibi is None and bias is None and not return_lse, "refused before the direct call"
        return self.runner.dense_call(q, k, v, dropout_p=dropout_p, scale=scale, causal=causal, window=window,
                                      sink=sink, deterministic=deterministic)

    def packed(self, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_kv: Tensor, max_q: int, max_kv: int,
               sink: Optional[Tensor], alibi: Optional[Tensor], causal: bool, window: Tuple[int, int],
               scale: Optional[float], dropout_p: float, deterministic: bool, return_lse: bool) -> Tensor:
        assert alibi is None and not return_lse, "refused before the direct call"
        return self.runner.packed_call(q, k, v, cu_q, cu_kv, max_q, max_kv, dropout_p=dropout_p, scale=scale,
                                       causal=causal, window=window, sink=sink, deterministic=deterministic)


__all__ = ["CP_GROUP_KWARGS", "DirectEntries", "DirectRunner", "DirectTarget", "choose_direct"]
