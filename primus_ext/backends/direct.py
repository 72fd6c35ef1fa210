"""The direct path (``use_turbo_flex_attention: false``): Primus-Turbo's fixed entries.

Entry choice follows upstream Primus: fp8 -> ``flash_attn_fp8_func`` (context
parallel: ``flash_attn_fp8_usp_func``); context parallel -> ``flash_attn_usp_func``;
otherwise ``flash_attn_func``.  Packed (thd) batches go to ``flash_attn_varlen_func``
and only at context-parallel size 1 (B18).  Which entries take ``sink`` is read
from their signatures (B13).

Context parallelism: every usp entry takes two process groups and needs both.
``ulysses_group`` is required (Primus-Turbo calls ``ulysses_group.size()``, so None
crashes), and ``ring_group=None`` does not mean "no ring": it means the WORLD group,
so the ranks of every other parallel dimension would be treated as further sequence
chunks and exchanged in a ring, which is wrong (and, where the ring overlaps the
Ulysses group, exchanges key/value heads of other ranks as if they were tokens).
So, whatever ``cp_comm_type`` says (``a2a`` or ``p2p``), the direct path passes
`context_parallel_groups`: ``ulysses_group`` = the context-parallel group and
``ring_group`` = a size-1 group holding only this rank, exactly as upstream Primus
does.  Attention is then Ulysses over the CP group (an all-to-all from sequence
shards to head shards and back), with a ring of one, which is also the only ring
size the fp8 usp entry and ``flash_attn_varlen_usp_func`` accept.  Consequences,
refused at build time: the CP size must divide both head counts of this rank
(``cp-heads``), and attention dropout must be 0 (``B30-cp``: every usp entry
asserts ``dropout_p == 0``).

The size-1 ring group is created once per process (per initialised default group)
by `singleton_ring_group`.  ``torch.distributed.new_group`` is collective over the
default group (every rank must call it, in the same order, for every group), so it
creates the singleton group of *every* rank, in rank order, on every rank, and keeps
this rank's.  That happens when the first context-parallel direct layer is built,
which every rank does at the same point of model construction; a program whose ranks
do not all build such a layer calls `singleton_ring_group()` on every rank right
after initialising the parallel state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

from torch import Tensor

from .base import fp32_sink
from .call_route import CallRoutes
from .capabilities import entry_accepts, sink_kwargs_for
from .dispatch import DEFAULT_ORDER, Selection
from .ops import CallArgs
from .turbo_kernels import AiterPair, aiter_pair, discover

CP_GROUP_KWARGS = ("ulysses_group", "ring_group")

# (default group the cache belongs to, this rank's size-1 group).  Holding the default
# group keeps it alive, so an identity check is enough to notice a re-initialised world.
_SINGLETON_RING: Optional[Tuple[Any, Any]] = None


def singleton_ring_group() -> Any:
    """This rank's size-1 process group, the ``ring_group`` of every usp call.

    Collective on first use in a world (see the module docstring): every rank creates
    the singleton group of every rank in rank order and keeps its own; later calls
    return the cached group.
    """
    global _SINGLETON_RING
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "context parallelism on the direct Turbo path needs torch.distributed to be "
            "initialised before the attention layers are built (the usp entries take process groups)"
        )
    world = dist.group.WORLD
    if _SINGLETON_RING is not None and _SINGLETON_RING[0] is world:
        return _SINGLETON_RING[1]
    rank, mine = dist.get_rank(), None
    for r in range(dist.get_world_size()):
        group = dist.new_group(ranks=[r])
        if r == rank:
            mine = group
    _SINGLETON_RING = (world, mine)
    return mine


def context_parallel_groups(cp_group: Any) -> dict:
    """The usp entries' process-group kwargs: Ulysses over ``cp_group``, a ring of one."""
    if cp_group is None:
        raise ValueError("context parallelism needs the context-parallel process group; got None")
    return {"ulysses_group": cp_group, "ring_group": singleton_ring_group()}


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
        # The usp entries need both groups (None is a crash or a ring over WORLD); no other
        # entry takes them.
        wanted = set(CP_GROUP_KWARGS) if entries.context_parallel else set()
        if set(self.cp_groups) != wanted or any(group is None for group in self.cp_groups.values()):
            raise AssertionError(
                f"primus_ext invariant broken: {entries.dense} needs the process groups {sorted(wanted)}, "
                f"got {self.cp_groups}"
            )

    def dense_call(self, q: Tensor, k: Tensor, v: Tensor, *, dropout_p: float, scale: Optional[float],
                   causal: bool, window: Tuple[int, int], sink: Optional[Tensor], deterministic: bool) -> Tensor:
        kwargs: dict[str, Any] = dict(
            dropout_p=dropout_p, softmax_scale=scale, causal=causal, deterministic=deterministic,
        )
        if self.entries.takes_window:
            kwargs["window_size"] = window
        if self.cp_groups and dropout_p != 0.0:
            raise AssertionError(f"primus_ext invariant broken: dropout_p={dropout_p} reached {self.entries.dense}, "
                                 "which asserts dropout_p == 0 (refused at build time as B30-cp)")
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
    """What a direct-path op handle runs (see `primus_ext.backends.ops`); on a known ``arch``
    a call routed to AITER gets AITER's kernel-level pair in compiled steps."""

    def __init__(self, runner: DirectRunner, arch: Optional[str] = None, selection: Selection = DEFAULT_ORDER) -> None:
        self.runner = runner
        plain = runner.entries.dense == "flash_attn_func"
        self.kernels = discover() if plain else None
        self.routes = CallRoutes(arch, selection) if plain else None

    def check(self, a: CallArgs) -> None:
        """Refuse a call the kernels would fail or compute wrongly (its route on the plan's arch,
        its storage layout on any), as the flex adapter does (B33, B34)."""
        if self.routes is not None:
            self.routes.check("dense" if a.cu_q is None else "varlen", a.q, a.k, a.v, a.causal, a.window, a.sink,
                              a.dropout_p, a.deterministic, None, None, a.scale)

    def pair(self, a: CallArgs) -> Optional[AiterPair]:
        # The direct path passes Megatron's own causal / window to the entry: the same here.
        return aiter_pair(self.kernels, self.routes, a, a.causal, a.window)

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


__all__ = ["CP_GROUP_KWARGS", "DirectEntries", "DirectRunner", "DirectTarget", "choose_direct",
           "context_parallel_groups", "singleton_ring_group"]
