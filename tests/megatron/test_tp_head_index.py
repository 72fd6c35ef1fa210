"""Per-head hooks under tensor parallelism: every rank gives its hooks the model's head index.

The hooks (`tests.head_index_hooks`) read per-head tables, the model's four heads: ALiBi slopes
and causal windows.  A TP rank holds heads ``tp_rank * 2 ..``; were a hook given the rank-local
index, rank 1 would compute heads 2-3 with the values of heads 0-1.

* Unit tests fake the TP rank in the single-process gloo world: megatron-core's parallel state
  told it is rank 1 of 2 (``set_tensor_model_parallel_rank``), or a ``pg_collection`` whose tp
  group says so.  The layer's output is the float64 oracle's, heads 2-3 of the whole layer.
* The acceptance test runs a megatron-core GPTModel (its own column/row-parallel QKV and
  projection) at TP=2 in two gloo processes and at TP=1 here, from the same CPU-initialised
  weights: the loss and every gradient (shards joined) are equal.  On ``reference`` with windows
  that differ inside each rank; on the fake Turbo with one window per rank, proven per rank
  (window 1 on heads 0-1, window 3 on heads 2-3, and each rank's own slopes), which at TP=1
  only ``reference`` can run.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from primus_ext.attention.pattern import Pattern
from primus_ext.testing import fake_primus_turbo
from tests import head_index_hooks as hooks
from tests.fuzz import oracle
from tests.megatron import gpt
from tests.megatron.conftest import FakeGroup, gloo_world, spawn_ranks

TP = 2
HOOKS = "tests.head_index_hooks:"
CASES = {  # name: (backend at TP=2, mask hook); the score hook is head_alibi throughout
    "reference": ("reference", "mixed_windows"),
    "turbo": ("turbo", "head_windows"),
}


def keys(backend: str, mask: str) -> dict:
    return dict(use_turbo_flex_attention=True, turbo_flex_attention_backend=backend,
                turbo_flex_attention_mask_mod=HOOKS + mask, turbo_flex_attention_score_mod=HOOKS + "head_alibi")


# ----------------------------------------------------------------------------- a faked TP rank
@pytest.fixture(params=["parallel_state", "pg_collection"])
def tp_rank_1(request):
    """How the layer learns it is TP rank 1 of 2: megatron-core's parallel state, or a pg_collection."""
    from megatron.core import parallel_state

    if request.param == "pg_collection":
        yield SimpleNamespace(tp=FakeGroup(TP, 1), cp=None)
        return
    parallel_state.set_tensor_model_parallel_rank(1)
    try:
        yield None
    finally:
        parallel_state.set_tensor_model_parallel_rank(None)


@pytest.mark.parametrize("case", sorted(CASES))
def test_tensor_parallel_rank_1_computes_heads_2_and_3_of_the_layer(case, tp_rank_1):
    from megatron.core.transformer.enums import AttnMaskType

    from primus_ext.megatron import PrimusTurboLocalAttention

    backend, mask = CASES[case]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 16, h, 16, generator=gen, dtype=torch.float64) for h in (4, 2, 2))  # bshd, whole
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want, _ = oracle.attention(*leaves, oracle.hook_mask(getattr(hooks, mask), 2, 4, 16, 16),
                               score_fn=hooks.head_alibi)
    upstream = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    want.backward(upstream)
    cfg = gpt.config(tensor_model_parallel_size=TP, kv_channels=16)
    with fake_primus_turbo() as fake:
        module = PrimusTurboLocalAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=tp_rank_1,
                                           settings=gpt.settings(**keys(backend, mask)))
        mine = [t[:, :, a:b].float().transpose(0, 1).contiguous().requires_grad_(True)  # this rank's heads, sbhd
                for t, (a, b) in zip((q, k, v), ((2, 4), (1, 2), (1, 2)))]
        out = module(*mine, None)
        out.backward(upstream[:, :, 2:4].float().transpose(0, 1).flatten(2))
    assert module.plan.head_offset == 2
    if backend == "turbo":
        assert module.plan.pattern == Pattern(3, 0)
        assert module.plan.alibi_slopes == tuple(hooks.SLOPES[2:4].tolist())
        assert {c.entry for c in fake.calls} == {"flash_attn_func"}
    got = out.detach().transpose(0, 1).unflatten(2, (2, 16))
    why = oracle.mismatch(got, want.detach()[:, :, 2:4], oracle.OUTPUT_TOL[torch.float32])
    assert why is None, why
    for name, t, leaf, (a, b) in zip("qkv", mine, leaves, ((2, 4), (1, 2), (1, 2))):
        why = oracle.mismatch(t.grad.transpose(0, 1), leaf.grad[:, :, a:b], oracle.GRAD_TOL[torch.float32])
        assert why is None, f"d{name}: {why}"


