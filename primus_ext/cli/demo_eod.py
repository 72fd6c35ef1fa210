"""The demo's ``eod_documents`` mode: EOD-separated documents in [B, S] rows (``reset_attention_mask``).

The flex run trains on each micro-batch converted by `primus_ext.megatron.pack_eod_micro_batch`
(packed THD on the varlen kernel).  Its partner computes what Megatron computes without
Turbo: the same rows with megatron-core's own dense ``reset_attention_mask`` mask and
positions (``gpt_dataset._get_ltor_masks_and_position_ids``), through `DenseMaskAttention`,
a plain float softmax with the mask applied.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..megatron import pack_eod_micro_batch
from . import demo_model as dm


class DenseMaskAttention(torch.nn.Module):
    """Core attention that applies Megatron's dense ``attention_mask`` (True = masked), exactly."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: Any,
                 attention_dropout: Any = None, softmax_scale: Any = None, cp_comm_type: Any = None,
                 pg_collection: Any = None) -> None:
        super().__init__()

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # sbhd -> [B, H, S, D]
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        probs = torch.softmax(scores.masked_fill(attention_mask, float("-inf")), dim=-1)
        out = probs @ v
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)


def eod_batches(opts: dm.DemoOptions, steps: int, seq_length: int) -> tuple[list[dm.Batch], list[dm.Batch]]:
    """``(converted, dense)``: the same EOD rows as packed THD and with Megatron's dense mask."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    eod = opts.vocab_size  # one token past the counting vocabulary (the model gets vocab_size + 1)
    gen = torch.Generator().manual_seed(opts.seed)
    converted, dense = [], []
    for _ in range(steps):
        rows = dm.dense_batch(gen, opts, seq_length)
        tokens = _with_eods(rows.tokens, gen, opts, eod)
        labels = torch.roll(tokens, -1, dims=1)
        masks, positions = [], []
        for row in tokens:
            mask, _, pos = _get_ltor_masks_and_position_ids(row, eod, True, True, False, True)
            masks.append(mask)
            positions.append(pos)
        dense.append(dm.Batch(tokens, labels, torch.stack(positions), None, 0, torch.stack(masks)))
        packed = pack_eod_micro_batch(tokens, eod_token=eod, max_documents=tokens.numel() // 2, labels=labels)
        cu = packed.packed_seq_params.cu_seqlens_q
        converted.append(dm.Batch(packed.tokens, packed.labels, packed.position_ids, cu,
                                  int((tokens == eod).sum()) + tokens.shape[0]))
    return converted, dense


def _with_eods(tokens: torch.Tensor, gen: torch.Generator, opts: dm.DemoOptions, eod: int) -> torch.Tensor:
    """The rows with an EOD every ``min_doc_len .. max_doc_len`` tokens (documents cross nothing: each
    row is a sample, as in Megatron's GPT dataset)."""
    out = tokens.clone()
    for row in out:
        at = int(torch.randint(opts.min_doc_len, opts.max_doc_len + 1, (1,), generator=gen))
        while at < row.numel():
            row[at] = eod
            at += int(torch.randint(opts.min_doc_len, opts.max_doc_len + 1, (1,), generator=gen))
    return out


__all__ = ["DenseMaskAttention", "eod_batches"]
