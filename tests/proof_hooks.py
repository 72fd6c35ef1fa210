"""Hooks a user writes, for the proof tests: some provably a kernel pattern, some not.

Named by the tests as ``"tests.proof_hooks:<name>"``.
"""

from __future__ import annotations

import functools

import math

import torch

from primus_ext.attention import masks

# ---------------------------------------------------------------- ordinary: run on Turbo
def causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def full(b, h, q_idx, kv_idx):
    return (q_idx >= 0) | (kv_idx >= 0)


def gym_window(b, h, q_idx, kv_idx):
    # attention-gym: q_idx - kv_idx <= SLIDING_WINDOW, causal
    return (q_idx - kv_idx <= 8) & (q_idx >= kv_idx)


def titan_window(b, h, q_idx, kv_idx):
    # torchtitan counts the query itself in the window: `<`, so window (7, 0) here
    return (kv_idx <= q_idx) & (q_idx - kv_idx < 8)


def band(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() <= 3


def chunked(b, h, q_idx, kv_idx):
    return (q_idx // 4 == kv_idx // 4) & (kv_idx <= q_idx)


def constant_documents(b, h, q_idx, kv_idx):
    return ((q_idx < 6) == (kv_idx < 6)) & (kv_idx <= q_idx)


def head_independent(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (h >= 0) & (b >= 0)


ALIBI_SLOPES = [0.5, 0.25, 0.125, 0.0625]
SLOPE_TENSOR = torch.tensor(ALIBI_SLOPES)


def alibi_list(score, b, h, q_idx, kv_idx):
    return score + torch.tensor(ALIBI_SLOPES)[h] * (kv_idx - q_idx)


def alibi_tensor(score, b, h, q_idx, kv_idx):
    return score + SLOPE_TENSOR[h] * (kv_idx - q_idx)


WINDOW = 8


def global_window(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= WINDOW)


# ---------------------------------------------------------------- not a kernel pattern
DOC_IDS = torch.tensor([0] * 6 + [1] * 10)  # a data loader rewrites it in place each step


def doc_ids(b, h, q_idx, kv_idx):
    return (DOC_IDS[q_idx] == DOC_IDS[kv_idx]) & (kv_idx <= q_idx)


def head_three(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) | (h == 3)


def batch_two(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) | (b == 2)


def batch_one(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) | (b == 1)


_library_window = masks.sliding_window(4)


@functools.wraps(_library_window)
def wrapped_window(b, h, q_idx, kv_idx):
    return _library_window(b, h, q_idx, kv_idx) | (kv_idx == 0)  # a global first token


def far_row(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) | ((q_idx == 70_001) & (kv_idx == 70_002))


def near_row(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) | ((q_idx == 9) & (kv_idx == 12))


def distance_penalty(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx - kv_idx > 16, score - 4.0, score)


def clipped_alibi(score, b, h, q_idx, kv_idx):
    return score + torch.clamp(SLOPE_TENSOR[h] * (kv_idx - q_idx), min=-2.0)


def hard_clamp(score, b, h, q_idx, kv_idx):
    return torch.clamp(score, -100.0, 100.0)


def branchy(b, h, q_idx, kv_idx):
    if q_idx.sum() > 3:  # Python control flow on index values
        return kv_idx <= q_idx
    return kv_idx >= 0


# ---------------------------------------------------------------- torch semantics a proof must respect
def uint8_window(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).to(torch.uint8) <= 3  # wraps below 0


def bool_sum(b, h, q_idx, kv_idx):
    return ((kv_idx <= q_idx) + (q_idx - kv_idx <= 3)) > 1  # bool + bool is a bool: never > 1


def half_causal(b, h, q_idx, kv_idx):
    return kv_idx.half() <= q_idx.half()  # rounds indices above 2048


class Config:
    W = 3


def class_window(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= Config.W)


def float_window(b, h, q_idx, kv_idx):
    d = q_idx - kv_idx
    return (d >= 0) & (d * 0.3 <= 0.9)  # float32: 3 * 0.3 > 0.9, so window 2, not 3


def requires_grad_full(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) | torch.full_like(q_idx, q_idx.requires_grad, dtype=torch.bool)


def infinite_fill(score, b, h, q_idx, kv_idx):
    return torch.where(kv_idx > q_idx + 1000, torch.full_like(score, -float("inf")), score)


def _window_from(cfg):
    def captured_class_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= cfg.W)
    return captured_class_window


class CapturedConfig:
    W = 3


captured_class_window = _window_from(CapturedConfig)

WIDTH = torch.tensor([3])


def tensor_width(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= WIDTH[0])


def signed_zero(c):
    def mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (q_idx >= 0) if math.copysign(1.0, c) > 0 else kv_idx <= q_idx
    return mask


def head_four_and_up(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) | (h >= 4)
