"""`PrimusTurboLocalAttention`: Turbo core attention for plain megatron-core (no TransformerEngine)."""

from __future__ import annotations

from typing import Any, Optional

from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from ..settings import TurboAttentionSettings
from .core import TurboAttentionCore
from .hook_tables import register_hook_tables
from .sink import register_sink, sharded_sink_state_dict, sink_of


class PrimusTurboLocalAttention(MegatronModule):
    """Megatron core attention on the flex or direct Turbo path.

    Built with Megatron's core-attention keywords; every refusal of the plan is
    raised here, at model-build time.  ``settings`` is bound by
    `PrimusTurboLocalSpecProvider`; when absent, Megatron-LM's args are read.
    """

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str = "self",
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 k_channels: Optional[int] = None, v_channels: Optional[int] = None,
                 cp_comm_type: Optional[str] = None, pg_collection: Any = None,
                 *, settings: Optional[TurboAttentionSettings] = None) -> None:
        super().__init__(config=config)
        self.layer_number = max(1, layer_number)
        self.attention_type = attention_type
        self.pg_collection = pg_collection
        self.core = TurboAttentionCore(
            config=config, layer_number=layer_number, attn_mask_type=attn_mask_type,
            attention_dropout=attention_dropout, softmax_scale=softmax_scale, k_channels=k_channels,
            v_channels=v_channels, cp_comm_type=cp_comm_type, pg_collection=pg_collection, settings=settings,
        )
        if self.core.plan.sink:
            register_sink(self, config, self.core.local_heads,
                          learnable=getattr(config, "softmax_type", "vanilla") != "off-by-one")
        register_hook_tables(self, self.core.plan, pg_collection)

    @property
    def plan(self):
        return self.core.plan

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Any = None, attention_bias: Optional[Tensor] = None,
                packed_seq_params: Any = None) -> Tensor:
        return self.core.forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                 packed_seq_params, sink=sink_of(self), training=self.training)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: Any = (), metadata: Optional[dict] = None):
        tp_group = getattr(self.pg_collection, "tp", None)
        return sharded_sink_state_dict(self, prefix, sharded_offsets, metadata, tp_group)


__all__ = ["PrimusTurboLocalAttention"]
