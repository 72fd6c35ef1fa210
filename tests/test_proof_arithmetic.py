"""Proofs in torch's arithmetic (B31): what a hook means is what torch computes, type promotion and float32
included, so a proof follows torch's conversions and a score proof holds for every finite float32 score.

* a Python number meeting a narrow integer table is converted into the table's dtype (wrap-around) before torch
  compares or combines them: ``FLAG[h] == 260`` on a uint8 table is ``FLAG[h] == 4``;
* a score hook of allowed steps that overflows (or underflows) float32 is not the identity, whatever the reals
  say; only one addition of a bias to the score is proven, as the kernels compute ALiBi;
* the cross-check calls a hook at every head of the layer and around its own constants, where wrap-around and
  comparisons begin to differ.
"""

from __future__ import annotations

import pytest
import torch

from primus_ext.errors import UnsupportedConfigError
from primus_ext.hooks import crosscheck
from primus_ext.hooks.proof import prove_mask, prove_score
from primus_ext.plan import build_plan
from primus_ext.testing import fake_primus_turbo

from . import arith_hooks as A
from .helpers import facts, settings

MASKS = {"flag_equals_260": 16, "all_flags_equal_260": 4, "flag_times_260": 16, "flag_modulo_260": 16,
         "small_plus_256": 4, "flag_below_position": 16, "raises_only_in_eager": 4,
         "zero_d_constant_meets_a_batched_table": 16}


def _torch_mask(hook, heads: int, n: int = 40, batches: int = 3) -> torch.Tensor:
    """The hook as torch's flex_attention calls it: vmap over 0-d index tensors, at every batch index and head."""
    grid = torch.cartesian_prod(torch.arange(batches), torch.arange(heads), torch.arange(n), torch.arange(n))
    return torch.vmap(hook)(*grid.unbind(1)).view(batches, heads, n, n)


@pytest.mark.parametrize("name", list(MASKS))
def test_a_narrow_table_with_a_python_constant_is_proven_as_torch_computes_it(name):
    hook, heads = getattr(A, name), MASKS[name]
    proof = prove_mask(hook, num_heads=heads)
    truth = _torch_mask(hook, heads)
    if proof.pattern is None:
        # refused: torch's mask is no single kernel pattern (it differs between batch rows or heads), or the
        # proof could not follow torch's arithmetic: never run as a pattern it is not
        assert not torch.equal(truth, truth[:1, :1].expand_as(truth)) or "wrap" in proof.reason, proof.reason
        return
    q, kv = torch.arange(40).view(-1, 1), torch.arange(40).view(1, -1)
    assert torch.equal(truth, proof.pattern.allows(q, kv).expand_as(truth)), (name, proof.pattern)


def test_flag_260_at_one_head_of_sixteen_is_not_run_as_causal_on_turbo():
    """Regression: the proof compared 4 == 260 as plain integers (false), proved the hook causal, and a turbo
    layer ran causal while torch's mask lets head 8 see every key (max error 0.89)."""
    truth = _torch_mask(A.flag_equals_260, 16)[0]
    assert bool(truth[8].all()) and not bool(truth[0].all())
    with fake_primus_turbo():
        with pytest.raises(UnsupportedConfigError, match="depends on the head index"):
            build_plan(settings(turbo_flex_attention_backend="turbo",
                                turbo_flex_attention_mask_mod="tests.arith_hooks:flag_equals_260"),
                       facts(num_heads=16, num_kv_heads=16))


def test_every_flag_equal_260_in_uint8_is_full_attention_as_torch_says():
    assert bool(_torch_mask(A.all_flags_equal_260, 4).all())
    assert prove_mask(A.all_flags_equal_260, num_heads=4).pattern.kind == "full"


