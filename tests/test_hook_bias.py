"""`hooks.bias.per_head`: a per-head score hook proven for every head from one encoding with a symbolic head.

Each verdict is held to the head-by-head proof (the one-encoding path switched off); hooks whose
head-only values torch rounds, or that add a head-dependent term, must not be decided by it."""

from __future__ import annotations

import pytest
import torch

from primus_ext.hooks import score as hook_score
from primus_ext.hooks.proof import prove_score

from .helpers import proven_both_ways

SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])
SLOPES64 = SLOPES.double()
ZEROS = torch.zeros(4)

ACCEPTED = {
    "alibi": lambda s, b, h, q, kv: s + SLOPES[h] * (kv - q),
    "alibi_reversed": lambda s, b, h, q, kv: s - SLOPES[h] * (q - kv),
    "alibi_commuted": lambda s, b, h, q, kv: (kv - q) * SLOPES[h] + s,
    "alibi_float64_table": lambda s, b, h, q, kv: s + SLOPES64[h] * (kv - q),
    "alibi_shifted_head": lambda s, b, h, q, kv: s + SLOPES[3 - h] * (kv - q),
    "alibi_on_some_heads": lambda s, b, h, q, kv: torch.where(h < 2, s + SLOPES[h] * (kv - q), s),
    "zero_table": lambda s, b, h, q, kv: s + ZEROS[h] * (kv - q),
}
NOT_DECIDED = {
    "head_dependent_extra_term": lambda s, b, h, q, kv: s + SLOPES[h] * (kv - q) + (h == 2) * 1.0,
    "plus_head_index": lambda s, b, h, q, kv: s + SLOPES[h] * (kv - q) + h,
    "scaled_in_float32": lambda s, b, h, q, kv: s + SLOPES[h] * 2.0 * (kv - q),
    "symmetric": lambda s, b, h, q, kv: s - SLOPES[h] * (q - kv).abs(),
    "slope_from_exp2": lambda s, b, h, q, kv: s + torch.exp2(-(h + 1.0)) * (kv - q),
    "head_index_modulo": lambda s, b, h, q, kv: s + SLOPES[(h + 1) % 4] * (kv - q),  # proven, head by head
    "reads_the_batch": lambda s, b, h, q, kv: s + SLOPES[h] * (kv - q) + b * 0,
}


def _both(hook, monkeypatch):
    return proven_both_ways(prove_score, hook, monkeypatch, hook_score, "_all_heads")


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_one_encoding_decides_what_the_head_by_head_proof_does(name, monkeypatch):
    fast, slow, calls = _both(ACCEPTED[name], monkeypatch)
    assert calls and calls[0] is not None  # decided by the one encoding
    assert (fast.kind, fast.alibi_slopes, fast.reason) == (slow.kind, slow.alibi_slopes, slow.reason)
    assert fast.kind in ("alibi", "identity")


@pytest.mark.parametrize("name", sorted(NOT_DECIDED))
def test_what_one_encoding_cannot_decide_is_proven_head_by_head(name, monkeypatch):
    fast, slow, calls = _both(NOT_DECIDED[name], monkeypatch)
    assert all(c is None for c in calls)
    assert (fast.kind, fast.alibi_slopes) == (slow.kind, slow.alibi_slopes)
