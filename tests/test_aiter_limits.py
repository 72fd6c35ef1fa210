"""aiter's limits at the tag Primus-Turbo pins (v0.1.14.post1), fp8's limits, and autotune's cache key (B33).

Read at aiter@0f3c58e6 and Primus-Turbo a6a16cd (docs/fidelity.md, facts `aiter-sink-bias`,
`ck-bias-alibi`, `ck-head-dims`, `fp8-head-dims`, `fp8-bf16-output`, `autotune-cache-key`): the sink
path (aiter's Triton forward) raises ValueError for any bias; CK rejects a bias with ALiBi and takes
head dims of at most 256 that are multiples of 8; fp8's backward asserts head dims >= 32 and even, and
it returns bf16 whatever the input dtype; autotune's key leaves out the kv length, contiguity and the
document count, and a cache hit skips ``can_handle``.  The plan refuses each at build, and the fake
fails as upstream fails.
"""

from __future__ import annotations

import pytest
import torch

from primus_ext.backends.dispatch import DENSE, VARLEN, CallFeatures, Selection, route
from primus_ext.errors import UnsupportedConfigError
from primus_ext.plan import build_plan
from primus_ext.testing import fake_primus_turbo

from .helpers import facts, qkv, settings

BF16 = torch.bfloat16


def features(**kw) -> CallFeatures:
    base = dict(arch="gfx942", entry=DENSE, dtype="bf16", head_dim=64, head_dim_v=64, heads=4, kv_heads=2)
    return CallFeatures(**{**base, **kw})


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_a_bias_with_a_sink_is_refused_and_the_fake_raises_aiters_value_error(arch):
    found = route(features(arch=arch, sink=True, bias=True))
    assert found.backend == "AITER" and "l.78-79" in found.problem()
    q, k, v = qkv(d=64, dtype=BF16)
    with fake_primus_turbo(arch=arch) as fake:
        with pytest.raises(ValueError, match="raises ValueError for any bias"):
            fake.module.flash_attn_func(q, k, v, causal=True, sink=torch.zeros(4), bias=torch.zeros(16, 16, dtype=BF16))


def test_ck_rejects_a_bias_with_alibi_and_the_fake_raises_as_it_does():
    found = route(features(bias=True, alibi=True))
    assert found.backend == "AITER" and "mha_fwd_kernels.cu l.275" in found.problem()
    q, k, v = qkv(d=64, dtype=BF16)
    with fake_primus_turbo(arch="gfx942") as fake:
        with pytest.raises(RuntimeError, match="cannot apply bias and alibi"):
            fake.module.flash_attn_func(q, k, v, causal=True, bias=torch.zeros(16, 16, dtype=BF16),
                                        alibi_slopes=torch.ones(4))


@pytest.mark.parametrize("head_dim, ok", [(256, True), (264, False), (257, False), (12, True), (250, True),
                                          (40, True)])
@pytest.mark.parametrize("entry", [DENSE, VARLEN])
def test_ck_head_dims_are_at_most_256_after_primus_turbos_padding_to_a_multiple_of_8(head_dim, ok, entry):
    """Primus-Turbo pads head dims up to a multiple of 8 before CK sees them: 12 runs (as 16), 257 does not."""
    found = route(features(entry=entry, head_dim=head_dim, head_dim_v=head_dim))
    assert found.ok is ok, found.problem()
    if not ok:
        assert "at most 256 that are multiples of 8" in found.problem()


def test_a_head_dim_primus_turbo_pads_runs_on_the_fake_and_matches_the_oracle():
    q, k, v = qkv(d=12, dtype=BF16)
    with fake_primus_turbo(arch="gfx942") as fake:
        out = fake.module.flash_attn_func(q, k, v, causal=True)
    want = torch.nn.functional.scaled_dot_product_attention(
        *(t.double().transpose(1, 2) for t in (q, torch.repeat_interleave(k, 2, 2), torch.repeat_interleave(v, 2, 2))),
        is_causal=True).transpose(1, 2)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)


def test_a_layer_with_head_dims_ck_does_not_take_is_refused_at_build():
    with fake_primus_turbo(arch="gfx942"):
        with pytest.raises(UnsupportedConfigError, match="at most 256") as err:
            build_plan(settings(turbo_flex_attention_backend="turbo"), facts(head_dim=288, dtype="bf16"))
        assert "B33" in err.value.codes and "kv_channels" in err.value.settings
        build_plan(settings(turbo_flex_attention_backend="reference"), facts(head_dim=288, dtype="bf16"))


@pytest.mark.parametrize("head_dim, code", [(16, "fp8-head-dim"), (33, "fp8-head-dim"), (64, None)])
def test_fp8_head_dims_are_refused_at_build_as_its_backward_asserts(head_dim, code):
    layer = facts(head_dim=head_dim, dtype="bf16", causal=False, attn_mask_type="no_mask")
    keys = settings(use_turbo_flex_attention=False, enable_turbo_attention_float8=True)
    with fake_primus_turbo():
        if code is None:
            assert build_plan(keys, layer).storage == "contiguous-bshd"  # fp8 asserts contiguous inputs
            return
        with pytest.raises(UnsupportedConfigError) as err:
            build_plan(keys, layer)
    assert code in err.value.codes and "kv_channels" in err.value.settings