# ----------------------------------------------------------------------------- TP=2 GPT == TP=1 GPT
def step(model: torch.nn.Module, tokens: torch.Tensor) -> dict[str, Any]:
    """One forward and backward: the loss, every parameter's gradient and how megatron-core splits it."""
    model.train()
    loss = model(tokens, gpt.positions(tokens), None, labels=tokens).float().mean()
    loss.backward()
    grads = {name: dict(grad=p.grad.detach().clone(), parallel=bool(getattr(p, "tensor_model_parallel", False)),
                        dim=getattr(p, "partition_dim", None)) for name, p in model.named_parameters()}
    return dict(loss=loss.item(), grads=grads)


def run_case(backend: str, mask: str, tp: int) -> dict[str, Any]:
    with fake_primus_turbo():
        model = gpt.build_gpt(gpt.settings(**keys(backend, mask)), gpt.config(tensor_model_parallel_size=tp))
        plans = [m.plan for m in gpt.attention_modules(model)]
        record = step(model, gpt.batches(1)[0])
    record["plans"] = [(p.head_offset, p.pattern, p.alibi_slopes, p.backend) for p in plans]
    return record


def run_rank(rank: int, port: int, out_dir: str) -> None:
    """One TP rank: gloo + megatron-core's parallel state at TP 2, each case's step, the record."""
    with gloo_world(rank, port, TP, tp=TP) as parallel_state:
        record = {name: run_case(backend, mask, TP) for name, (backend, mask) in CASES.items()}
        record["tp_rank"] = parallel_state.get_tensor_model_parallel_rank()
        torch.save(record, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def tp2_records(tmp_path_factory):
    records = spawn_ranks(run_rank, TP, tmp_path_factory.mktemp("tp2-heads"))
    return sorted(records, key=lambda r: r["tp_rank"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_tp2_gpt_with_per_head_hooks_equals_the_tp1_model(case, tp2_records):
    _, mask = CASES[case]
    want = run_case("reference", mask, 1)  # at TP=1 only reference runs a mask that differs across heads
    ranks = [r[case] for r in tp2_records]
    for rank, got in enumerate(ranks):
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-6, rel=1e-6), rank
        assert [p[0] for p in got["plans"]] == [2 * rank, 2 * rank]
        if case == "turbo":  # each rank runs its own window and its heads' slopes on the (fake) kernel
            assert {(p[1], p[2], p[3]) for p in got["plans"]} == {
                (Pattern(1 + 2 * rank, 0), tuple(hooks.SLOPES[2 * rank:2 * rank + 2].tolist()), "turbo")}
    for name, full in want["grads"].items():
        parts = [r["grads"][name] for r in ranks]
        if parts[0]["parallel"]:
            got = torch.cat([p["grad"] for p in parts], dim=parts[0]["dim"])
        else:
            got = parts[0]["grad"]
            assert torch.allclose(parts[1]["grad"], got, atol=1e-6, rtol=1e-5), name
        assert got.shape == full["grad"].shape, name
        assert torch.allclose(got, full["grad"], atol=1e-6, rtol=1e-4), (
            f"{case}, {name}: max abs diff {(got - full['grad']).abs().max().item():.3g}")
