"""Attention dropout under tensor and context parallelism draws as megatron-core draws it.

Each world (TP 2, CP 2, TP 2 x CP 2 over gloo) seeds megatron-core's RNG tracker with its own
``model_parallel_cuda_manual_seed`` (over a CPU tracker, `primus_ext.testing.cpu_rng`) and runs a
full-attention layer with dropout 0.5 whose output shows its keep mask: q = k = 0 gives every key
the same probability, and v one-hot per key position puts key j's kept probability in channel j.
Every pair of global heads must drop independently (on the default generator the heads of
different TP ranks, and under Ulysses those of different CP ranks, dropped the same positions), two
runs from the same seed must draw the same masks, and another seed other masks.  Both paths:
the ``reference`` backend and the direct path on the fake Primus-Turbo.
"""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

import pytest
import torch

from tests.megatron.conftest import gloo_world, spawn_ranks
from tests.megatron.cp_world import BATCH, DIM, DIRECT, REFERENCE, SEQ, Layer, build, megatron_split, run, tp_part

P = 0.5
SEED = 1234
PATHS = {"reference": REFERENCE, "direct": DIRECT}


def keep_inputs(hq: int, hkv: int) -> dict[str, torch.Tensor]:
    eye = torch.eye(SEQ, DIM)  # v[b, s, h] = e_s
    return dict(q=torch.zeros(BATCH, SEQ, hq, DIM), k=torch.zeros(BATCH, SEQ, hkv, DIM),
                v=eye.view(1, SEQ, 1, DIM).expand(BATCH, SEQ, hkv, DIM).contiguous(),
                grad=torch.randn(BATCH, SEQ, hq * DIM, generator=torch.Generator().manual_seed(0)))


def run_world(rank: int, port: int, out_dir: str, tp: int, cp: int) -> None:
    from primus_ext.testing import fake_primus_turbo
    from primus_ext.testing.cpu_rng import seed_model_parallel

    with gloo_world(rank, port, tp * cp, tp=tp, cp=cp, timeout_s=120) as ps, fake_primus_turbo():
        hq, hkv = 2 * tp * cp, tp * cp
        seed_model_parallel(SEED)  # as Megatron's initialisation does, before the model is built
        part = tp_part(megatron_split(keep_inputs(hq, hkv)), tp, hq)
        record: dict = dict(tp_rank=ps.get_tensor_model_parallel_rank(), cp_rank=ps.get_context_parallel_rank())
        for name, keys in PATHS.items():
            module = build(Layer(keys, causal=False), cp, hq, hkv, tp=tp, dropout=P)
            draws = []
            for seed in (SEED, SEED, SEED + 1):
                seed_model_parallel(seed)
                got = run(module, part)
                assert torch.isfinite(got["dq"]).all() and torch.isfinite(got["dv"]).all()
                draws.append((got["out"].unflatten(2, (-1, DIM)) != 0))  # [B, S_local, H_tp, S]
            record[name] = draws
        torch.save(record, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.parametrize("tp, cp", [(2, 1), (1, 2), (2, 2)], ids=["tp2", "cp2", "tp2xcp2"])
def test_every_global_head_drops_its_own_positions_reproducibly(tp, cp, tmp_path):
    records = spawn_ranks(functools.partial(run_world, tp=tp, cp=cp), tp * cp, tmp_path)
    for name in PATHS:
        for cp_rank in range(cp):
            ranks = sorted((r for r in records if r["cp_rank"] == cp_rank), key=lambda r: r["tp_rank"])
            first, again, other = (torch.cat([r[name][i] for r in ranks], dim=2) for i in range(3))
            assert torch.equal(first, again), (name, "the same seed must draw the same masks")
            assert not torch.equal(first, other), (name, "another seed must draw other masks")
            kept = first.float().mean().item()
            assert 0.35 < kept < 0.65, (name, kept)
            heads = first.shape[2]
            for a, b in itertools.combinations(range(heads), 2):
                agree = (first[:, :, a] == first[:, :, b]).float().mean().item()
                assert agree < 0.75, (name, cp_rank, a, b, agree)  # ~0.5 when independent, 1.0 when shared
