"""B36: ``packed_equal_documents`` declares packed documents of one length, checked per call.

FlyDSL takes a varlen call on gfx950 only when every document has one length (upstream's
``_uniform_cu_seqlens``), and only FlyDSL's varlen kernel takes a learned sink; so without the
declaration a packed sink layer is refused there (B33), with it the layer builds, its packed
calls run on FlyDSL, and a call that breaks the declaration is refused with our error before
any kernel (no host read of the boundaries: ``documents * max_seqlen == tokens`` from the
shapes, and the on-device check that no document is longer than ``max_seqlen``).
"""

from __future__ import annotations

import pytest
import torch

from primus_ext.call.adapter import TurboFlexAttention
from primus_ext.errors import UnsupportedConfigError, UnsupportedInputError
from primus_ext.plan import build_plan
from primus_ext.testing import fake_primus_turbo

from .fuzz import oracle as fuzz_oracle
from .helpers import facts, packed_qkv, settings

BF16 = torch.bfloat16
HQ, HKV, D, T = 8, 1, 64, 64  # FlyDSL's shape: GQA 8, head dim 64, bf16
LAYER = dict(num_heads=HQ, num_kv_heads=HKV, head_dim=D, seq_length=T, dtype="bf16", packed=True)
KEYS = dict(turbo_flex_attention_backend="turbo", turbo_arch="gfx950", use_sink_attention=True)


def plan(**keys):
    return build_plan(settings(**{**KEYS, **keys}), facts(**LAYER))


def test_without_the_declaration_a_packed_sink_layer_is_refused_on_gfx950():
    with fake_primus_turbo(arch="gfx950"):
        with pytest.raises(UnsupportedConfigError) as err:
            plan()
    assert "B33" in err.value.codes
    assert "packed_equal_documents" in str(err.value) or "equal length" in str(err.value)


def test_with_it_the_layer_runs_on_flydsl_and_equals_the_oracle_forward_and_backward():
    q, k, v = (t.to(BF16).requires_grad_(True) for t in packed_qkv(T, HQ, HKV, D))
    sink = torch.randn(HQ, generator=torch.Generator().manual_seed(4)).requires_grad_(True)
    bounds = [0, 16, 32, 48, 64]
    cu = torch.tensor(bounds, dtype=torch.int32)
    with fake_primus_turbo(arch="gfx950") as fake:
        layer = plan(packed_equal_documents=True)
        assert layer.equal_documents and any("FlyDSL" in k for k in layer.kernels), layer.kernels
        out = TurboFlexAttention(layer).varlen(q, k, v, causal=True, sink=sink, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                        max_seqlen_q=16, max_seqlen_k=16)
        assert fake.calls[-1].entry == "flash_attn_varlen_func" and fake.calls[-1].backend == "FlyDSL"
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(BF16)
        got = torch.autograd.grad(out, (q, k, v, sink), grad)
    exact = [t.detach().double().requires_grad_(True) for t in (q, k, v, sink)]
    doc = torch.bucketize(torch.arange(T), torch.tensor(bounds[1:]), right=True)
    i, j = torch.arange(T).view(-1, 1), torch.arange(T).view(1, -1)
    allowed = (doc.view(-1, 1) == doc.view(1, -1)) & (j <= i)  # causal inside each document
    want = fuzz_oracle.attention(*(t[None] for t in exact[:3]), allowed, sink=exact[3])[0][0]
    assert fuzz_oracle.mismatch(out, want, fuzz_oracle.OUTPUT_TOL[BF16]) is None
    wants = torch.autograd.grad(want, exact, grad.double())
    for name, g, w in zip(("dq", "dk", "dv", "dsink"), got, wants):
        assert fuzz_oracle.mismatch(g, w, fuzz_oracle.GRAD_TOL[BF16]) is None, name


@pytest.mark.parametrize("bounds, longest, why", [
    ([0, 16, 40, 64], 24, "not all of one length"),   # 3 x 24 != 64: unequal documents
    ([0, 32, 64], 40, "not all of one length"),        # max_seqlen looser than the documents
    ([0, 32, 64], None, "not all of one length"),      # max_seqlen left out (bounded by the token count)
])
def test_a_call_that_breaks_the_declaration_is_refused_by_us(bounds, longest, why):
    q, k, v = (t.to(BF16) for t in packed_qkv(T, HQ, HKV, D))
    cu = torch.tensor(bounds, dtype=torch.int32)
    with fake_primus_turbo(arch="gfx950") as fake:
        run = TurboFlexAttention(plan(packed_equal_documents=True))
        with pytest.raises(UnsupportedInputError, match=why) as err:
            run.varlen(q, k, v, causal=True, sink=torch.zeros(HQ), cu_seqlens_q=cu, cu_seqlens_k=cu,
                max_seqlen_q=longest, max_seqlen_k=longest)
        assert "packed_equal_documents" in err.value.settings and "B36.unequal" in err.value.codes
        assert not fake.calls  # refused before any kernel


