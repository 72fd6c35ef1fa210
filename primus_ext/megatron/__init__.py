"""Megatron-LM integration: Turbo core-attention modules, spec providers and args.

Needs megatron-core (``pip install primus-ext[megatron]``); TransformerEngine only
for `PrimusTurboAttention`, imported when that name is first used.
"""

from __future__ import annotations

from typing import Any

from .args import add_turbo_attention_args, settings_or_megatron_args
from .core import TurboAttentionCore
from .eod_packing import PackedMicroBatch, pack_eod_micro_batch
from .shared_prefix import SharedPrefixBatch, SharedPrefixSeqParams, pack_shared_prefix, prepare_shared_prefix
from .facts import layer_facts
from .local import PrimusTurboLocalAttention
from .specs import (
    PrimusTurboLocalSpecProvider,
    get_gpt_layer_primus_turbo_local_spec,
    primus_turbo_te_core_attention,
    use_core_attention,
)

__all__ = [
    "PrimusTurboAttention",
    "PrimusTurboLocalAttention",
    "PrimusTurboLocalSpecProvider",
    "PackedMicroBatch",
    "TurboAttentionCore",
    "add_turbo_attention_args",
    "get_gpt_layer_primus_turbo_local_spec",
    "layer_facts",
    "pack_eod_micro_batch",
    "pack_shared_prefix",
    "prepare_shared_prefix",
    "SharedPrefixBatch",
    "SharedPrefixSeqParams",
    "primus_turbo_te_core_attention",
    "settings_or_megatron_args",
    "use_core_attention",
]


def __getattr__(name: str) -> Any:
    if name == "PrimusTurboAttention":  # TransformerEngine is imported only here
        from .te import te_attention_class

        return te_attention_class()
    raise AttributeError(name)
