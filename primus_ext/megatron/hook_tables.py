"""Learned tables of hooks as parameters of the Megatron layers whose hooks read them.

A score hook may read a table that trains (``torch.nn.Parameter``, e.g. a per-head bias): the
``reference`` backend gives it its gradient through the hook as called, but Megatron's optimizer,
its gradient reduction and its checkpoints see only the model's parameters.  So each layer
registers the tables its hooks read as ``hook_tables.<i>``: the model's ``parameters()`` holds
each once however many layers share it (torch removes duplicates, as for tied weights), its
``state_dict`` and megatron-core's ``sharded_state_dict`` hold it under each layer (replicated,
like a layer norm's weight), and ``primus-ext convert`` copies it as any other tensor.

A table is indexed by the model's (global) head index, so it is the whole table on every rank:
under tensor parallelism it is made equal on the group's ranks when the layer is built (a
broadcast from the group's first rank, as megatron-core's DDP does for data-parallel replicas),
and its gradient, of which each tensor-parallel rank computes the part its own heads give, is
summed over the group before it is accumulated (a hook on the parameter).  Under context
parallelism each rank's part comes from its heads over the whole sequence (Ulysses), which
megatron-core's gradient reduction over the data-and-context-parallel group sums like any
replicated parameter's.  A table that is no parameter is refused at build (``hook-learned-param``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..backends.flex_masks import learned_tables

_SUMMED = "_primus_ext_tp_group"  # a parameter's attribute: the group its gradient is summed over (once)


def register_hook_tables(module: torch.nn.Module, plan: Any, pg_collection: Any) -> None:
    """Register the learned tables of ``plan``'s hooks on ``module`` (nothing without one)."""
    tp_group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
    if tp_group is None:
        from megatron.core import parallel_state

        tp_group = parallel_state.get_tensor_model_parallel_group(check_initialized=False)
    tables = [t for t in learned_tables(plan.mask_mod, plan.score_mod) if isinstance(t, torch.nn.Parameter)]
    if not tables:
        return
    module.hook_tables = torch.nn.ParameterList(tables)
    if tp_group is None or not dist.is_initialized() or dist.get_world_size(tp_group) == 1:
        return
    for table in tables:
        if getattr(table, _SUMMED, None) is not None:
            continue  # shared with a layer built before: broadcast and hooked once
        with torch.no_grad():
            dist.broadcast(table.data, src=dist.get_global_rank(tp_group, 0), group=tp_group)
        table.register_hook(lambda grad, group=tp_group: _summed(grad, group))
        setattr(table, _SUMMED, tp_group)


def _summed(grad: Tensor, group: Any) -> Tensor:
    total = grad.clone()
    dist.all_reduce(total, group=group)
    return total


def hook_table_keys(state: dict) -> list[str]:
    """The keys of ``state`` (a layer's own ``state_dict``) that are its hook tables."""
    return [key for key in state if key.startswith("hook_tables.")]


__all__ = ["hook_table_keys", "register_hook_tables"]
