"""The direct path (``use_turbo_flex_attention: false``): Primus-Turbo's fixed entries.

Entry choice follows upstream Primus: fp8 -> ``flash_attn_fp8_func``, otherwise
``flash_attn_func``.  Packed (thd) batches go to ``flash_attn_varlen_func`` (not with
fp8, B18).  Which entries take ``sink`` is read from their signatures (B13).

Context parallelism does not use Primus-Turbo's ``*_usp_func`` entries: they join the
sequence shards in rank order, while Megatron splits each sequence load-balanced
(docs/fidelity.md, fact `cp-shard-order`), and none takes a sink.  At CP > 1 the Megatron core runs
primus_ext's own Ulysses all-to-all (`primus_ext.backends.context_parallel`) around the
same per-rank entries, with this rank's heads of the whole sequence; so a runner here
never takes process groups.  fp8 with CP stays refused (``cp-fp8``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torch import Tensor

from .base import CallArgs, fp32_sink
from .capabilities import entry_accepts, sink_kwargs_for

@dataclass(frozen=True)
class DirectEntries:
    """The direct-path entries chosen for a layer, and what their signatures accept."""

    dense: str
    packed: Optional[str]
    sink_dense: bool
    sink_packed: bool
    takes_window: bool
    ulysses: bool = False
    """Context parallel: the Megatron core runs primus_ext's Ulysses around these entries."""


def choose_direct(ops: Any, *, fp8: bool, context_parallel: bool) -> DirectEntries:
    """Pick the direct entries of this build for the layer's fp8 / CP settings.

    At CP > 1 they are the same per-rank entries as at CP 1 (Ulysses runs around them);
    fp8 there is refused by the plan (``cp-fp8``), packed batches too (``cp-packed``).
    """
    dense = "flash_attn_fp8_func" if fp8 else "flash_attn_func"
    packed = None if fp8 else "flash_attn_varlen_func"
    dense_entry = getattr(ops, dense)
    packed_entry = getattr(ops, packed) if packed else None
    return DirectEntries(
        dense=dense,
        packed=packed,
        sink_dense=entry_accepts(dense_entry, "sink"),
        sink_packed=packed_entry is not None and entry_accepts(packed_entry, "sink"),
        takes_window=not fp8,
        ulysses=context_parallel,
    )


class DirectRunner:
    """Calls the chosen direct entries with Megatron's arguments, nothing dropped."""

    def __init__(self, ops: Any, entries: DirectEntries) -> None:
        self.entries = entries
        self.dense = getattr(ops, entries.dense)
        self.packed_entry = getattr(ops, entries.packed) if entries.packed else None

    def run(self, a: CallArgs) -> Tensor:
        """One checked call on its entry: ``flash_attn_func`` (or fp8) dense, ``flash_attn_varlen_func`` packed."""
        assert a.alibi is None and a.bias is None and not a.return_lse, "refused before the direct call"
        kwargs: dict[str, Any] = dict(dropout_p=a.dropout_p, softmax_scale=a.scale, causal=a.causal,
                                      deterministic=a.deterministic)
        if a.cu_q is None:
            if self.entries.takes_window:
                kwargs["window_size"] = a.window
            kwargs.update(sink_kwargs_for(self.dense, fp32_sink(a.sink), where="dense"))
            return self.dense(a.q, a.k, a.v, **kwargs)
        assert self.packed_entry is not None, "refused before the packed call (B18)"
        kwargs.update(sink_kwargs_for(self.packed_entry, fp32_sink(a.sink), where="packed"))
        return self.packed_entry(a.q, a.k, a.v, a.cu_q, a.cu_kv, a.max_q, a.max_kv, window_size=a.window, **kwargs)


__all__ = ["DirectEntries", "DirectRunner", "choose_direct"]