def test_fp8_returns_bf16_so_a_fp16_layer_is_refused_and_the_fake_returns_bf16():
    with fake_primus_turbo() as fake:
        with pytest.raises(UnsupportedConfigError) as err:
            build_plan(settings(use_turbo_flex_attention=False, enable_turbo_attention_float8=True),
                       facts(head_dim=64, dtype="fp16", causal=False, attn_mask_type="no_mask"))
        assert "fp8-dtype" in err.value.codes
        q, k, v = qkv(d=64, dtype=torch.float16)
        assert fake.module.flash_attn_fp8_func(q, k, v).dtype == BF16
        with pytest.raises(AssertionError, match="head dims >= 32"):
            fake.module.flash_attn_fp8_func(*qkv(d=16, dtype=torch.float16))
        with pytest.raises(AssertionError, match="contiguous"):  # bshd-ordered but strided: the kernel asserts
            fake.module.flash_attn_fp8_func(*(torch.cat([t, t], -1)[..., :64] for t in (q, k, v)))


def test_fp8_on_sbhd_memory_computes_another_attention_upstream_and_in_the_fake_so_the_plan_stores_bshd():
    """flash_attn_fp8_func permutes sbhd memory and its kernel reads the copy as bshd: the batch takes the
    sequence's place, silently.  The fake computes that; the plan hands fp8 contiguous bshd q/k/v."""
    q, k, v = qkv(b=2, s=16, d=64, dtype=BF16)
    as_sbhd = [t.transpose(0, 1).contiguous().transpose(0, 1) for t in (q, k, v)]
    with fake_primus_turbo() as fake:
        right = fake.module.flash_attn_fp8_func(q, k, v, causal=True)
        wrong = fake.module.flash_attn_fp8_func(*as_sbhd, causal=True)
    assert wrong.shape == right.shape and not torch.allclose(wrong.float(), right.float(), atol=1e-1)
    layer = facts(head_dim=64, dtype="bf16")
    with fake_primus_turbo():
        plan = build_plan(settings(use_turbo_flex_attention=False, enable_turbo_attention_float8=True), layer)
    assert plan.storage == "contiguous-bshd"


# -- autotune's cache key --------------------------------------------------------------------------------
def test_autotunes_key_has_no_document_count_so_a_packed_layer_flydsl_may_be_cached_for_is_refused():
    tuned = Selection(autotune=True)
    packed = dict(arch="gfx950", entry=VARLEN, heads=16, kv_heads=2)
    unequal = route(features(**packed), tuned)
    assert not unequal.ok and "document count" in unequal.problem() and "FlyDSL" in unequal.candidates
    assert route(features(**packed, equal_documents=True), tuned).ok  # packed_equal_documents: one kind only
    layer = facts(num_heads=16, num_kv_heads=2, head_dim=64, dtype="bf16", packed=True)
    with fake_primus_turbo(arch="gfx950"):
        with pytest.raises(UnsupportedConfigError, match="autotune may cache FlyDSL") as err:
            build_plan(settings(turbo_flex_attention_backend="turbo", use_turbo_autotune=True,
                                packed_sequences=True), layer)
        assert "use_turbo_autotune" in err.value.settings
        build_plan(settings(turbo_flex_attention_backend="turbo", use_turbo_autotune=True, packed_sequences=True,
                            packed_equal_documents=True), layer)


def test_autotunes_key_has_no_kv_length_or_contiguity():
    tuned = Selection(autotune=True)
    longer_q = route(features(arch="gfx950", heads=16, kv_heads=2, q_within_kv=False), tuned)
    assert not longer_q.ok and "HipKittens" in longer_q.problem()  # cached for Sq <= Skv, run on Sq > Skv
    strided = route(features(arch="gfx950", heads=16, kv_heads=2, contiguous_sbhd=False), tuned)
    assert not strided.ok


def test_the_fakes_autotune_cache_hit_skips_can_handle(monkeypatch):
    """Upstream's key for varlen holds token counts and max_seqlen, not the document count: FlyDSL, cached for
    an equal-document batch, is handed an unequal one of the same key without can_handle."""
    monkeypatch.setenv("PRIMUS_TURBO_AUTO_TUNE", "1")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(64, 16, 64, generator=gen).to(BF16)
    k = v = torch.randn(64, 2, 64, generator=gen).to(BF16)
    equal, unequal = torch.tensor([0, 32, 64], dtype=torch.int32), torch.tensor([0, 20, 64], dtype=torch.int32)
    with fake_primus_turbo(arch="gfx950") as fake:
        run = fake.module.flash_attn_varlen_func
        run(q, k, v, equal, equal, 44, 44, causal=True)  # max_seqlen 44: the same key as the unequal batch
        assert fake.calls[-1].backend == "FlyDSL"
        with pytest.raises(NotImplementedError, match="without can_handle"):
            run(q, k, v, unequal, unequal, 44, 44, causal=True)
        assert fake.calls[-1].backend == "FlyDSL"
        run(q, k, v, unequal, unequal, 45, 45, causal=True)  # another key: timed afresh, AITER takes it
        assert fake.calls[-1].backend == "AITER"
