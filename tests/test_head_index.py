"""Hooks see the model's (global) head index at every tensor / context parallel size.

A rank holding heads ``offset .. offset + n - 1`` of the model must compute those heads as
the whole model does: its proofs cover exactly that range (the slopes proven are those
heads' own), and every backend calls the hook with ``h + offset``.  Each layer is held to
the float64 oracle of the whole four-head layer, cut to the rank's heads.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from primus_ext.attention import heads as head_index
from primus_ext.hooks.proof import prove_mask, prove_score
from primus_ext.attention.pattern import Pattern
from primus_ext.call.adapter import TurboFlexAttention
from primus_ext.backends.context_parallel import Ulysses
from primus_ext.errors import UnsupportedConfigError
from primus_ext.megatron.context_parallel import LayerContextParallel
from primus_ext.megatron.facts import layer_facts
from primus_ext.plan import build_plan
from primus_ext.testing import fake_primus_turbo
from tests import head_index_hooks as hooks
from tests.fuzz import oracle
from tests.helpers import facts, qkv, settings

HOOKS = "tests.head_index_hooks:"
HEADS = 4


def rank_facts(rank: int, tp: int = 2, **fields):
    n = HEADS // tp
    return facts(num_heads=n, num_kv_heads=max(2 // tp, 1), head_offset=rank * n, **fields)


# ----------------------------------------------------------------------------- proofs
@pytest.mark.parametrize("rank", [0, 1])
def test_alibi_proven_per_rank_has_the_slopes_of_its_global_heads(rank):
    proof = prove_score(hooks.head_alibi, num_heads=2, head_offset=2 * rank)
    assert proof.kind == "alibi"
    assert proof.alibi_slopes == tuple(hooks.SLOPES[2 * rank:2 * rank + 2].tolist())


def test_a_per_head_window_table_is_one_window_on_each_ranks_heads():
    assert prove_mask(hooks.head_windows, num_heads=2, head_offset=0).pattern == Pattern(1, 0)
    assert prove_mask(hooks.head_windows, num_heads=2, head_offset=2).pattern == Pattern(3, 0)
    whole = prove_mask(hooks.head_windows, num_heads=4, head_offset=0)
    assert whole.pattern is None and "depends on the head index" in whole.reason
    inside = prove_mask(hooks.mixed_windows, num_heads=2, head_offset=2)
    assert inside.pattern is None and "h=2 it does not" in inside.reason  # named by the rank's first head


def test_heads_past_the_table_are_refused_by_the_proof():
    proof = prove_mask(hooks.head_windows, num_heads=2, head_offset=3)  # heads 3 and 4 of a 4-entry table
    assert proof.pattern is None and "HEAD_WINDOWS" in proof.reason and "h=4" in proof.reason


# ----------------------------------------------------------------------------- the shift, in one place
def test_shifts_compose_into_one_wrapper_and_library_masks_are_kept():
    seen = []

    def mask(b, h, q_idx, kv_idx):
        seen.append(int(h))
        return kv_idx <= q_idx

    twice = head_index.mask_on_heads(head_index.mask_on_heads(mask, 4), 2)
    assert head_index.mask_on_heads(mask, 0) is mask
    assert head_index.mask_on_heads(twice, -6) is mask  # the same wrapper, undone
    zero = torch.tensor(0)
    twice(zero, torch.tensor(1), zero, zero)
    assert seen == [7]
    from primus_ext.attention.masks import causal

    library = causal()
    assert head_index.mask_on_heads(library, 3) is library  # reads no head, runs as its pattern


def test_layer_facts_give_each_tensor_parallel_rank_its_heads():
    config = dict(num_attention_heads=8, num_query_groups=4, kv_channels=16, tensor_model_parallel_size=4)
    assert [layer_facts(config, 1, tp_rank=r).head_offset for r in range(4)] == [0, 2, 4, 6]
    assert layer_facts(config, 1).head_offset == 0


def test_a_context_parallel_rank_adds_its_offset_to_the_tensor_parallel_ranks():
    """Eight heads, TP rank 1 of 2 (heads 4-7) x CP rank 1 of 2: heads 6-7, their slopes, one wrapper."""
    from tests.fuzz import user_hooks

    with fake_primus_turbo():
        plan = build_plan(settings(turbo_flex_attention_score_mod="tests.fuzz.user_hooks:alibi_list"),
                          facts(num_heads=4, num_kv_heads=2, head_offset=4))
    local = LayerContextParallel(Ulysses(None, 2, 1), True, "causal").local_plan(plan)
    assert (local.head_offset, local.num_heads, local.num_kv_heads) == (6, 2, 1)
    assert local.alibi_slopes == tuple(user_hooks.ALIBI_LIST[6:8])
    score, b, h = torch.randn(1, 2, 4, 4, dtype=torch.float64), torch.tensor(0), torch.arange(2).view(1, 2, 1, 1)
    q, kv = torch.arange(4).view(-1, 1), torch.arange(4)
    assert torch.equal(local.score_mod(score, b, h, q, kv), user_hooks.alibi_list(score, b, h + 6, q, kv))
    unshifted = head_index.score_on_heads(local.score_mod, -6)
    assert unshifted.__wrapped__ is user_hooks.alibi_list  # called as torch calls it (`as_torch_calls`)


# ----------------------------------------------------------------------------- every backend
def whole_layer(mask_hook, score_hook):
    """float64 output and q/k/v gradients of the four-head layer (bshd), with the upstream gradient."""
    q, k, v = qkv(hq=HEADS, hkv=2, dtype=torch.float64, grad=True)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    allowed = oracle.hook_mask(mask_hook, 2, HEADS, 16, 16)
    out, _ = oracle.attention(q, k, v, allowed, score_fn=score_hook)
    out.backward(grad)
    return (q, k, v, grad), out.detach(), [t.grad for t in (q, k, v)]


def rank_run(plan, q, k, v, grad, rank, tp=2):
    """The rank's heads of the whole layer's inputs through the adapter: output and q/k/v gradients."""
    n, nkv = HEADS // tp, max(2 // tp, 1)
    leaves = [t.detach()[:, :, r * c:(r + 1) * c].float().requires_grad_(True)
              for t, c, r in ((q, n, rank), (k, nkv, rank), (v, nkv, rank))]
    out = TurboFlexAttention(plan)(*leaves)
    out.backward(grad[:, :, rank * n:(rank + 1) * n].float())
    return out.detach(), [t.grad for t in leaves]


CASES = {  # backend, mask hook, score hook: each hook reads a per-head table by the head index
    "reference-mixed-windows-alibi": ("reference", "mixed_windows", "head_alibi"),
    "turbo-head-windows-alibi": ("turbo", "head_windows", "head_alibi"),  # one window per rank: proven
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("rank", [0, 1])
def test_each_tensor_parallel_rank_computes_its_heads_of_the_whole_layer(case, rank):
    backend, mask, score = CASES[case]
    (q, k, v, grad), want, want_grads = whole_layer(getattr(hooks, mask), getattr(hooks, score))
    keys = dict(turbo_flex_attention_backend=backend, turbo_flex_attention_mask_mod=HOOKS + mask,
                turbo_flex_attention_score_mod=HOOKS + score)
    with fake_primus_turbo() as fake:
        plan = build_plan(settings(**keys), rank_facts(rank))
        assert plan.head_offset == 2 * rank
        got, grads = rank_run(plan, q, k, v, grad, rank)
        calls = list(fake.calls)
    if backend == "turbo":
        assert plan.pattern == Pattern(1 + 2 * rank, 0)
        assert plan.alibi_slopes == tuple(hooks.SLOPES[2 * rank:2 * rank + 2].tolist())
        assert [c.entry for c in calls] and all(c.entry == "flash_attn_func" for c in calls)
    n = HEADS // 2  # and one key/value head: rank r's query heads are all that use key/value head r
    tol, grad_tol = oracle.OUTPUT_TOL[torch.float32], oracle.GRAD_TOL[torch.float32]
    why = oracle.mismatch(got, want[:, :, rank * n:(rank + 1) * n], tol)
    assert why is None, why
    for name, g, w, c in zip("qkv", grads, want_grads, (n, 1, 1)):
        why = oracle.mismatch(g, w[:, :, rank * c:(rank + 1) * c], grad_tol)
        assert why is None, f"d{name}: {why}"


def test_a_rank_whose_heads_the_hook_cannot_serve_is_refused_naming_them():
    with fake_primus_turbo(), pytest.raises(UnsupportedConfigError) as info:
        build_plan(settings(turbo_flex_attention_backend="turbo",
                            turbo_flex_attention_mask_mod=HOOKS + "mixed_windows"), rank_facts(1))
    assert "layer 1, heads 2-3" in str(info.value) and "h=2 it does not" in str(info.value)


def test_a_plan_says_which_of_the_models_heads_it_holds():
    plan = build_plan(settings(), rank_facts(1))
    assert "heads=2/1 (GQA) (heads 2-3 of the model)" in plan.describe()
    assert "of the model" not in build_plan(settings(), facts()).describe()
    assert dataclasses.replace(plan, head_offset=0) == build_plan(settings(), rank_facts(0))


# ----------------------------------------------------------------------------- primus-ext check
def check(tmp_path, mask: str, tp: int, cp: int = 1, groups: int = 2):
    import io

    import yaml

    from primus_ext.cli.check import run_check

    config = dict(use_turbo_attention=True, use_turbo_flex_attention=True, turbo_flex_attention_backend="turbo",
                  turbo_flex_attention_mask_mod=HOOKS + mask, turbo_flex_attention_score_mod=HOOKS + "head_alibi",
                  num_layers=2, num_attention_heads=4, num_query_groups=groups, hidden_size=64, seq_length=32,
                  tensor_model_parallel_size=tp, context_parallel_size=cp, packed_sequences=False)
    path = tmp_path / "tp.yaml"
    path.write_text(yaml.safe_dump(config))
    out, err = io.StringIO(), io.StringIO()
    with fake_primus_turbo():
        code = run_check(str(path), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_check_proves_every_tensor_parallel_ranks_heads_and_shows_where_they_differ(tmp_path):
    code, out, err = check(tmp_path, "head_windows", tp=2)
    assert code == 0, err
    assert "proven for each rank's heads (rank 0: heads 0-1, rank 1: heads 2-3)" in out
    assert "head_windows -> window(left=1, right=0)" in out  # rank 0's, in the table
    assert "tensor-parallel rank 1, layer 1:" in out and "mask=window(left=3, right=0)" in out
    code, out, err = check(tmp_path, "head_windows", tp=2, cp=2, groups=4)  # a CP rank's heads: its TP rank's
    assert code == 0, err
    assert "rank 1: heads 2-3" in out and "context parallel: layers 1, 2" in out


def test_check_refuses_what_some_rank_cannot_run_naming_the_ranks(tmp_path):
    code, _, err = check(tmp_path, "head_windows", tp=1)  # one rank: the windows differ across its heads
    assert code == 2 and "depends on the head index" in err and "tensor-parallel rank" not in err
    code, _, err = check(tmp_path, "mixed_windows", tp=2)
    assert code == 2
    assert "on tensor-parallel rank 0: " in err and "on tensor-parallel rank 1: " in err and "h=2 it does not" in err
