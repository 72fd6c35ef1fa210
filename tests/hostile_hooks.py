"""Hooks whose traced graph is not the function that runs, one per class of issue 26.

Each was, or could be, proven equal to a fixed kernel from its trace while a real call
computes something else.  `tests/test_hook_subset.py` holds each to the float64 oracle of
the hook as torch calls it, or to a build refusal that names the construct and its line.
"""

from __future__ import annotations

import functools
import os
import random
import time

import torch

W = 4
U8_TABLE = torch.tensor([250, 251, 252, 253], dtype=torch.uint8)
I16_TABLE = torch.tensor([30000, 30000, 30000, 30000], dtype=torch.int16)
I32_TABLE = torch.tensor([2, 2, 2, 2], dtype=torch.int32)


class Config:
    W = 4


CONFIG = Config()


# ------------------------------------------------------------- traced one way, called another
def type_check(b, h, q_idx, kv_idx):
    if isinstance(q_idx, torch.fx.Proxy):  # the tracer takes this branch, every real call the other
        return kv_idx <= q_idx
    return kv_idx <= q_idx + 2


def try_item(b, h, q_idx, kv_idx):
    try:
        return kv_idx <= q_idx + (1 if q_idx.item() > 1 else 0)  # fails on tracer objects and under vmap
    except Exception:
        return kv_idx <= q_idx


def compiling(b, h, q_idx, kv_idx):
    if torch.compiler.is_compiling() or torch.fx._symbolic_trace.is_fx_tracing():
        return kv_idx <= q_idx
    return kv_idx <= q_idx + 1


def dunder_class(b, h, q_idx, kv_idx):
    if q_idx.__class__ is torch.Tensor:
        return kv_idx <= q_idx + 1
    return kv_idx <= q_idx


# ------------------------------------------------------------- state read through plain code
def environment(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= int(os.environ.get("PRIMUS_EXT_TEST_WINDOW", "3")))


def clock(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= 3 + int(time.time() > 0))


def rng(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= random.randint(3, 3))


def stdlib(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= functools.reduce(lambda a, c: a + c, (1, 2)))


# ------------------------------------------------------------- values that escape per-call checks
def class_alias(b, h, q_idx, kv_idx):
    cfg = Config
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= cfg.W)


def object_attribute(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= CONFIG.W)


def nested(b, h, q_idx, kv_idx):
    within = lambda d: d <= Config.W  # noqa: E731
    return (kv_idx <= q_idx) & within(q_idx - kv_idx)


def default_width(b, h, q_idx, kv_idx, width=W):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= width)


# ------------------------------------------------------------- integer widths
def uint8_wrap(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= U8_TABLE[h] + 10)  # 250 + 10 wraps to 4 in uint8


def int16_wrap(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= I16_TABLE[h] * 2)  # 60000 wraps negative in int16


def int32_window(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= I32_TABLE[h] * 2)  # fits: 4, proven


def cast_index(b, h, q_idx, kv_idx):
    return (kv_idx.to(torch.int32) <= q_idx.to(torch.int32))  # wraps past 2**31


# ------------------------------------------------------------- casts in score hooks
def bf16_score(score, b, h, q_idx, kv_idx):
    return score.to(torch.bfloat16)


def fp16_score(score, b, h, q_idx, kv_idx):
    return score.half().float()


def fp64_score(score, b, h, q_idx, kv_idx):
    return score.double()  # value preserving: the identity


MASKS = ["type_check", "try_item", "compiling", "dunder_class", "environment", "clock", "rng", "stdlib",
         "class_alias", "object_attribute", "nested", "default_width", "uint8_wrap", "int16_wrap", "int32_window",
         "cast_index"]
SCORES = ["bf16_score", "fp16_score", "fp64_score"]
