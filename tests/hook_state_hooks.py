"""Hooks whose captured state a data loader changes between steps (`tests/test_hook_state_backward.py`)."""

import torch

DOC = torch.tensor([0] * 8 + [1] * 8)
"""Document ids of 16 positions, written in place for each micro-batch."""
WIDTH = 3
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])


def documents(b, h, q_idx, kv_idx):
    return (DOC[q_idx] == DOC[kv_idx]) & (kv_idx <= q_idx)


def banded(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= WIDTH)


def learned_free_alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)
