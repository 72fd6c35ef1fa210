"""How q, k and v are stored when they reach Primus-Turbo, per arch (B33, B34).

Upstream infers one storage layout from the strides of all three tensors and asserts on any
other (``_infer_qkv_format``); FlyDSL's gate reads the layout order only, and its kernel
wrapper then asserts that q, k and v are contiguous sbhd, with no fallback
(docs/fidelity.md, facts `flydsl-gate-order`, `flydsl-contiguous`).
megatron-core 0.16.1 hands core attention a contiguous query (and key,
after RoPE) but a value that is a ``torch.split`` view of the fused QKV projection.  So:

* the fake asserts what upstream asserts;
* the plan decides once per layer how the Megatron modules store q, k and v
  (`AttentionPlan.storage`): contiguous bshd on gfx942, contiguous sbhd on gfx950 where FlyDSL
  takes the layer's dense calls, as given elsewhere;
* a drop-in call the kernels would assert on is refused with our error.
"""

from __future__ import annotations

import random

import pytest
import torch

from primus_ext.backends.layout import LayoutError, infer_qkv_format, storage_features
from primus_ext.errors import UnsupportedConfigError, UnsupportedInputError
from primus_ext.plan import build_plan
from primus_ext.testing import fake_primus_turbo

from .fuzz import oracle
from .helpers import adapter, facts, settings

BF16 = torch.bfloat16
S, B, HQ, HKV, D = 128, 2, 16, 2, 64  # bf16, causal, D 64, GQA 8: FlyDSL's shape on gfx950


def megatron_sbhd(seed: int = 0, dtype: torch.dtype = BF16, rope_key: bool = True):
    """sbhd q, k, v as megatron-core's SelfAttention passes them: the fused QKV projection split
    along its last dim (attention.py l.1458-1463), q reshaped (a copy), k through RoPE (a copy)."""
    gen = torch.Generator().manual_seed(seed)
    group = HQ // HKV
    fused = torch.randn(S, B, HKV, (group + 2) * D, generator=gen).to(dtype)
    query, key, value = fused.split([group * D, D, D], dim=-1)
    query = query.reshape(S, B, HQ, D)
    key = key * 1.0 if rope_key else key  # RoPE returns a new, contiguous tensor
    return query, key, value


def test_upstreams_layout_inference_reads_all_three_tensors():
    q, k, v = megatron_sbhd()
    views = tuple(t.transpose(0, 1) for t in (q, k, v))
    assert infer_qkv_format(*views) == "sbhd"  # the split value still orders as sbhd ...
    fmt, sbhd, contiguous, bshd = storage_features(*views)
    assert (fmt, sbhd, contiguous, bshd) == ("sbhd", True, False, False)  # ... but is not contiguous
    bshd = torch.randn(B, S, HKV, D)
    with pytest.raises(LayoutError, match="share one layout"):
        infer_qkv_format(views[0], bshd, bshd)
    assert storage_features(*(t.contiguous() for t in views))[0] == "bshd"
    one = torch.randn(S, 1, HQ, D).transpose(0, 1)  # batch 1: bshd by the tie-break, FlyDSL takes it
    assert storage_features(one, one[:, :, :HKV], one[:, :, :HKV])[1] is True


def test_the_fake_asserts_flydsl_contiguity_as_upstream_does():
    q, k, v = megatron_sbhd()
    with fake_primus_turbo(arch="gfx950") as fake:
        ops = fake.module
        views = [t.transpose(0, 1) for t in (q, k, v)]
        with pytest.raises(AssertionError, match="SBHD tensors must be contiguous"):
            ops.flash_attn_func(*views, causal=True)
        assert fake.calls[-1].backend == "FlyDSL"  # taken by the gate, then failed: no fallback
        ops.flash_attn_func(*(t.contiguous().transpose(0, 1) for t in (q, k, v)), causal=True)
        assert fake.calls[-1].backend == "FlyDSL"
        with pytest.raises(AssertionError, match="share one layout"):
            ops.flash_attn_func(views[0], views[1].contiguous(), views[2].contiguous(), causal=True)


@pytest.mark.parametrize("arch, heads, flex, backend, storage", [
    ("gfx942", (16, 2), True, "turbo", "contiguous-bshd"),
    ("gfx942", (16, 2), False, "turbo", "contiguous-bshd"),
    ("gfx950", (16, 2), True, "turbo", "contiguous-sbhd"),   # FlyDSL takes the dense calls
    ("gfx950", (16, 2), False, "turbo", "contiguous-sbhd"),
    ("gfx950", (4, 4), True, "turbo", "as-given"),           # MHA: AITER, zero-copy strided views
    ("gfx950", (16, 2), True, "reference", "as-given"),      # the reference reads any layout
])
def test_the_plan_decides_the_storage_once_per_layer(arch, heads, flex, backend, storage):
    keys = dict(turbo_flex_attention_backend=backend, use_turbo_flex_attention=flex)
    layer = facts(num_heads=heads[0], num_kv_heads=heads[1], head_dim=D, dtype="bf16", packed=False)
    with fake_primus_turbo(arch=arch):
        assert build_plan(settings(**keys), layer).storage == storage


