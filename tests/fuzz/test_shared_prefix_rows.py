"""Differential fuzzing of shared-prefix rows (B37): drawn rows against the float64 tree-mask oracle.

Documents and trees of 0..4 responses, lengths 0..9 (empty prompts, responses and rows included), GQA, a sink,
on `reference` (float64, forward and backward), on the fake's kernels at gfx942 and gfx950 (bf16, forward and
backward; their varlen kernels take no sink, B33) and on `flex` (torch's FlexAttention on the tree mask, float64,
forward: its CPU kernel has no backward).  One case in 25 of the profile's ``max_examples`` (``ci``: 60, ``long``:
400), each a whole row through `shared_prefix_attention`.
"""

from __future__ import annotations

import contextlib

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from primus_ext.backends.shared_prefix import SharedPrefixLayout
from primus_ext.call.shared_prefix import shared_prefix_attention
from primus_ext.testing import fake_primus_turbo

from ..test_shared_prefix import _adapter, _inputs, assert_oracle, grad_out_for, tree_mask
from . import oracle
from .test_differential import fuzz_settings

_LENGTH = st.integers(0, 9)
_GROUP = st.one_of(_LENGTH, st.tuples(_LENGTH, st.lists(_LENGTH, max_size=4)))
_ADAPTERS: dict = {}
_PATHS = ["reference", "gfx942", "gfx950", "flex"]


def _adapter_for(path: str, sink: bool, heads: tuple) -> object:
    key = (path, sink, heads)
    if key not in _ADAPTERS:  # a plan per setting, as a model builds one per layer
        if path.startswith("gfx"):
            _ADAPTERS[key] = _adapter("turbo", path, sink=sink, heads=heads, dtype="bf16")
        else:
            _ADAPTERS[key] = _adapter(path, sink=sink, heads=heads)
    return _ADAPTERS[key]


_FUZZ = fuzz_settings()


@settings(_FUZZ, max_examples=_FUZZ.max_examples // 25)
@given(items=st.lists(_GROUP, min_size=1, max_size=3), path=st.sampled_from(_PATHS), sink=st.booleans(),
       heads=st.sampled_from([(4, 4), (4, 2), (4, 1)]))
def test_drawn_rows_equal_the_tree_mask_oracle(items, path, sink, heads):
    fixed = path.startswith("gfx")
    sink = sink and not fixed
    dtype = torch.bfloat16 if fixed else torch.float64
    backward = path != "flex"
    with fake_primus_turbo(arch=path) if fixed else contextlib.nullcontext(), torch.set_grad_enabled(backward):
        adapter = _adapter_for(path, sink, heads)
        layout = SharedPrefixLayout.of(items)
        leaves = [t.detach().to(dtype if i < 3 else torch.float32).requires_grad_(backward)
                  for i, t in enumerate(_inputs(layout.total, *heads, 16, torch.float32, sink))]
        out = shared_prefix_attention(adapter, *leaves[:3], layout, sink=leaves[3] if sink else None)
        assert out.shape == (layout.total, heads[0], 16) and out.dtype == dtype
        if not backward:
            if layout.total:
                want, _ = oracle.packed_attention(*(t.double() for t in leaves[:3]), tree_mask(items),
                                                  sink=leaves[3] if sink else None)
                assert oracle.mismatch(out, want, oracle.OUTPUT_TOL[dtype]) is None
            return
        grad = grad_out_for(out)
        got = torch.autograd.grad(out, leaves, grad, allow_unused=True, materialize_grads=True)
    if layout.total:
        assert_oracle(items, leaves, out, grad, got)