@pytest.mark.parametrize("name", ["overflowing_identity", "underflowing_identity"])
def test_a_score_hook_that_leaves_float32_is_not_the_identity(name):
    """Regression: over the reals the hook is the score; the proof called it the identity and turbo ran it
    without the hook (max error 3.4), while torch computes inf / nan (or 0) for ordinary scores."""
    hook = getattr(A, name)
    score = torch.tensor([1.0, -3.0, 7.5])
    zero = torch.zeros((), dtype=torch.int64)
    assert not torch.equal(hook(score, zero, zero, zero, zero), score)
    proof = prove_score(hook, num_heads=4)
    assert proof.kind == "other" and "computes with the score" in proof.reason
    with fake_primus_turbo():
        with pytest.raises(UnsupportedConfigError) as err:
            build_plan(settings(turbo_flex_attention_backend="turbo",
                                turbo_flex_attention_score_mod=f"tests.arith_hooks:{name}"), facts())
    assert "B31-score" in err.value.codes


@pytest.mark.parametrize("name,kind", [("alibi", "alibi"), ("widened_identity", "identity"),
                                       ("rounded_to_half", "other"), ("zero_in_reals_bias", "other"),
                                       ("huge_bias", "other")])
def test_score_steps_are_proven_only_where_float32_keeps_them(name, kind):
    assert prove_score(getattr(A, name), num_heads=4).kind == kind


def test_the_cross_check_calls_every_head_and_the_hooks_constants():
    every, ends = crosscheck._heads(0, 16)
    assert every == list(range(16)) and ends == [0, 1, 14, 15]
    rows, offsets = crosscheck._positions(None, (260,))
    assert {259, 260, 261} <= set(rows) and {-261, -260, -259, 259, 260, 261} <= set(offsets)


def test_the_cross_check_calls_a_score_hook_at_float32_extremes():
    """A hook exact for ordinary scores that overflows near float32's largest values is refused by the
    cross-check itself (here checked directly, with the proof's claim of the identity)."""
    def near_max_overflow(score, b, h, q_idx, kv_idx):
        return score * 2.0 / 2.0

    why = crosscheck.check_score(near_max_overflow, "identity", None, 4, 0)
    assert "behaves differently" in why


REVIEW_SCORES = {"float16_slope_at_one_head": (64, "in torch.float16"),
                 "float64_cancellation": (4, "adds or subtracts floating values of the indices"),
                 "float32_cancellation": (4, "adds or subtracts floating values of the indices"),
                 "head_step_promoted_as_vmap": (64, "neither the identity nor ALiBi")}


@pytest.mark.parametrize("name", list(REVIEW_SCORES))
def test_a_bias_whose_float_steps_torch_rounds_otherwise_is_not_proven(name):
    """Regressions from the hostile review: each was proven ALiBi, and torch computes inf, or a bias off by up
    to 65535 where it is 0 over the reals, or another head's slope (eager 0-d promotion instead of vmap's)."""
    heads, why = REVIEW_SCORES[name]
    proof = prove_score(getattr(A, name), num_heads=heads)
    assert proof.kind == "other" and why in proof.reason, proof.reason


def test_a_head_fixed_step_is_computed_as_vmap_promotes_it():
    """At head 32 torch (under vmap) takes the near slope 0.5 far away too; eager 0-d promotion said 2.0."""
    at = [torch.tensor([v]) for v in (0, 32, 0, 2_000_000)]
    got = torch.vmap(A.head_step_promoted_as_vmap)(torch.zeros(1), *at)
    assert float(got) == 1_000_000.0


def test_a_hook_raising_only_in_eager_zero_d_code_has_its_dtypes_read_as_torch_calls_it():
    proof = prove_mask(A.raises_only_in_eager, num_heads=4)
    assert proof.pattern is None and "uint8" in proof.reason
    truth = _torch_mask(A.raises_only_in_eager, 4)
    assert bool(truth[2].all()) and not bool(truth[0].all())  # full attention from batch row 2 on


def test_the_cross_check_calls_batch_rows_past_one_and_far_keys_at_every_head():
    every_head = crosscheck._blocks(None, crosscheck._heads(0, 64), ())[0]
    batches, heads, q_idx, kv_idx = every_head
    assert {0, 1, 2, 7} <= set(batches.tolist())
    assert 32 in heads.tolist()  # every key offset below is called at the middle head too
    assert int((kv_idx - q_idx).abs().max()) >= 2 ** 31
