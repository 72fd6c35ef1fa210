"""The hooks docs/mask_hooks.md shows, as a user would put them in a module (the dynamic ones completed so
that they run): the examples of the provable subset, of what lies outside it, the ALiBi table and the
factory.  `tests/compile/test_hooks_compiled.py` runs every one of them compiled."""

from __future__ import annotations

import os

import torch
from torch.nn.attention.flex_attention import and_masks

from primus_ext import hook_factory

WINDOW = 128


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def window(b, h, q_idx, kv_idx):  # in the subset: proven window(128, 0)
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= WINDOW)


sliding = and_masks(window, causal_mask)  # in the subset: its parts are


class Config:
    W = 4


def typed(b, h, q_idx, kv_idx):
    if isinstance(q_idx, torch.Tensor):  # a call of isinstance
        return kv_idx <= q_idx
    return kv_idx <= q_idx


def guarded(b, h, q_idx, kv_idx):
    try:  # a try block
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= 4)
    except RuntimeError:
        return kv_idx <= q_idx


def env(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= int(os.environ.get("PRIMUS_EXT_DOC_W", "4")))  # os.environ


def aliased(b, h, q_idx, kv_idx):
    cfg = Config
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= cfg.W)  # the class Config


def nested(b, h, q_idx, kv_idx):
    ok = lambda d: d >= 0  # noqa: E731 - a nested function or lambda, as the docs show it
    return ok(q_idx - kv_idx)


SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])  # one per head of the model


def alibi(score, b, h, q_idx, kv_idx):  # at TP=2, rank 1 reads SLOPES[2], SLOPES[3]
    return score + SLOPES[h] * (kv_idx - q_idx)


@hook_factory
def banded(width: int):
    def band_mask(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= width
    return band_mask
