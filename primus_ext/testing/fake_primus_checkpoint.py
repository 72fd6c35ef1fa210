"""A CPU stand-in for the part of AMD Primus's attention that its checkpoints hold: the learned
sinks, and what Megatron saves of them.

Written from the facts read in Primus's sources (main fd1eeab), not copied:

* ``PrimusTurboAttention`` (``primus/backends/megatron/core/extensions/primus_turbo.py``, a
  subclass of TransformerEngine's ``DotProductAttention``) creates, with ``use_sink_attention``,
  ``self.sinks = nn.Parameter(torch.zeros(config.num_attention_heads, dtype=torch.float32))``
  (l.881): the *global* head count, not divided by tensor parallelism.
* It defines no ``sharded_state_dict``, so megatron-core's ``sharded_state_dict_default``
  (``megatron/core/transformer/utils.py`` l.209-250) saves its state dict replicated over TP:
  key ``...self_attention.core_attention.sinks``, the full vector, written once by the main
  replica (TP rank 0).  Here the module is a plain ``torch.nn.Module`` for the same reason: the
  default's fallback branch is what saves it.
* ``forward`` hands the kernel ``sink=self.sinks.float()`` (l.932, l.979) whatever the TP size: a rank with
  ``H_local`` heads gets all ``H`` entries, and the kernel reads entries ``0 .. H_local - 1``
  (inferred from the Triton kernel's indexing by local head; not verified in aiter).  Replicas
  get no TP all-reduce, so at TP > 1 they diverge and the saved vector says what rank 0 used.

`PrimusSinkAttention` computes with the CPU fake of Primus-Turbo's own math (`_fake_math`),
causal or full, without dropout: enough to compare outputs after a checkpoint conversion.
`gpt_layer_spec` is megatron-core's local GPT layer with it as core attention, and
`training_state_dict` the layout Megatron-LM's ``save_checkpoint`` gives a torch_dist
checkpoint (its ``args`` in the common state, the model's sharded tensors, per-parameter
optimizer states in the model's key space, an RNG object).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from ..attention.pattern import FULL, Pattern
from . import _fake_math

CAUSAL = Pattern(-1, 0)


class PrimusSinkAttention(torch.nn.Module):
    """Primus's sinks-bearing core attention: ``sinks`` fp32, one entry per *global* head."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str = "self",
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 k_channels: Optional[int] = None, v_channels: Optional[int] = None,
                 cp_comm_type: Optional[str] = "p2p", pg_collection: Any = None) -> None:
        from megatron.core.transformer.enums import AttnMaskType

        super().__init__()
        self.config = config
        self.softmax_scale = softmax_scale
        self.window = CAUSAL if attn_mask_type == AttnMaskType.causal else FULL
        self.local_heads = config.num_attention_heads // config.tensor_model_parallel_size
        # Upstream's shape and dtype: the global head count, float32 (Float16Module may cast it later).
        self.sinks = torch.nn.Parameter(torch.zeros(config.num_attention_heads, dtype=torch.float32))

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Any = None, attention_bias: Optional[Tensor] = None,
                packed_seq_params: Any = None) -> Tensor:
        """Megatron's sbhd q/k/v in, ``[S, B, H_local * D]`` out, with the sink entries the kernel reads."""
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))
        sink = self.sinks.float()[: self.local_heads]  # what the kernel reads of the whole vector it is given
        out = _fake_math.attention(q, k, v, window=self.window, scale=self.softmax_scale, sink=sink)
        return out.transpose(0, 1).reshape(query.shape[0], query.shape[1], -1)


def gpt_layer_spec() -> Any:
    """megatron-core's local GPT layer spec with Primus's sinks-bearing core attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = PrimusSinkAttention
    return spec


def sinks_of(model: torch.nn.Module) -> list[Tensor]:
    """Every layer's ``core_attention.sinks`` (Primus) or ``softmax_offset`` (primus_ext), in layer order."""
    found = []
    for name, param in model.named_parameters():
        if name.endswith("core_attention.sinks") or name.endswith("core_attention.softmax_offset"):
            found.append(param)
    return found


def training_state_dict(model: Any, args: Any, *, iteration: int = 1, optimizer_state: bool = True) -> dict:
    """The state dict Megatron-LM's ``save_checkpoint`` hands ``dist_checkpointing.save`` (torch_dist):
    ``args`` and counters in the common state, the model's sharded tensors under ``model``, with
    ``optimizer_state`` an ``exp_avg`` per parameter in the model's key space (the per-parameter
    layout of ``fully_reshardable``) and an RNG ``ShardedObject`` per rank."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing import ShardedObject
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    model_sd = model.sharded_state_dict()
    state: dict = {"args": args, "checkpoint_version": 3.0, "iteration": iteration, "model": model_sd}
    if optimizer_state:
        params = dict(model.named_parameters())
        state["optimizer"] = {
            name: make_sharded_optimizer_tensor(sh, torch.full_like(params[name], 0.5, dtype=torch.float32),
                                                "optimizer.state.exp_avg")
            for name, sh in model_sd.items() if name in params
        }
    rank = parallel_state.get_tensor_model_parallel_rank()
    world = parallel_state.get_tensor_model_parallel_world_size()
    state["rng_state"] = [ShardedObject("rng_state", {"rank": rank, "seed": 1234}, (world,), (rank,), replica_id=0)]
    return state


__all__ = ["PrimusSinkAttention", "gpt_layer_spec", "sinks_of", "training_state_dict"]
