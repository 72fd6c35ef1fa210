"""Score hooks as a user would write them, importable as ``tests.hook_examples:<name>``."""

import torch

SLOPES = (0.5, 0.25, 0.125, 0.0625)


def alibi(score, b, h, q_idx, kv_idx):
    return score + torch.tensor(SLOPES, dtype=score.dtype)[h] * (kv_idx - q_idx)


def symmetric_alibi(score, b, h, q_idx, kv_idx):
    """ALiBi as bidirectional encoders write it: the distance either way costs."""
    return score - torch.tensor(SLOPES, dtype=score.dtype)[h] * (q_idx - kv_idx).abs()


def softcap(score, b, h, q_idx, kv_idx):
    return 30.0 * torch.tanh(score / 30.0)
