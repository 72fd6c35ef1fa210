"""The learned sink parameter: one logit per query head on this tensor-parallel rank.

Under context parallelism the parameter is the same (one entry per head of the TP rank, on
every CP rank); each call passes the CP rank's slice of it, the heads that rank attends
over (`primus_ext.megatron.context_parallel`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor


def sink_device(config: Any) -> torch.device:
    if getattr(config, "use_cpu_initialization", False) or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def register_sink(module: torch.nn.Module, config: Any, local_heads: int, *, learnable: bool) -> None:
    """Register ``module.softmax_offset`` (Megatron's name for the same quantity).

    Learned: a parameter of ``local_heads`` entries, zero-initialised (the same values
    under any tensor-parallel split), marked as split along dim 0 like Megatron's own
    per-head parameters.  ``off-by-one``: a fixed zero buffer.
    """
    values = torch.zeros(local_heads, dtype=config.params_dtype, device=sink_device(config))
    if not learnable:
        module.register_buffer("softmax_offset", values, persistent=False)
        return
    param = torch.nn.Parameter(values)
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)
    module.register_parameter("softmax_offset", param)


def sink_of(module: torch.nn.Module) -> Optional[Tensor]:
    return getattr(module, "softmax_offset", None)


def sharded_sink_state_dict(module: torch.nn.Module, prefix: str, sharded_offsets: Any, metadata: Optional[dict],
                            tp_group: Any) -> dict:
    """Checkpoint entries of the layer: the sink, sharded along heads like Megatron's ``softmax_offset``, and
    its hooks' learned tables (`primus_ext.megatron.hook_tables`), replicated (whole on every rank)."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    from .hook_tables import hook_table_keys

    own = module.state_dict(prefix="", keep_vars=True)
    state = {k: own[k] for k in ["softmax_offset", *hook_table_keys(own)] if k in own}
    return make_sharded_tensors_for_checkpoint(
        state, prefix, {"softmax_offset": 0}, sharded_offsets, tp_group=tp_group,
        dp_cp_group=(metadata or {}).get("dp_cp_group"),
    )


__all__ = ["register_sink", "sharded_sink_state_dict", "sink_device", "sink_of"]
