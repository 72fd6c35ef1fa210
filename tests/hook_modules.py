"""Hooks and factories for the B32 tests, importable as ``tests.hook_modules:<name>``.

A real module (not one written under tmp_path) so that the ``@hook_factory`` mark is
set once, at import, exactly as in a user's package.
"""

import functools

import torch

from primus_ext import hook_factory
from primus_ext.attention import masks


CALLS: list = []  # every call of an unmarked object below: the tests assert it stays empty


def band(width):
    """A factory without the mark: a config may not call it."""
    CALLS.append(("band", width))

    def band_mask(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= width

    return band_mask


@hook_factory
def marked_band(width):
    def band_mask(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= width

    return band_mask


@hook_factory
def marked_softcap(cap):
    def softcap_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return softcap_mod


@hook_factory
def returns_a_partial(width):
    """Marked, but what it returns is not a plain function: the probe must not call it."""
    return functools.partial(_band, width=width)


def _band(b, h, q_idx, kv_idx, width):
    return (q_idx - kv_idx).abs() <= width


LIBRARY_CAUSAL = masks.causal()


@functools.wraps(LIBRARY_CAUSAL)  # copies __dict__, __name__, __module__ of the library mask
def wrapped_causal(b, h, q_idx, kv_idx):
    """Looks like the library's causal mask, but also lets row 0 see everything."""
    return LIBRARY_CAUSAL(b, h, q_idx, kv_idx) | (q_idx == 0)


class Recorder:
    """A callable instance: accepting it would call arbitrary ``__call__`` code."""

    def __call__(self, *args, **kwargs):
        CALLS.append(("Recorder", args, kwargs))
        return args[-1] <= args[-2]


recorder = Recorder()
recorder_partial = functools.partial(Recorder.__call__, recorder)


def two_arguments(q_idx, kv_idx):
    return kv_idx <= q_idx


def six_required(b, h, q_idx, kv_idx, doc_ids, offset):
    return kv_idx <= q_idx
