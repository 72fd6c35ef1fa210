"""Score hooks that read a learned table, importable as ``tests.megatron.learned_hooks:<name>``.

The tables are module globals, as a user's hook file would hold them, so every layer whose hook is
resolved from here shares one table.  ``HEADS`` is the model's head count in the tests that use them.
"""

import torch

HEADS = 8
HEAD_BIAS = torch.nn.Parameter(torch.linspace(-0.5, 0.5, HEADS))
HEAD_BIAS_64 = torch.nn.Parameter(torch.linspace(-0.5, 0.5, HEADS, dtype=torch.float64))
PLAIN_BIAS = torch.linspace(-0.5, 0.5, HEADS).requires_grad_(True)  # requires grad, but no Parameter


def head_bias(score, b, h, q_idx, kv_idx):
    return score + HEAD_BIAS[h]


def head_bias_64(score, b, h, q_idx, kv_idx):
    return score + HEAD_BIAS_64[h]


def plain_head_bias(score, b, h, q_idx, kv_idx):
    return score + PLAIN_BIAS[h]


def window(b, h, q_idx, kv_idx):
    """A sliding window (4, 0), inside the provable subset."""
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 4)