def test_a_document_longer_than_max_seqlen_fails_the_device_check_even_when_the_count_fits():
    """4 x 16 == 64 tokens, but one document is 20 long: the on-device boundary check refuses it."""
    q, k, v = (t.to(BF16) for t in packed_qkv(T, HQ, HKV, D))
    cu = torch.tensor([0, 20, 32, 48, 64], dtype=torch.int32)
    with fake_primus_turbo(arch="gfx950") as fake:
        run = TurboFlexAttention(plan(packed_equal_documents=True))
        with pytest.raises(UnsupportedInputError, match="max_seqlen"):
            run.varlen(q, k, v, causal=True, sink=torch.zeros(HQ), cu_seqlens_q=cu, cu_seqlens_k=cu,
                max_seqlen_q=16, max_seqlen_k=16)
        assert not fake.calls


def test_a_tensor_max_seqlen_is_refused_with_the_declaration():
    q, k, v = (t.to(BF16) for t in packed_qkv(T, HQ, HKV, D))
    cu = torch.tensor([0, 32, 64], dtype=torch.int32)
    with fake_primus_turbo(arch="gfx950"):
        run = TurboFlexAttention(plan(packed_equal_documents=True))
        with pytest.raises(UnsupportedInputError, match="is a tensor") as err:
            run.varlen(q, k, v, causal=True, sink=torch.zeros(HQ), cu_seqlens_q=cu, cu_seqlens_k=cu,
                max_seqlen_q=torch.tensor(32), max_seqlen_k=torch.tensor(32))
        assert "B36.max-tensor" in err.value.codes


def test_the_declaration_on_a_dense_only_layer_is_refused_at_build():
    with pytest.raises(UnsupportedConfigError) as err:
        build_plan(settings(packed_equal_documents=True), facts(packed=False))
    assert "B36" in err.value.codes and "packed_equal_documents" in err.value.settings


def test_the_reference_backend_checks_the_declaration_too():
    """Nothing is silently ignored: a call breaking the declaration is refused on every backend."""
    q, k, v = packed_qkv(T, 4, 2, 8)
    cu = torch.tensor([0, 16, 64], dtype=torch.int32)
    run = TurboFlexAttention(build_plan(settings(packed_equal_documents=True), facts(packed=True)))
    with pytest.raises(UnsupportedInputError, match="not all of one length"):
        run.varlen(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=48, max_seqlen_k=48)
    run.varlen(q, k, v, causal=True, cu_seqlens_q=torch.tensor([0, 32, 64], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 32, 64], dtype=torch.int32), max_seqlen_q=32, max_seqlen_k=32)


@pytest.mark.parametrize("flex", [False, True], ids=["direct", "flex-turbo"])
def test_a_megatron_packed_sink_layer_on_gfx950_runs_on_flydsl_with_the_declaration(flex):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from primus_ext.megatron import PrimusTurboLocalAttention

    from .megatron import gpt

    cfg = gpt.config(hidden_size=HQ * D, num_attention_heads=HQ, num_query_groups=HKV, kv_channels=D,
                     params_dtype=BF16, bf16=True)
    path = dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="turbo") if flex else {}
    keys = dict(path, turbo_arch="gfx950", use_sink_attention=True, packed_sequences=True)
    cu = torch.tensor([0, 32, 64], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=32, max_seqlen_kv=32)
    q, k, v = (t.to(BF16)[:, None] for t in packed_qkv(T, HQ, HKV, D))  # [T, 1, H, D], as Megatron passes thd
    with fake_primus_turbo(arch="gfx950") as fake:
        with pytest.raises(UnsupportedConfigError):
            PrimusTurboLocalAttention(cfg, 1, AttnMaskType.causal, "self", settings=gpt.settings(**keys))
        module = PrimusTurboLocalAttention(cfg, 1, AttnMaskType.causal, "self",
                                           settings=gpt.settings(packed_equal_documents=True, **keys))
        out = module(q, k, v, None, packed_seq_params=params)
        assert fake.calls[-1].backend == "FlyDSL"
        unequal = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 16, 64], dtype=torch.int32),
                                  max_seqlen_q=48, max_seqlen_kv=48)
        unequal.cu_seqlens_kv = unequal.cu_seqlens_q
        with pytest.raises(UnsupportedInputError, match="not all of one length"):
            module(q, k, v, None, packed_seq_params=unequal)
    assert out.shape == (T, 1, HQ * D)


def test_the_fake_drops_flydsls_dsink_as_upstream_does_where_max_seqlen_is_looser():
    """Upstream FlyDSL computes dsink only when documents * max_seqlen == tokens: with equal documents
    but a looser max_seqlen the sink silently gets no gradient.  The fake does the same, and the
    declaration's call check refuses exactly those calls."""
    q, k, v = (t.to(BF16).requires_grad_(True) for t in packed_qkv(T, HQ, HKV, D))
    cu = torch.tensor([0, 32, 64], dtype=torch.int32)
    with fake_primus_turbo(arch="gfx950") as fake:
        import primus_turbo.pytorch.ops as ops

        grads = {}
        for longest in (32, 40):
            sink = torch.zeros(HQ, requires_grad=True)
            out = ops.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True, sink=sink)
            assert fake.calls[-1].backend == "FlyDSL"
            out.float().sum().backward()
            grads[longest] = sink.grad
        assert grads[32] is not None and grads[32].abs().sum() > 0
        assert grads[40] is None  # the real library's silent defect, reproduced
