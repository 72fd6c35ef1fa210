"""Hooks from the hostile review of the subset checker: each was proven while torch computes
another attention, or kept its proof after a change no per-call check saw.  Most differ
from their proven pattern only at (q_idx, kv_idx) = (37, 5), a point the cross-check does
not sample, so only the checker, the encoding or the assumptions can catch them."""

from __future__ import annotations

import types

import torch
from torch.nn.attention.flex_attention import and_masks

from . import proof_hooks

ON = 1
F32 = torch.zeros((), dtype=torch.float32)
BOUNDS = torch.tensor([36.99999999, 37.0], dtype=torch.float64)
U8 = torch.tensor([250, 250, 250, 250], dtype=torch.uint8)
TEN = torch.tensor(10)


def _at(q_idx, kv_idx):
    return (q_idx == 37) & (kv_idx == 5)


# ------------------------------------------------------------------ build time
def to_tensor_dtype(b, h, q_idx, kv_idx):
    d = (q_idx - 37).abs() + (kv_idx - 5).abs()
    y = 2 ** 24 + 1 - torch.clamp(d, max=1)
    return (kv_idx <= q_idx) & (y.to(F32).long() == y)  # float32 rounds 2**24 + 1


def score_to_score_dtype(score, b, h, q_idx, kv_idx):
    d = (q_idx - 37).abs() + (kv_idx - 5).abs()
    y = 2 ** 24 + 1 - torch.clamp(d, max=1)
    return score + (y.to(score.dtype).long() - y) * 100.0


def float_bucketize(score, b, h, q_idx, kv_idx):
    d = q_idx - kv_idx
    return score + (torch.bucketize(d, BOUNDS) - 2 * (d >= 38)) * 100.0


def conditional_callee(b, h, q_idx, kv_idx):
    f = isinstance if ON else abs
    if f(q_idx, torch.fx.Proxy):
        return kv_idx <= q_idx
    return (kv_idx <= q_idx) & ~_at(q_idx, kv_idx)


def branch_local(b, h, q_idx, kv_idx):
    f = abs
    if ON:
        f = isinstance
    if f(q_idx, torch.fx.Proxy):
        return kv_idx <= q_idx
    return (kv_idx <= q_idx) & ~_at(q_idx, kv_idx)


def _tracing(x):
    return -x if torch.fx._symbolic_trace.is_fx_tracing() else x


def key_argument(b, h, q_idx, kv_idx):
    real = max(0, 1, key=_tracing) == 1
    return (kv_idx <= q_idx) & ~(_at(q_idx, kv_idx) & real)


class Sneaky(int):
    def __ge__(self, other):
        if isinstance(other, torch.fx.Proxy):
            return NotImplemented
        return (other <= int(self)) | (other == 37)


S4 = Sneaky(4)


def int_subclass(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (S4 >= q_idx - kv_idx)


class Evil(torch.Tensor):
    def __ge__(self, other):
        return torch.Tensor.__ge__(self.as_subclass(torch.Tensor), other) | (other == 37)


LIMIT = torch.tensor(4).as_subclass(Evil)


def tensor_subclass(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= LIMIT)


def huge_int_score(score, b, h, q_idx, kv_idx):
    big = score * 2 ** 62 * 2 ** 62 * 2 ** 62  # inf in float32
    return score + torch.where(_at(q_idx, kv_idx), big - big, 0.0)


def module_in_local(b, h, q_idx, kv_idx):
    c = proof_hooks
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= c.WINDOW)


class Globals(dict):
    def __getitem__(self, name):
        return dict.__getitem__(self, name)


def _plain_window(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= W)


W = 4
dict_subclass_globals = types.FunctionType(_plain_window.__code__, Globals(W=4, torch=torch,
                                                                           __builtins__=__builtins__), "g")


def promotion(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= U8[h] + TEN)  # torch: 0-d, int64 260; grids: uint8 4


# ------------------------------------------------------------------ later calls
def builtin_abs(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (abs(q_idx - kv_idx) <= 4)


def plain(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= 4)


def _other(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx + 100


def _causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def _near(b, h, q_idx, kv_idx):
    return q_idx - kv_idx <= 4


combined = and_masks(_causal, _near)


def make_window():
    def window(b, h, q_idx, kv_idx, w=4):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= w)
    return window


first_window, second_window = make_window(), make_window()


# ------------------------------------------------------------------ the second pass
def _evil(q, kv):
    if isinstance(q, torch.fx.Proxy):
        return kv <= q
    return (kv <= q) & ~((q == 37) & (kv == 5))


def _good(q, kv):
    return kv <= q


def _helper(q, kv, *, f=_good):
    return f(q, kv)


def keyword_override(b, h, q_idx, kv_idx):
    return _helper(q_idx, kv_idx, f=(_evil,)[0])  # the helper's default is not what runs


def module_argument(b, h, q_idx, kv_idx):
    return _helper(q_idx, kv_idx, f=proof_hooks)


def module_cell():
    m = proof_hooks

    def mask(b, h, q_idx, kv_idx):
        return m.causal(b, h, q_idx, kv_idx)
    return mask


def add_overflow(b, h, q_idx, kv_idx):
    x = q_idx.add(2 ** 63 - 37)  # wraps to -2**63 at q_idx = 37
    return (kv_idx <= q_idx) & ~(x < -2 ** 63 + 1)