def test_turbo_arch_auto_sees_the_arch_the_fake_presents():
    with fake_primus_turbo(arch="gfx950"):
        assert build_plan(settings(turbo_flex_attention_backend="turbo"), facts()).arch == "gfx950"
        with pytest.raises(UnsupportedConfigError, match="this device is gfx950") as err:
            build_plan(settings(turbo_flex_attention_backend="turbo", turbo_arch="gfx942"), facts())
        assert "B33" in err.value.codes and "turbo_arch" in err.value.settings
    with fake_primus_turbo():
        assert build_plan(settings(turbo_flex_attention_backend="turbo"), facts()).arch is None


@pytest.mark.parametrize("flex", [True, False], ids=["flex-turbo", "direct"])
@pytest.mark.parametrize("rope_key", [True, False], ids=["rope-key", "split-key"])
def test_megatron_tensors_reach_flydsl_contiguous_on_gfx950(flex, rope_key):
    """Megatron's own split value (and key without RoPE) on MI355: the module makes them contiguous
    sbhd, FlyDSL runs the layer, and the output and gradients equal the float64 oracle."""
    from megatron.core.transformer.enums import AttnMaskType

    from primus_ext.megatron import PrimusTurboLocalAttention

    from .megatron import gpt

    cfg = gpt.config(hidden_size=HQ * D, num_attention_heads=HQ, num_query_groups=HKV, kv_channels=D,
                     params_dtype=BF16, bf16=True)
    keys = dict(use_turbo_flex_attention=flex, turbo_flex_attention_backend="turbo")
    with fake_primus_turbo(arch="gfx950") as fake:
        module = PrimusTurboLocalAttention(cfg, 1, AttnMaskType.causal, "self", settings=gpt.settings(**keys))
        assert module.plan.storage == "contiguous-sbhd"
        q, k, v = (t.detach().requires_grad_(True) for t in megatron_sbhd(rope_key=rope_key))
        module.train()
        out = module(q, k, v, None)
        assert fake.calls[-1].entry == "flash_attn_func" and fake.calls[-1].backend == "FlyDSL"
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(BF16)
        out.backward(grad)
    refs = [t.detach().double().transpose(0, 1).requires_grad_(True) for t in (q, k, v)]
    mask = oracle.flash_mask(S, S, causal=True, window=(-1, -1), align="bottom_right")
    want, _ = oracle.attention(*refs, mask)
    want = want.transpose(0, 1).reshape(S, B, -1)
    want.backward(grad.double())
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    for got, ref in zip((q, k, v), refs):
        torch.testing.assert_close(got.grad.double().transpose(0, 1), ref.grad, atol=6e-2, rtol=3e-2)


