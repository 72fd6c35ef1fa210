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


def fp8_config(**overrides: Any) -> TransformerConfig:
    """A config fp8 attention can train: bf16 (fp8 returns bf16) and head dims of 32 (its backward's floor)."""
    return config(**{"kv_channels": 32, "bf16": True, "params_dtype": torch.bfloat16, **overrides})


def fp8_tensors(*tensors: torch.Tensor) -> tuple:
    """q, k, v as a layer built by `fp8_config` receives them: bf16, head dim 32."""
    return tuple(torch.cat([t, t], dim=-1).bfloat16() for t in tensors)


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


# -- helpers added for the end-to-end training and packing tests -------------------------
def parameters(model: GPTModel) -> dict[str, torch.Tensor]:
    """Detached copies of every parameter, by name (to compare models bit for bit)."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def positions(tokens: torch.Tensor) -> torch.Tensor:
    """Learned-absolute position ids 0..S-1 for a [B, S] batch."""
    return torch.arange(tokens.shape[1]).expand_as(tokens)


def documents(lengths: Sequence[int], *, seed: int = 3) -> list[torch.Tensor]:
    """One [1, L] token tensor per document length."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (1, n), generator=gen) for n in lengths]


def pack(docs: Sequence[torch.Tensor], *, pad_to: int = 1, pad_token: int = 0):
    """Pack [1, L] documents into one THD row.

    Returns ``(tokens [1, T], position_ids [1, T], cu_seqlens, cu_seqlens_padded)``:
    positions restart at 0 in every document; each document is followed by padding up
    to a multiple of ``pad_to`` (none with the default 1).  ``cu_seqlens`` counts real
    tokens, ``cu_seqlens_padded`` the offsets in the packed row (int32, like Megatron).
    """
    rows, pos, real, padded = [], [], [0], [0]
    for doc in docs:
        n = doc.shape[1]
        width = -(-n // pad_to) * pad_to
        rows.append(torch.cat([doc, torch.full((1, width - n), pad_token, dtype=doc.dtype)], dim=1))
        pos.append(torch.arange(width))
        real.append(real[-1] + n)
        padded.append(padded[-1] + width)
    return (torch.cat(rows, dim=1), torch.cat(pos).unsqueeze(0),
            torch.tensor(real, dtype=torch.int32), torch.tensor(padded, dtype=torch.int32))


def thd_params(cu_seqlens: torch.Tensor, **extra: Any):
    """Megatron's ``PackedSeqParams`` for a THD batch with equal q/kv boundaries."""
    from megatron.core.packed_seq_params import PackedSeqParams

    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest, **extra)


def logits(model: GPTModel, tokens: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
           packed_seq_params: Any = None) -> torch.Tensor:
    """Eval-mode logits [B, S, V] without autograd."""
    model.eval()
    with torch.no_grad():
        pos = positions(tokens) if position_ids is None else position_ids
        return model(tokens, pos, None, packed_seq_params=packed_seq_params)
