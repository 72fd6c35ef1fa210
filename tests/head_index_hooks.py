"""Hooks that read per-head tables by the model's head index (tests of the global head index).

Four heads; a tensor-parallel rank of TP=2 holds heads 0-1 or 2-3.  `head_windows` gives
each pair of heads its own causal window, so each TP=2 rank runs one window (proven on
``turbo``), while at TP=1 the layer's heads differ (``reference`` only).  `head_alibi` reads
the slope of each head from a global table; `mixed_windows` differs within every rank.
"""

from __future__ import annotations

import torch

HEAD_WINDOWS = torch.tensor([1, 1, 3, 3])
"""Causal window of each of the model's four heads: heads 0-1 see 1 key back, heads 2-3 three."""
MIXED_WINDOWS = torch.tensor([0, 2, 5, 1])
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])
"""ALiBi slope of each of the model's four heads."""


def head_windows(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= HEAD_WINDOWS[h])


def mixed_windows(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= MIXED_WINDOWS[h])


def head_alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)