@pytest.mark.parametrize("flex", [True, False], ids=["flex-turbo", "direct"])
def test_a_batch_one_bshd_call_with_split_views_reaches_flydsl_contiguous(flex):
    """qkv_format='bshd' with batch 1 orders as sbhd too, so FlyDSL takes it and asserts contiguity:
    the module makes the split views contiguous (`kernel_views`) and the layer runs exactly."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from primus_ext.megatron import PrimusTurboLocalAttention

    from .megatron import gpt

    cfg = gpt.config(hidden_size=HQ * D, num_attention_heads=HQ, num_query_groups=HKV, kv_channels=D,
                     params_dtype=BF16, bf16=True)
    keys = dict(use_turbo_flex_attention=flex, turbo_flex_attention_backend="turbo")
    group = HQ // HKV
    fused = torch.randn(1, S, HKV, (group + 2) * D, generator=torch.Generator().manual_seed(5)).to(BF16)
    q, k, v = fused.split([group * D, D, D], dim=-1)
    q = q.reshape(1, S, HQ, D)
    assert not k.is_contiguous() and not v.is_contiguous()
    with fake_primus_turbo(arch="gfx950") as fake:
        module = PrimusTurboLocalAttention(cfg, 1, AttnMaskType.causal, "self", settings=gpt.settings(**keys))
        out = module(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="bshd"))
        assert fake.calls[-1].backend == "FlyDSL"
    mask = oracle.flash_mask(S, S, causal=True, window=(-1, -1), align="bottom_right")
    want, _ = oracle.attention(*(t.double() for t in (q, k, v)), mask)
    torch.testing.assert_close(out.double(), want.reshape(1, S, -1), atol=2e-2, rtol=2e-2)


def test_a_drop_in_call_flydsl_would_assert_on_is_refused_by_us():
    q, k, v = megatron_sbhd()
    views = [t.transpose(0, 1) for t in (q, k, v)]
    keys = dict(turbo_flex_attention_backend="turbo")
    layer = facts(num_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype="bf16", packed=False)
    with fake_primus_turbo(arch="gfx950"):
        run = adapter(settings(**keys), layer)
        with pytest.raises(UnsupportedInputError, match="contiguous sbhd") as err:
            run(*views, causal=True)
        assert "B33" in err.value.codes
        run(*(t.contiguous().transpose(0, 1) for t in (q, k, v)), causal=True)  # what the modules pass
    with fake_primus_turbo():  # any arch: a layout upstream asserts on is refused before the kernel
        run = adapter(settings(**keys), layer)
        with pytest.raises(UnsupportedInputError, match="share one layout") as err:
            run(views[0], views[1].contiguous(), views[2].contiguous(), causal=True)
        assert "qkv_format" in err.value.settings


def test_on_gfx942_strided_views_are_refused_for_aiters_backward_and_contiguous_ones_run():
    """gfx942's AITER v3 backward corrupts gradients of the strided bshd view of sbhd memory, so the
    modules copy to contiguous bshd there; a drop-in call passing the strided view is refused, and
    the fake, which cannot reproduce the corruption, refuses to compute it rather than be kinder."""
    q, k, v = (t.contiguous() for t in megatron_sbhd())
    views = [t.transpose(0, 1) for t in (q, k, v)]
    layer = facts(num_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype="bf16", packed=False)
    with fake_primus_turbo(arch="gfx942") as fake:
        run = adapter(settings(turbo_flex_attention_backend="turbo"), layer)
        with pytest.raises(UnsupportedInputError, match="corrupts the gradients") as err:
            run(*views, causal=True)
        assert "B33" in err.value.codes
        with pytest.raises(NotImplementedError, match="cannot reproduce"):
            fake.module.flash_attn_func(*views, causal=True)
        with pytest.raises(NotImplementedError, match="cannot reproduce"):  # the kernel level too (compiled pair)
            torch.ops.primus_turbo.attention_aiter_forward_impl(*views, 0.0, D ** -0.5, True, -1, 0, None, None,
                                                                False, False)
        run(*(t.contiguous() for t in views), causal=True)  # what the modules pass on gfx942
        assert fake.calls[-1].backend == "AITER"


def test_packed_megatron_calls_reach_the_varlen_kernel_contiguous_where_the_plan_copies():
    """megatron-core's packed value is a split view too; where the plan stores q/k/v contiguous (gfx942,
    as upstream Primus always does) the varlen entry gets contiguous thd tensors."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from primus_ext.megatron import PrimusTurboLocalAttention

    from .megatron import gpt

    cfg = gpt.config(hidden_size=HQ * D, num_attention_heads=HQ, num_query_groups=HKV, kv_channels=D,
                     params_dtype=BF16, bf16=True)
    group = HQ // HKV
    fused = torch.randn(S, 1, HKV, (group + 2) * D).to(BF16)
    q, k, v = fused.split([group * D, D, D], dim=-1)
    q = q.reshape(S, 1, HQ, D)
    cu = torch.tensor([0, S // 2, S], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=S // 2,
                             max_seqlen_kv=S // 2)
    with fake_primus_turbo(arch="gfx942") as fake:
        module = PrimusTurboLocalAttention(cfg, 1, AttnMaskType.causal, "self",
                                           settings=gpt.settings(packed_sequences=True))
        module(q, k, v, None, packed_seq_params=params)
        call = fake.calls[-1]
        assert call.entry == "flash_attn_varlen_func"
        assert all(call.args[name].is_contiguous() for name in ("q", "k", "v"))


@pytest.mark.parametrize("seed", range(4))
def test_contiguity_read_from_strides_is_torchs(seed):
    """`_contiguous` (no view made) agrees with torch's own ``transpose(0, 1).is_contiguous()``:
    permuted, sliced and transposed tensors, with empty and size-1 dimensions."""
    from primus_ext.backends.layout import _contiguous

    rng = random.Random(seed)
    for _ in range(500):
        shape = [rng.choice([0, 1, 2, 3, 5]) for _ in range(4)]
        t = torch.empty([s * rng.choice([1, 2]) for s in shape])
        t = t.permute(*rng.sample(range(4), 4)).contiguous().permute(*rng.sample(range(4), 4))
        t = t[tuple(slice(0, max(1, n // 2)) if rng.random() < 0.3 else slice(None) for n in t.shape)]
        if rng.random() < 0.3:
            t = t.transpose(0, 1)
        assert _contiguous(t.shape, t.stride(), (1, 0, 2, 3)) == t.transpose(0, 1).is_contiguous(), (t.shape, t.stride())
        assert _contiguous(t.shape, t.stride(), (0, 1, 2, 3)) == t.is_contiguous(), (t.shape, t.stride())
