"""FlyDSL's varlen kernel ignores strides, and its gate reads each call's boundaries (MI355, B33, B34).

Upstream's varlen wrappers check no contiguity and its kernel reads q at a token stride of
``Hq*D`` and k, v at ``Hkv*D`` whatever their own strides (docs/fidelity.md, fact
`flydsl-varlen-strides`); its dispatcher takes FlyDSL varlen for any batch whose documents are
all equal, one document included (fact `flydsl-varlen-runtime`).  megatron-core's packed value
is a ``torch.split`` view.  So the fake reads fixed strides too, and the plan stores packed
q, k, v contiguous on gfx950 wherever FlyDSL's varlen kernel can take a call, not only under
``packed_equal_documents``.
"""

from __future__ import annotations

import pytest
import torch

from primus_ext.backends.dispatch import BUILD_A6A16CD, BUILD_PT509, VARLEN, CallFeatures, route
from primus_ext.errors import UnsupportedInputError
from primus_ext.plan import build_plan
from primus_ext.testing import fake_primus_turbo

from .fuzz import oracle
from .helpers import adapter, facts, settings

BF16 = torch.bfloat16
S, HQ, HKV, D = 128, 16, 2, 64  # bf16, causal, D 64, GQA 8: FlyDSL's shape on gfx950 (every build)


def split_thd(seed: int = 0, tokens: int = S, hq: int = HQ, hkv: int = HKV):
    """``[T, H, D]`` q, k, v as megatron-core hands a packed call: the fused projection split on its last
    dim, q reshaped (a copy), k and v split views."""
    gen = torch.Generator().manual_seed(seed)
    group = hq // hkv
    fused = torch.randn(tokens, hkv, (group + 2) * D, generator=gen).to(BF16)
    q, k, v = fused.split([group * D, D, D], dim=-1)
    return q.reshape(tokens, hq, D), k, v


def oracle_thd(q, k, v, bounds):
    """float64 causal attention inside each document: ``[T, Hq, D]``."""
    out = []
    for a, b in zip(bounds, bounds[1:]):
        mask = oracle.flash_mask(b - a, b - a, causal=True, window=(-1, -1), align="bottom_right")
        got, _ = oracle.attention(q[None, a:b].double(), k[None, a:b].double(), v[None, a:b].double(), mask)
        out.append(got[0])
    return torch.cat(out)


