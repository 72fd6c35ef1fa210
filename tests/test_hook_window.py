"""`hook_window.difference_window`: masks of q_idx - kv_idx alone, decided without the solver.

Each verdict is held to the solver's own (the fast path switched off) and to the hook
evaluated on a 48 x 48 grid."""

from __future__ import annotations

import pytest
import torch
import z3

from primus_ext.hooks import proof as hook_proof
from primus_ext.hooks.proof import prove_mask
from primus_ext.hooks.window import difference_window
from primus_ext.attention.pattern import Pattern

HOOKS = {
    "causal": lambda b, h, q, kv: q >= kv,
    "window": lambda b, h, q, kv: (kv <= q) & (q - kv <= 5),
    "strict_lt_window": lambda b, h, q, kv: (kv <= q) & (q - kv < 5),
    "band": lambda b, h, q, kv: (q - kv).abs() <= 3,
    "two_sided": lambda b, h, q, kv: (q - kv <= 4) & (kv - q <= 2),
    "full": lambda b, h, q, kv: (q - kv) > -(2 ** 41),
    "strictly_causal": lambda b, h, q, kv: q > kv,
    "two_pieces": lambda b, h, q, kv: (q == kv) | ((q - kv >= 3) & (q - kv <= 5)),
    "not_window": lambda b, h, q, kv: ~((q - kv > 2) & (q - kv < 9)),
    "where": lambda b, h, q, kv: torch.where(q - kv >= 0, q - kv <= 7, kv - q <= 1),
}


def _fresh(monkeypatch, fast: bool):
    hook_proof._BY_OBJECT.clear()
    hook_proof._BY_FINGERPRINT.clear()
    if not fast:
        monkeypatch.setattr(hook_proof, "difference_window", lambda *a: None)


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_the_fast_verdict_is_the_solvers_and_the_hooks(name, monkeypatch):
    hook = HOOKS[name]
    _fresh(monkeypatch, fast=True)
    fast = prove_mask(hook, num_heads=2).pattern
    _fresh(monkeypatch, fast=False)
    slow = prove_mask(hook, num_heads=2).pattern
    assert fast == slow
    if fast is not None:
        i = torch.arange(48)
        assert torch.equal(hook(0, 0, i.view(-1, 1), i.view(1, -1)), fast.allows(i.view(-1, 1), i.view(1, -1)))


def test_what_is_not_a_function_of_the_distance_is_left_to_the_solver():
    q, kv = z3.Ints("q kv")
    assert difference_window(q / 4 == kv / 4, q, kv) is None
    assert difference_window(z3.And(q >= kv, q <= 100), q, kv) is None
    assert difference_window(q - kv <= 2 ** 39, q, kv) is None  # a reach the solver path calls unbounded
    assert difference_window(z3.And(q - kv <= 3, kv - q <= 1), q, kv) == Pattern(3, 1)
