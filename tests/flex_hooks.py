"""Hooks of the flex backend's tests: admitted ones (no fixed kernel computes them) and a dynamic one."""

import torch

PREFIX = 8
WINDOW = 12
DOC_IDS = torch.tensor([0] * 10 + [1] * 14 + [2] * 24)
"""Document ids of 48 positions, read by `document_ids`; the tests update it in place between calls."""


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) | (kv_idx < PREFIX)


def per_head(b, h, q_idx, kv_idx):
    """Even heads causal, odd heads a prefix-LM: a mask that reads the head index."""
    return (kv_idx <= q_idx) | ((h % 2 == 1) & (kv_idx < PREFIX))


def dilated_window(b, h, q_idx, kv_idx):
    d = q_idx - kv_idx
    return (d >= 0) & (d <= WINDOW) & (d % 2 == 0)


def document_ids(b, h, q_idx, kv_idx):
    return (DOC_IDS[q_idx] == DOC_IDS[kv_idx]) & (kv_idx <= q_idx)


RELATIVE = torch.linspace(-1.0, 1.0, 16).requires_grad_(True)
"""A learned relative-position bias table (requires grad), read by `relative_bias`."""


def relative_bias(score, b, h, q_idx, kv_idx):
    return score + RELATIVE[(q_idx - kv_idx).clamp(0, 15)]


HEAD_BIAS = torch.tensor([0.0, 0.5, -0.5, 1.0])
"""A per-head bias for 4 heads, read by `head_bias` (a layer of more heads is refused at build, hook-range)."""


def head_bias(score, b, h, q_idx, kv_idx):
    return score + HEAD_BIAS[h]


def softcap(score, b, h, q_idx, kv_idx):
    return 5.0 * torch.tanh(score / 5.0)


def typed_causal(b, h, q_idx, kv_idx):
    if isinstance(q_idx, torch.Tensor):  # outside the provable subset: dynamic
        return kv_idx <= q_idx
    return kv_idx <= q_idx