@pytest.mark.parametrize("bounds", [(0, S), (0, S // 2, S)], ids=["one-document", "two-equal"])
def test_the_fakes_flydsl_varlen_reads_fixed_strides_as_upstream(bounds):
    q, k, v = split_thd()
    cu = torch.tensor(bounds, dtype=torch.int32)
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    want = oracle_thd(q, k, v, bounds)
    with fake_primus_turbo(arch="gfx950") as fake:
        run = fake.module.flash_attn_varlen_func
        strided = run(q, k, v, cu, cu, longest, longest, causal=True)
        assert fake.calls[-1].backend == "FlyDSL"  # the gate reads the boundaries: equal, one document too
        right = run(q, k.contiguous(), v.contiguous(), cu, cu, longest, longest, causal=True)
    torch.testing.assert_close(right.double(), want, atol=2e-2, rtol=2e-2)
    assert (strided.double() - want).abs().max() > 0.1  # read at the wrong addresses, no error


def test_the_dispatch_model_calls_a_strided_flydsl_varlen_call_silently_wrong():
    common = dict(arch="gfx950", entry=VARLEN, dtype="bf16", head_dim=D, head_dim_v=D, heads=HQ, kv_heads=HKV,
                  equal_documents=True)
    assert route(CallFeatures(**common)).ok
    found = route(CallFeatures(**common, contiguous_thd=False))
    assert found.backend == "FlyDSL" and not found.ok and "fixed strides" not in found.problem()
    assert "token stride of Hq*D" in found.problem()
    unequal = route(CallFeatures(**{**common, "equal_documents": None}, contiguous_thd=False))
    assert unequal.backend == "AITER" and unequal.ok  # AITER reads the strides it is given


@pytest.mark.parametrize("build, heads, equal, storage", [
    ("a6a16cd", (16, 2), False, "contiguous-thd"),  # packed-only: FlyDSL when a batch's documents are equal
    ("a6a16cd", (16, 2), True, "contiguous-thd"),
    ("a6a16cd", (8, 4), False, "as-given"),         # group 2: AITER only on a6a16cd
    ("pt509", (8, 4), False, "contiguous-thd"),     # PT #509: FlyDSL takes group 2
    ("pt509", (16, 16), False, "contiguous-thd"),   # and MHA (Hq*D = 1024)
])
def test_a_packed_only_layer_on_gfx950_stores_packed_qkv_contiguous_where_flydsl_can_take_it(
        build, heads, equal, storage):
    layer = facts(num_heads=heads[0], num_kv_heads=heads[1], head_dim=D, dtype="bf16", packed=True)
    with fake_primus_turbo(arch="gfx950", kernels=build):
        plan = build_plan(settings(use_turbo_flex_attention=False, use_turbo_attention=True, packed_sequences=True,
                                   packed_equal_documents=equal), layer)
    assert plan.storage == storage
    if storage == "contiguous-thd" and not equal:
        assert "packed with equal documents: FlyDSL" in plan.kernels


@pytest.mark.parametrize("flex", [False, True], ids=["direct", "flex-turbo"])
@pytest.mark.parametrize("bounds", [(0, S), (0, S // 2, S)], ids=["one-document", "two-equal"])
def test_megatron_packed_calls_on_mi355_compute_right_with_megatrons_split_views(flex, bounds):
    """A packed-only layer without packed_equal_documents, megatron-core's split value, a batch whose
    documents happen to be equal: FlyDSL's varlen kernel takes it, and the output is the oracle's."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from primus_ext.megatron import PrimusTurboLocalAttention

    from .megatron import gpt

    cfg = gpt.config(hidden_size=HQ * D, num_attention_heads=HQ, num_query_groups=HKV, kv_channels=D,
                     params_dtype=BF16, bf16=True)
    q, k, v = split_thd(seed=1)
    cu = torch.tensor(bounds, dtype=torch.int32)
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                             max_seqlen_kv=longest)
    keys = dict(packed_sequences=True, use_turbo_flex_attention=flex, turbo_flex_attention_backend="turbo")
    with fake_primus_turbo(arch="gfx950") as fake:
        module = PrimusTurboLocalAttention(cfg, 1, AttnMaskType.causal, "self", settings=gpt.settings(**keys))
        assert module.plan.storage == "contiguous-thd"
        out = module(q[:, None], k[:, None], v[:, None], None, packed_seq_params=params)
        call = fake.calls[-1]
        assert call.entry == "flash_attn_varlen_func" and call.backend == "FlyDSL"
        assert all(call.args[name].is_contiguous() for name in ("q", "k", "v"))
        ops = fake.module  # the views as megatron-core gives them, straight to the entry: what MI355 computed
        wrong = ops.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True).reshape(S, 1, HQ * D)
        assert fake.calls[-1].backend == "FlyDSL"
        module.core.storage = "as-given"  # as the plan stored them before: our call check refuses them now
        with pytest.raises(UnsupportedInputError, match="token stride of Hq\\*D"):
            module(q[:, None], k[:, None], v[:, None], None, packed_seq_params=params)
    want = oracle_thd(q, k, v, bounds).reshape(S, 1, HQ * D)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    assert (wrong.double() - want).abs().max() > 0.1  # no error, other numbers


def test_a_drop_in_varlen_call_with_a_split_view_flydsl_could_take_is_refused_by_us():
    q, k, v = split_thd()
    cu = torch.tensor([0, S // 4, S], dtype=torch.int32)  # unequal: AITER; equal ones would reach FlyDSL
    layer = facts(num_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype="bf16", packed=True)
    with fake_primus_turbo(arch="gfx950"):
        layer_adapter = adapter(settings(turbo_flex_attention_backend="turbo", packed_sequences=True), layer)
        with pytest.raises(UnsupportedInputError, match="token stride of Hq\\*D") as err:
            layer_adapter.varlen(q, k, v, cu, cu, 3 * S // 4, 3 * S // 4, causal=True)
        assert "B33" in err.value.codes
        # these documents are unequal: the refusal says FlyDSL is reached when they are equal, not that it is here
        assert "whenever its documents are of one length" in str(err.value)
        layer_adapter.varlen(q, k.contiguous(), v.contiguous(), cu, cu, 3 * S // 4, 3 * S // 4, causal=True)


def test_a_documents_call_flattened_from_one_split_sequence_reaches_the_varlen_kernel_contiguous():
    """A dense call of one sequence with a documents pattern flattens to a view; the Turbo backend copies
    it (a split view only), so FlyDSL's fixed strides read the right tokens."""
    from primus_ext.attention.pattern import Pattern
    from primus_ext.backends.base import KernelCall
    from primus_ext.backends.turbo import TurboBackend

    q, k, v = (t[None] for t in split_thd(seed=2))
    pattern = Pattern(-1, 0, boundaries=(0, S // 2, S))
    with fake_primus_turbo(arch="gfx950") as fake:
        out = TurboBackend().dense(q, k, v, KernelCall(pattern=pattern))
        call = fake.calls[-1]
        assert call.entry == "flash_attn_varlen_func" and call.backend == "FlyDSL"
        assert all(call.args[name].is_contiguous() for name in ("q", "k", "v"))
    want = oracle_thd(q[0], k[0], v[0], (0, S // 2, S))
    torch.testing.assert_close(out[0].double(), want, atol=2e-2, rtol=2e-2)


def test_both_builds_are_modelled_and_the_fake_follows_each():
    assert BUILD_A6A16CD != BUILD_PT509
    with fake_primus_turbo(arch="gfx950", kernels="pt509") as fake:
        q, k, v = split_thd(hq=8, hkv=8)
        cu = torch.tensor([0, S], dtype=torch.int32)
        fake.module.flash_attn_varlen_func(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, S, S, causal=True)
        assert fake.calls[-1].backend == "FlyDSL"  # MHA on PT #509
    with fake_primus_turbo(arch="gfx950") as fake:
        fake.module.flash_attn_varlen_func(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, S, S, causal=True)
        assert fake.calls[-1].backend == "AITER"
