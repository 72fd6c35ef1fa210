"""Tiny megatron-core GPT models on CPU, built with Turbo core attention, and a training loop."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from primus_ext.megatron import get_gpt_layer_primus_turbo_local_spec
from primus_ext.settings import TurboAttentionSettings

VOCAB = 64
SEQ = 16


def config(**overrides: Any) -> TransformerConfig:
    """CPU-friendly config: fusions off, CPU initialisation, no dropout unless asked."""
    base = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        use_cpu_initialization=True, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, gradient_accumulation_fusion=False, apply_rope_fusion=False,
        attention_dropout=0.0, hidden_dropout=0.0,
    )
    base.update(overrides)
    return TransformerConfig(**base)


def settings(**keys: Any) -> TurboAttentionSettings:
    return TurboAttentionSettings.from_dict({"use_turbo_attention": True, **keys})


def build_gpt(turbo: TurboAttentionSettings, cfg: Optional[TransformerConfig] = None, *, seed: int = 0,
              seq: int = SEQ) -> GPTModel:
    """Same seed -> same weights, whatever the attention path."""
    torch.manual_seed(seed)
    return GPTModel(config=cfg or config(), transformer_layer_spec=get_gpt_layer_primus_turbo_local_spec(turbo),
                    vocab_size=VOCAB, max_sequence_length=seq * 4, position_embedding_type="learned_absolute")


def batches(n: int, *, batch: int = 2, seq: int = SEQ, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, seq), generator=gen) for _ in range(n)]


def train(model: GPTModel, data: Sequence[torch.Tensor], *, lr: float = 1e-2) -> list[float]:
    """Plain SGD steps; returns the mean loss of each step."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    model.train()
    for tokens in data:
        pos = torch.arange(tokens.shape[1]).expand_as(tokens)
        loss = model(tokens, pos, None, labels=tokens).float().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def attention_modules(model: GPTModel) -> list[Any]:
    return [layer.self_attention.core_attention for layer in model.decoder.layers]
