"""`PrimusTurboAttention`: the same Turbo core as a TransformerEngine ``DotProductAttention``.

TransformerEngine is imported only when the class is first asked for, so the package
imports without it.  The CPU tests inject a minimal stand-in ``transformer_engine``
module (see ``tests/megatron/te_stub.py``); on ROCm machines the real one is used.
Megatron's ``kept_packed_seq_params`` belongs to its ``TEDotProductAttention``, not to
TE's class, so nothing here reads it.
"""

from __future__ import annotations

from typing import Any, Optional

_CLASSES: dict[type, type] = {}  # TE's DotProductAttention -> our subclass of it


def built_te_classes() -> tuple[type, ...]:
    """The TE-based Turbo attention classes built in this process (none before the first is asked for)."""
    return tuple(_CLASSES.values())


def te_attention_class() -> type:
    """Build (once per TransformerEngine base class) the TE-based Turbo attention class."""
    import transformer_engine.pytorch as te

    cached = _CLASSES.get(te.DotProductAttention)
    if cached is not None:
        return cached

    from ..settings import TurboAttentionSettings
    from .core import TurboAttentionCore
    from .hook_tables import register_hook_tables
    from .sink import register_sink, sharded_sink_state_dict, sink_of

    class PrimusTurboAttention(te.DotProductAttention):
        """Megatron core attention: TE's module shell, Primus-Turbo kernels inside."""

        def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str = "self",
                     attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                     k_channels: Optional[int] = None, v_channels: Optional[int] = None,
                     cp_comm_type: Optional[str] = "p2p", pg_collection: Any = None,
                     *, settings: Optional[TurboAttentionSettings] = None) -> None:
            # Plan first: refusals happen before TransformerEngine allocates anything.
            core = TurboAttentionCore(
                config=config, layer_number=layer_number, attn_mask_type=attn_mask_type,
                attention_dropout=attention_dropout, softmax_scale=softmax_scale, k_channels=k_channels,
                v_channels=v_channels, cp_comm_type=cp_comm_type, pg_collection=pg_collection,
                settings=settings,
            )
            tp_group = getattr(pg_collection, "tp", None)
            super().__init__(
                num_attention_heads=config.num_attention_heads,
                kv_channels=int(k_channels or config.kv_channels),
                num_gqa_groups=config.num_query_groups,
                attention_dropout=core.dropout,
                qkv_format="sbhd",
                attn_mask_type=getattr(attn_mask_type, "name", str(attn_mask_type)),
                tp_size=config.tensor_model_parallel_size,
                tp_group=tp_group,
                layer_number=layer_number,
                attention_type=attention_type,
                softmax_scale=softmax_scale,
            )
            self.config = config
            self.core = core
            self.pg_collection = pg_collection
            if core.plan.sink:
                register_sink(self, config, core.local_heads,
                              learnable=getattr(config, "softmax_type", "vanilla") != "off-by-one")
            register_hook_tables(self, core.plan, pg_collection)

        @property
        def plan(self):
            return self.core.plan

        def forward(self, query: Any, key: Any, value: Any, attention_mask: Any, attn_mask_type: Any = None,
                    attention_bias: Any = None, packed_seq_params: Any = None) -> Any:
            return self.core.forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                     packed_seq_params, sink=sink_of(self), training=self.training)

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: Any = (), metadata: Optional[dict] = None):
            return sharded_sink_state_dict(self, prefix, sharded_offsets, metadata,
                                           getattr(self.pg_collection, "tp", None))

    _CLASSES[te.DotProductAttention] = PrimusTurboAttention
    return PrimusTurboAttention


__all__ = ["te_attention_class"]
