"""The reference backend's blockwise math against the independent float64 oracle.

Tiles are shrunk (4 query rows, 3 to 5 keys per tile) so that small shapes cross many
tile boundaries: the online softmax's rescaling, skipped tiles, tiles cut by a window
or a document and empty rows all occur.  Outputs are held to ``tests/oracle.py``
(cell by cell, written from the definitions); the hand-written backward to finite
differences (``gradcheck``), which shares nothing with either.
"""

from __future__ import annotations

import pytest
import torch

from primus_ext.attention.pattern import Pattern
from primus_ext.backends import blockwise

from . import oracle
from .helpers import qkv


@pytest.fixture(autouse=True)
def tiny_tiles(monkeypatch):
    monkeypatch.setattr(blockwise, "BLOCK_Q", 4)
    monkeypatch.setattr(blockwise, "_MIN_KV", 3)
    monkeypatch.setattr(blockwise, "_MAX_KV", 5)
    monkeypatch.setattr(blockwise, "TILE_ELEMENTS", 1)


def strided(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & ((q_idx - kv_idx) % 3 != 1) & (h != 1)


SINK = [0.3, -1.0, 2.0, 0.0]
ALIBI = [0.5, 0.25, 0.125, 0.0625]
DENSE = [
    ("causal", Pattern(-1, 0), None, oracle.causal()),
    ("window", Pattern(3, 0), None, oracle.window(3, 0)),
    ("two-sided", Pattern(2, 3), None, oracle.window(2, 3)),
    ("full", Pattern(-1, -1), None, None),
    ("documents", Pattern(-1, 0, boundaries=(0, 5, 6, 13, 15)), None, oracle.documents((0, 5, 6, 13, 15))),
    ("chunks-window", Pattern(1, 0, chunk=6), None, oracle.hook(Pattern(1, 0, chunk=6).mask_mod())),
    ("hook", None, strided, oracle.hook(strided)),
]


@pytest.mark.parametrize("name,pattern,hook,allowed", DENSE, ids=[d[0] for d in DENSE])
@pytest.mark.parametrize("extras", ["plain", "sink", "alibi+sink"])
def test_dense_forward_equals_the_oracle(name, pattern, hook, allowed, extras):
    q, k, v = qkv(b=2, s=15, hq=4, hkv=2, d=4)
    sink = torch.tensor(SINK, dtype=torch.float64) if "sink" in extras else None
    slopes = torch.tensor(ALIBI, dtype=torch.float64) if "alibi" in extras else None
    out, lse = blockwise.forward(q, k, v, blockwise.dense_layout(pattern, hook, 15, 15), scale=0.7, sink=sink,
                                 alibi_slopes=slopes)
    expected = oracle.attention(q, k, v, allowed, scale=0.7, sink=SINK if sink is not None else None,
                                alibi=ALIBI if slopes is not None else None)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    assert lse.dtype == torch.float64 and lse.shape == (2, 4, 15)


def test_rows_with_nothing_allowed_give_zeros_and_minus_infinity():
    q, k, v = qkv(b=1, s=9, hq=4, hkv=2, d=4)
    layout = blockwise.dense_layout(None, lambda b, h, qi, ki: (qi < 4) & (ki <= qi), 9, 9)
    out, lse = blockwise.forward(q, k, v, layout)
    assert torch.equal(out[:, 4:], torch.zeros_like(out[:, 4:]))
    assert torch.isinf(lse[..., 4:]).all() and (lse[..., 4:] < 0).all()
    torch.testing.assert_close(out, oracle.attention(q, k, v, oracle.hook(layout.mask_mod)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("left,right", [(-1, 0), (2, 0), (-1, -1), (1, 2)])
@pytest.mark.parametrize("read_host", [True, False], ids=["per-document", "band"])
def test_packed_forward_equals_the_oracle(left, right, read_host):
    bounds = [0, 4, 5, 5, 14, 20]  # an empty and a one-token document
    q, k, v = (t[0] for t in qkv(b=1, s=20, hq=4, hkv=2, d=4))
    cu = torch.tensor(bounds)
    pattern = Pattern(left, right)
    layout = (blockwise.packed_layout(pattern, bounds, bounds) if read_host
              else blockwise.packed_band_layout(pattern, cu, cu, 20, 20, 9, 9, same=True))
    out, _ = blockwise.forward(q[None], k[None], v[None], layout, sink=torch.tensor(SINK, dtype=torch.float64))
    expected = oracle.packed_attention(q, k, v, bounds, left, right, sink=SINK)
    torch.testing.assert_close(out[0], expected, rtol=1e-12, atol=1e-12)


def test_packed_band_without_shared_boundaries_visits_every_tile():
    """Distinct q and kv boundary tensors: no band is assumed, documents are still exact."""
    bounds = [0, 6, 13, 20]
    q, k, v = (t[0] for t in qkv(b=1, s=20, hq=4, hkv=2, d=4))
    layout = blockwise.packed_band_layout(Pattern(-1, 0), torch.tensor(bounds), torch.tensor(bounds), 20, 20, 1, 1,
                                          same=False)
    assert layout.window == Pattern()
    out, _ = blockwise.forward(q[None], k[None], v[None], layout)
    torch.testing.assert_close(out[0], oracle.packed_attention(q, k, v, bounds), rtol=1e-12, atol=1e-12)


GRADS = [("window", Pattern(3, 0), None), ("two-sided", Pattern(2, 1), None), ("hook", None, strided),
         ("documents", Pattern(-1, 0, boundaries=(0, 3, 9, 11)), None)]


@pytest.mark.parametrize("name,pattern,hook", GRADS, ids=[g[0] for g in GRADS])
def test_hand_written_backward_equals_finite_differences(name, pattern, hook):
    q, k, v = qkv(b=1, s=11, hq=4, hkv=2, d=3, grad=True)
    sink = torch.tensor(SINK, dtype=torch.float64, requires_grad=True)
    slopes = torch.tensor(ALIBI, dtype=torch.float64, requires_grad=True)
    layout = blockwise.dense_layout(pattern, hook, 11, 11)

    def run(q, k, v, sink, slopes):
        return blockwise.BlockwiseAttention.apply(q, k, v, sink, slopes, layout, 0.6)[0]

    assert torch.autograd.gradcheck(run, (q, k, v, sink, slopes), eps=1e-6, atol=1e-7, rtol=1e-6)


def test_packed_backward_equals_finite_differences():
    bounds = [0, 4, 5, 12]
    q, k, v = (t[0].detach().requires_grad_() for t in qkv(b=1, s=12, hq=4, hkv=2, d=3))
    sink = torch.tensor(SINK, dtype=torch.float64, requires_grad=True)
    for layout in (blockwise.packed_layout(Pattern(2, 0), bounds, bounds),
                   blockwise.packed_band_layout(Pattern(2, 0), torch.tensor(bounds), torch.tensor(bounds), 12, 12,
                                                7, 7, same=True)):
        def run(q, k, v, sink, layout=layout):
            return blockwise.BlockwiseAttention.apply(q[None], k[None], v[None], sink, None, layout, None)[0]

        assert torch.autograd.gradcheck(run, (q, k, v, sink), eps=1e-6, atol=1e-7, rtol=1e-6)


def test_a_window_visits_only_its_band():
    """The point of the blocks: a window's work grows with S x W, not S^2."""
    layout = blockwise.dense_layout(Pattern(3, 0), None, 40, 40)
    visited = sum(t.k1 - t.k0 for _, _, tiles in blockwise._blocks(layout, 1) for t in tiles)
    assert visited <= 40 * (3 + 4)  # rows x (window + one block of rows)
    full = blockwise.dense_layout(Pattern(-1, -1), None, 40, 40)
    assert all(not t.masked for _, _, tiles in blockwise._blocks(full, 1) for t in tiles)
