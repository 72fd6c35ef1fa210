"""`hooks.structure.decide`: documents and chunks decided cell by cell, without the solver.

Each verdict is held to the solver's own (the structural path switched off) and to the hook
evaluated on a grid across its boundaries; near misses must not be decided structurally, so the
solver gives its verdict on them."""

from __future__ import annotations

import pytest
import torch
import z3

from primus_ext.attention.pattern import Pattern
from primus_ext.hooks import proof as hook_proof
from primus_ext.hooks.encoder import Encoder
from primus_ext.hooks.ops import boolean
from primus_ext.hooks.proof import prove_mask
from primus_ext.hooks.structure import decide
from primus_ext.hooks.trace import trace_hook

from .helpers import proven_both_ways

BOUNDS = torch.tensor([512, 2560])
SMALL_BOUNDS = torch.tensor([3, 7, 20])

ACCEPTED = {
    "chunks": (lambda b, h, q, kv: (q // 64 == kv // 64) & (kv <= q), Pattern(-1, 0, chunk=64)),
    "chunks_bidirectional": (lambda b, h, q, kv: q // 64 == kv // 64, Pattern(-1, -1, chunk=64)),
    "chunks_windowed": (lambda b, h, q, kv: (q // 64 == kv // 64) & (kv <= q) & (q - kv <= 10),
                        Pattern(10, 0, chunk=64)),
    "chunks_wide_window": (lambda b, h, q, kv: (q // 64 == kv // 64) & (kv <= q) & (q - kv <= 100),
                           Pattern(-1, 0, chunk=64)),
    "chunks_of_one": (lambda b, h, q, kv: q // 1 == kv // 1, Pattern(0, 0)),
    "chunks_of_two": (lambda b, h, q, kv: (q // 2 == kv // 2) & (kv <= q), Pattern(-1, 0, chunk=2)),
    "documents": (lambda b, h, q, kv: ((q < 512) == (kv < 512)) & ((q < 2560) == (kv < 2560)) & (kv <= q),
                  Pattern(-1, 0, cuts=(512, 2560))),
    "documents_bucketize": (lambda b, h, q, kv: (torch.bucketize(q, BOUNDS, right=True)
                                                 == torch.bucketize(kv, BOUNDS, right=True)) & (kv <= q),
                            Pattern(-1, 0, cuts=(512, 2560))),
    "documents_bucketize_left": (lambda b, h, q, kv: (torch.bucketize(q, SMALL_BOUNDS)
                                                      == torch.bucketize(kv, SMALL_BOUNDS)) & (kv <= q),
                                 Pattern(-1, 0, cuts=(4, 8, 21))),
    "documents_windowed": (lambda b, h, q, kv: ((q < 100) == (kv < 100)) & (kv <= q) & (q - kv <= 30),
                           Pattern(30, 0, cuts=(100,))),
    "documents_bidirectional": (lambda b, h, q, kv: (q < 100) == (kv < 100), Pattern(-1, -1, cuts=(100,))),
    "documents_xor": (lambda b, h, q, kv: ((q < 512) ^ (kv >= 512)) & (kv <= q), Pattern(-1, 0, cuts=(512,))),
    "documents_band": (lambda b, h, q, kv: ((q < 100) == (kv < 100)) & ((q - kv).abs() <= 3),
                       Pattern(3, 3, cuts=(100,))),
    "band": (lambda b, h, q, kv: (q - kv).abs() <= 256, Pattern(256, 256)),
    "causal_with_a_position_atom": (lambda b, h, q, kv: (q >= 0) & (kv <= q), Pattern(-1, 0)),
}
NEAR_MISSES = {
    "chunk_off_by_one": lambda b, h, q, kv: (q // 64 == (kv + 1) // 64) & (kv <= q),
    "chunk_previous_too": lambda b, h, q, kv: (q // 64 - kv // 64 <= 1) & (kv <= q),
    "chunk_or_distance": lambda b, h, q, kv: ((q // 64 == kv // 64) & (kv <= q)) | (q - kv == 90),
    "chunk_or_prefix": lambda b, h, q, kv: ((q // 64 == kv // 64) & (kv <= q)) | (q < 3),
    "chunk_strictly_causal": lambda b, h, q, kv: (q // 64 == kv // 64) & (kv < q),
    "documents_strictly_causal": lambda b, h, q, kv: ((q < 512) == (kv < 512)) & (kv < q),
    "documents_or_prefix": lambda b, h, q, kv: (((q < 512) == (kv < 512)) & (kv <= q)) | (kv < 16),
    "documents_where": lambda b, h, q, kv: torch.where(q < 512, kv < 512, (kv >= 512) & (kv <= q)),
    "documents_sum": lambda b, h, q, kv: ((q + kv < 512) == (kv < 512)) & (kv <= q),
    "documents_mod": lambda b, h, q, kv: ((q % 64 == 0) == (kv % 64 == 0)) & (kv <= q),
}


def _formula(hook) -> tuple[z3.BoolRef, z3.ArithRef, z3.ArithRef]:
    trace = trace_hook(hook, "mask_mod")
    q, kv = z3.Ints("q_idx kv_idx")
    mask = boolean(Encoder(trace.graph, trace.tensor_names).run({"b": z3.IntVal(0), "h": z3.IntVal(0),
                                                                   "q_idx": q, "kv_idx": kv}))
    return mask, q, kv


def _proofs(hook, monkeypatch):
    fast, slow, _ = proven_both_ways(prove_mask, hook, monkeypatch, hook_proof, "decide")
    return fast, slow


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_the_structural_verdict_is_the_solvers_and_the_hooks(name, monkeypatch):
    hook, expected = ACCEPTED[name]
    assert decide(*_formula(hook)) == expected
    fast, slow = _proofs(hook, monkeypatch)
    assert fast.pattern == slow.pattern == expected
    assert fast.reason == slow.reason
    i = torch.cat([torch.arange(140), torch.arange(500, 530), torch.arange(2550, 2570)])
    q, kv = i.view(-1, 1), i.view(1, -1)
    assert torch.equal(torch.as_tensor(hook(0, 0, q, kv)).expand(q.shape[0], kv.shape[1]), expected.allows(q, kv))


@pytest.mark.parametrize("name", sorted(NEAR_MISSES))
def test_a_near_miss_is_left_to_the_solver(name, monkeypatch):
    hook = NEAR_MISSES[name]
    assert decide(*_formula(hook)) is None
    fast, slow = _proofs(hook, monkeypatch)
    assert fast.pattern == slow.pattern is None


def test_what_the_cells_cannot_separate_is_outside():
    q, kv = z3.Ints("q kv")
    assert decide(z3.And(q / 4 == kv / 4, q >= 8), q, kv) is None  # a chunk beside a position cut
    assert decide(z3.And(q / 4 == kv / 4, q / 8 == kv / 8), q, kv) is None  # two chunk sizes
    assert decide(z3.And((q >= 2 ** 39) == (kv >= 2 ** 39), kv <= q), q, kv) is None  # near the domain's edge
    assert decide(z3.And(q * kv >= 0, kv <= q), q, kv) is None  # a product of indices
    assert decide(z3.And((q >= 5) == (kv >= 5), kv <= q), q, kv) == Pattern(-1, 0, cuts=(5,))


def test_more_documents_than_the_solver_looks_for_are_left_to_it():
    q, kv = z3.Ints("q kv")
    many = z3.And(*[(q >= c) == (kv >= c) for c in range(10, 10 + 3 * 70, 3)], kv <= q)
    assert decide(many, q, kv) is None
