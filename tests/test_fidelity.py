"""Each row of the fidelity table (`primus_ext.testing.fidelity`) holds: the fake does what
upstream does, and the plan or call path does what the row says.  docs/fidelity.md is the table."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from primus_ext.backends.dispatch import VARLEN, Selection, default_scale, route
from primus_ext.errors import UnsupportedConfigError, UnsupportedInputError
from primus_ext.plan import build_plan
from primus_ext.testing import fake_primus_turbo
from primus_ext.testing.fidelity import FIDELITY, markdown

from .fidelity_round3_checks import CHECKS, check, features
from .helpers import adapter, facts, settings

BF16 = torch.bfloat16
DOC = Path(__file__).resolve().parent.parent / "docs" / "fidelity.md"


def sbhd(s: int = 8, b: int = 2, hq: int = 4, hkv: int = 2, d: int = 16, dtype=BF16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, b, h, d, generator=gen).to(dtype).transpose(0, 1) for h in (hq, hkv, hkv)]


def aiter_ops():
    return torch.ops.primus_turbo


def aiter_forward(q, k, v, sink=None, fmt="bshd", window=(-1, 0)):
    return aiter_ops().attention_aiter_forward_impl(q, k, v, 0.0, q.shape[-1] ** -0.5, True, window[0], window[1],
                                                    None, None, True, False, q.shape[1], k.shape[1], sink, fmt)


@check("aiter-can-handle")
def _():
    q, k, v = (t.contiguous().float() for t in sbhd())
    q8 = torch.randn(2, 8, 4, 12)  # a sink on head dims that are no power of two: can_handle's own refusal
    with fake_primus_turbo(arch="gfx942") as fake:
        with pytest.raises(RuntimeError, match="only support fp16, bf16 and fp8_e4m3"):  # aiter's CK forward
            aiter_forward(q, k, v)
        out, lse = aiter_forward(q.to(BF16), k.to(BF16), v.to(BF16))[:2]
        grads = [torch.empty_like(t) for t in (q, k, v)]
        with pytest.raises(RuntimeError, match="only support fp16 and bf16"):  # aiter's CK / asm backward
            aiter_ops().attention_aiter_backward_impl(out.float(), q, k, v, out.float(), lse, *grads, 0.0, 0.25, True,
                                                      -1, 0, None, None, False, None, True, 1, None, None, None, "bshd")
        with pytest.raises(RuntimeError, match="cannot say"):  # a sink: aiter's Triton kernels
            aiter_forward(q, k, v, sink=torch.zeros(4))
        with pytest.raises(ValueError, match="cannot handle the given inputs"):
            aiter_forward(q8, torch.randn(2, 8, 4, 12), torch.randn(2, 8, 4, 8), sink=torch.zeros(4))
        with pytest.raises(ValueError, match="No compatible backend found for FlashAttnDenseDispatcher"):
            fake.module.flash_attn_func(q, k, v, causal=True)  # the dispatcher's gate does check the dtype
        with pytest.raises(UnsupportedConfigError) as err:
            build_plan(settings(turbo_flex_attention_backend="turbo"), facts(dtype="fp32", packed=False))
    assert "B33" in err.value.codes


@check("aiter-out-layout")
def _():
    q, k, v = (t.contiguous() for t in sbhd())
    with fake_primus_turbo(arch="gfx942"):
        out = aiter_forward(q, k, v, fmt="sbhd")[0]
    assert out.transpose(0, 1).is_contiguous() and not out.is_contiguous()


@check("aiter-rng-sink")
def _():
    q, k, v = (t.contiguous() for t in sbhd())
    sink = torch.zeros(4)
    with fake_primus_turbo(arch="gfx942"):
        out, lse, _, rng = aiter_forward(q, k, v, sink=sink)
        assert (rng.device.type, rng.dtype, tuple(rng.shape)) == ("cpu", torch.int64, (2,))
        grads = [torch.empty_like(t) for t in (q, k, v)]
        with pytest.raises(AssertionError, match="CPU int64 tensor of shape"):
            aiter_ops().attention_aiter_backward_impl(out, q, k, v, out, lse, *grads, 0.0, 0.25, True, -1, 0, None,
                                                      None, False, None, True, 1, None, torch.zeros(4), sink, "bshd")
    # the compiled path hands the forward's own rng_state over: tests/compile/test_compiled_step.py


@check("aiter-undeclared-writes")
def _():
    q, k, v = (t.contiguous() for t in sbhd())
    sink = torch.randn(4)
    with fake_primus_turbo(arch="gfx942"):
        out, lse, _, rng = aiter_forward(q, k, v, sink=sink)
        dsink = torch.zeros(4)
        grads = [torch.empty_like(t) for t in (q, k, v)]
        aiter_ops().attention_aiter_backward_impl(torch.ones_like(out), q, k, v, out, lse, *grads, 0.0, 0.25, True,
                                                  -1, 0, None, None, False, rng, True, 1, None, dsink, sink, "bshd")
    assert dsink.abs().sum() > 0  # written in place, as the real op does, though not declared


@check("aiter-sink-right-window")
def _():
    found = route(features(arch="gfx942", kv_heads=4, heads=4, sink=True, causal=False, window=(4, 4)))
    assert found.backend == "AITER" and found.defects
    with fake_primus_turbo(arch="gfx942"):
        with pytest.raises(UnsupportedConfigError) as err:
            build_plan(settings(turbo_flex_attention_backend="turbo", use_sink_attention=True,
                                turbo_flex_attention_mask_mod="primus_ext.attention.masks:sliding_window",
                                turbo_flex_attention_mask_mod_kwargs={"left": 4, "right": 4}),
                       facts(head_dim=16, dtype="bf16", packed=False, causal=False, attn_mask_type="no_mask"))
    assert "B33" in err.value.codes


@check("aiter-deterministic-sink")
def _():
    q, k, v = sbhd()
    with fake_primus_turbo(arch="gfx942") as fake:
        with pytest.raises(AssertionError, match="deterministic and sink"):
            fake.module.flash_attn_func(*(t.contiguous() for t in (q, k, v)), causal=True, deterministic=True,
                                        sink=torch.zeros(4))
        with pytest.raises(UnsupportedConfigError) as err:
            build_plan(settings(turbo_flex_attention_backend="turbo", use_sink_attention=True,
                                deterministic_mode=True), facts(head_dim=16, dtype="bf16", packed=False))
    assert "B33" in err.value.codes


@check("aiter-varlen-int32")
def _():
    q, k, v = (t[0].contiguous() for t in sbhd(b=1))
    cu64 = torch.tensor([0, 3, 8])
    with fake_primus_turbo(arch="gfx942") as fake:
        with pytest.raises(ValueError, match="int32"):
            fake.module.flash_attn_varlen_func(q, k, v, cu64, cu64, 5, 5, causal=True)
        run = adapter(settings(turbo_flex_attention_backend="turbo"), facts(head_dim=16, dtype="bf16", packed=True))
        run.varlen(q, k, v, causal=True, cu_seqlens_q=cu64, cu_seqlens_k=cu64, max_seqlen_q=None, max_seqlen_k=None)
        assert fake.calls[-1].args["cu_seqlens_q"].dtype == torch.int32


@check("aiter-pad8")
def _():
    q, k, v = (t.contiguous() for t in sbhd(d=12))
    with fake_primus_turbo(arch="gfx942"):
        with pytest.raises(RuntimeError, match="padded to a multiple of 8"):
            aiter_forward(q, k, v)
    from primus_ext.backends.turbo_kernels import _pad8

    assert _pad8(q).shape[-1] == 16


@check("aiter-v3-flags")
def _():
    from primus_ext.backends.aiter_flags import v3_flags

    saved = os.environ.pop("PRIMUS_TURBO_ATTN_V3_ATOMIC_FP32", None)
    try:
        assert v3_flags("gfx942") == (True, 1) and v3_flags("gfx950") == (True, 0)
        os.environ["PRIMUS_TURBO_ATTN_V3_ATOMIC_FP32"] = "0"
        assert v3_flags("gfx950") == (False, 0)
        os.environ["PRIMUS_TURBO_ATTN_V3_ATOMIC_FP32"] = "maybe"  # upstream: anything else than 0/1 is 1
        assert v3_flags("gfx942") == (True, 1)
    finally:
        os.environ.pop("PRIMUS_TURBO_ATTN_V3_ATOMIC_FP32", None)
        if saved is not None:
            os.environ["PRIMUS_TURBO_ATTN_V3_ATOMIC_FP32"] = saved


@check("layout-three-tensors")
def _():
    q, k, v = sbhd()
    with fake_primus_turbo() as fake:
        with pytest.raises(AssertionError, match="share one layout"):
            fake.module.flash_attn_func(q, k.contiguous(), v.contiguous(), causal=True)
        with pytest.raises(UnsupportedInputError, match="share one layout"):
            adapter(settings(turbo_flex_attention_backend="turbo"), facts(head_dim=16))(q, k.contiguous(), v, causal=True)


@check("flydsl-gate-order")
def _():
    assert route(features(contiguous_sbhd=False)).backend == "FlyDSL"  # taken, then refused
    assert not route(features(contiguous_sbhd=False)).ok
    assert route(features(sbhd_storage=False)).backend == "AITER"


@check("flydsl-contiguous")
def _():
    q, k, v = sbhd(s=128, hq=16, hkv=2, d=64)
    v_split = torch.randn(128, 2, 2, 3 * 64).to(BF16)[..., :64].transpose(0, 1)
    with fake_primus_turbo(arch="gfx950") as fake:
        with pytest.raises(AssertionError, match="SBHD tensors must be contiguous"):
            fake.module.flash_attn_func(q, k, v_split, causal=True)
        plan = build_plan(settings(turbo_flex_attention_backend="turbo"),
                          facts(num_heads=16, num_kv_heads=2, head_dim=64, dtype="bf16", packed=False))
    assert plan.storage == "contiguous-sbhd"


@check("flydsl-window-64")
def _():
    assert route(features(window=(63, 0))).backend == "AITER"
    assert route(features(window=(64, 0))).backend == "FlyDSL"


@check("flydsl-gqa-group")
def _():
    assert [route(features(heads=h)).backend for h in (4, 8, 16, 24)] == ["AITER", "AITER", "FlyDSL", "AITER"]


@check("flydsl-scale")
def _():
    assert default_scale(0.125 + 9e-7, 64) and not default_scale(0.125 + 2e-6, 64)


@check("flydsl-varlen-equal")
def _():
    assert route(features(entry=VARLEN, equal_documents=True)).backend == "FlyDSL"
    assert route(features(entry=VARLEN, equal_documents=None)).backend == "AITER"


@check("aiter-varlen-no-sink")
def _():
    assert route(features(arch="gfx942", entry=VARLEN, sink=True)).backend is None
    with fake_primus_turbo(arch="gfx942"):
        with pytest.raises(UnsupportedConfigError) as err:
            build_plan(settings(turbo_flex_attention_backend="turbo", use_sink_attention=True),
                       facts(head_dim=16, dtype="bf16", packed=True))
    assert "B33" in err.value.codes


@check("dispatch-order")
def _():
    assert route(features()).backend == "FlyDSL"
    assert route(features(), Selection(pin="AITER")).backend == "AITER"
    assert set(route(features(), Selection(autotune=True)).candidates) == {"FlyDSL", "AITER", "HipKittens"}


@check("pin-cannot-handle")
def _():
    q, k, v = (t.contiguous().transpose(0, 1).contiguous().transpose(0, 1) for t in sbhd(s=64, d=64))
    with fake_primus_turbo(arch="gfx950") as fake:
        from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager

        GlobalBackendManager.set_attn_backend(BackendType.FLYDSL)
        with pytest.raises(ValueError, match="User specified backend FLYDSL cannot handle"):
            fake.module.flash_attn_func(q, k, v, causal=True)  # GQA 2: not FlyDSL's
        with pytest.raises(UnsupportedConfigError, match="pinned"):
            build_plan(settings(turbo_flex_attention_backend="turbo"), facts(head_dim=64, dtype="bf16", packed=False))


@check("autotune-any")
def _():
    tuned = route(features(sink=True, deterministic=True), Selection(autotune=True))
    assert not tuned.ok and tuned.backend == "AITER"  # FlyDSL would take it; AITER may be kept and asserts


@check("fp8-deterministic")
def _():
    with fake_primus_turbo():
        with pytest.raises(UnsupportedConfigError) as err:
            build_plan(settings(use_turbo_flex_attention=False, enable_turbo_attention_float8=True,
                                deterministic_mode=True), facts(causal=False, attn_mask_type="no_mask"))
    assert "B24-fp8" in err.value.codes


@check("gfx942-strided")
def _():
    q, k, v = sbhd(d=16)
    with fake_primus_turbo(arch="gfx942") as fake:
        with pytest.raises(NotImplementedError, match="cannot reproduce"):
            fake.module.flash_attn_func(q, k, v, causal=True)
        run = adapter(settings(turbo_flex_attention_backend="turbo"), facts(head_dim=16, dtype="bf16", packed=False))
        assert run.plan.storage == "contiguous-bshd"
        with pytest.raises(UnsupportedInputError, match="corrupts the gradients"):
            run(q, k, v, causal=True)


@check("ck-alibi")
def _():
    q, k, v = (t.contiguous().float() for t in sbhd())
    slopes = torch.full((4,), 0.5)
    with fake_primus_turbo() as fake:
        full = fake.module.flash_attn_func(q, k, v, alibi_slopes=slopes)
        flipped = fake.module.flash_attn_func(q.flip(1), k.flip(1), v.flip(1), alibi_slopes=slopes).flip(1)
    torch.testing.assert_close(full, flipped)  # a symmetric bias: reversing the sequence changes nothing


@check("triton-alibi")
def _():
    q, k, v = (t.contiguous().float() for t in sbhd())
    slopes, sink = torch.full((4,), 0.5), torch.zeros(4)
    with fake_primus_turbo() as fake:
        full = fake.module.flash_attn_func(q, k, v, alibi_slopes=slopes, sink=sink)
        flipped = fake.module.flash_attn_func(q.flip(1), k.flip(1), v.flip(1), alibi_slopes=slopes,
                                              sink=sink).flip(1)
    torch.testing.assert_close(full, flipped)


@check("cp-shard-order")
def _():
    # tests/megatron/test_cp_groups.py feeds megatron-core's own split over two gloo processes; here, the
    # fact itself: Megatron's rank 0 holds chunks 0 and 3 of 4, not the first half.
    from megatron.core.utils import get_batch_on_this_cp_rank  # noqa: F401  (the function the test calls)

    tokens = torch.arange(8).view(1, 8)
    chunks = tokens.view(1, 4, 2)
    assert torch.equal(chunks[:, [0, 3]].reshape(1, -1), torch.tensor([[0, 1, 6, 7]]))


@check("aiter-sink-left-zero")
def _():
    q, k, v = (t.contiguous() for t in sbhd())
    sink = torch.zeros(4)
    with fake_primus_turbo(arch="gfx942"):
        zero = aiter_forward(q, k, v, sink=sink, window=(0, 0))[0]
        causal = aiter_forward(q, k, v, sink=sink, window=(-1, 0))[0]
        with pytest.raises(UnsupportedConfigError) as err:
            build_plan(settings(turbo_flex_attention_backend="turbo", use_sink_attention=True,
                                turbo_flex_attention_mask_mod="primus_ext.attention.masks:sliding_window",
                                turbo_flex_attention_mask_mod_kwargs={"left": 0, "right": 0}),
                       facts(dtype="bf16", packed=False))
    torch.testing.assert_close(zero, causal)  # the kernel's answer: no left bound
    assert "B33" in err.value.codes


@check("autotune-cache-key")
def _():
    tuned = Selection(autotune=True)
    found = route(features(dropout=0.1), tuned)
    assert "FlyDSL" in found.candidates and not found.ok and "autotune may cache FlyDSL" in found.problem()
    assert route(features(dropout=0.1)).backend == "AITER"  # without autotune, AITER takes dropout


@check("flydsl-dv")
def _():
    found = route(features(head_dim=128, head_dim_v=64))
    assert found.backend == "FlyDSL" and found.defects
    q = torch.randn(1, 8, 16, 128).to(BF16)
    k, v = torch.randn(1, 8, 2, 128).to(BF16), torch.randn(1, 8, 2, 64).to(BF16)
    with fake_primus_turbo(arch="gfx950") as fake:
        with pytest.raises(NotImplementedError, match="cannot reproduce"):
            fake.module.flash_attn_func(q, k, v, causal=True)


def big_logit_rows(s: int = 64, d: int = 64):
    """bshd views of contiguous sbhd bf16 q, k, v (Hq 8, Hkv 2) whose query row 40 of batch 0, head 1 has
    logits past 88.7; the online softmax takes them (a softmax with a running max is exact there)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(s, 2, h, d, generator=gen) for h in (8, 2, 2))
    q[40, 0, 1] = 30 * k[7, 0, 0]  # s * scale = 30 |k|^2 / 8, about 240
    return [t.to(BF16).transpose(0, 1) for t in (q, k, v)]


@check("hipkittens-zero-max")
def _():
    q, k, v = big_logit_rows()
    with fake_primus_turbo(arch="gfx950") as fake:
        from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager

        GlobalBackendManager.set_attn_backend(BackendType.HIPKITTENS)
        out, lse = fake.module.flash_attn_func(q, k, v, causal=True, return_lse=True)
        assert fake.calls[-1].backend == "HipKittens"
        from primus_turbo.hipkittens.attention import hipkittens_attn_forward

        kernel_out, kernel_lse = hipkittens_attn_forward(*(t.transpose(0, 1) for t in (q, k, v)))
        build_plan(settings(turbo_flex_attention_backend="turbo"),  # not refused: logits are not known at build
                   facts(num_heads=8, num_kv_heads=2, head_dim=64, dtype="bf16", packed=False))
        GlobalBackendManager.set_attn_backend(BackendType.AITER)
        online = fake.module.flash_attn_func(q, k, v, causal=True)
    bad = ~torch.isfinite(out).all(-1)
    assert bad.nonzero().tolist() == [[0, 40, 1]] and bool(out[0, 40, 1].isnan().all()) and lse[0, 1, 40] == float("inf")
    assert torch.isfinite(online).all()
    torch.testing.assert_close(kernel_out.transpose(0, 1), out, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(kernel_lse.squeeze(2), lse, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(out[~bad], online[~bad], rtol=0, atol=0)  # every other row: the online softmax
    assert "overflows for large logits" in (DOC.parent / "capabilities.md").read_text()


@check("set-attn-backend-none")
def _():
    from primus_ext.backends.turbo import kernel_selection

    saved = os.environ.get("PRIMUS_TURBO_ATTN_BACKEND")
    os.environ["PRIMUS_TURBO_ATTN_BACKEND"] = "aiter"
    try:
        with fake_primus_turbo(arch="gfx950"):
            from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager, PrecisionType

            bucket = PrecisionType.BF16_FP16_FP32
            for precision in (None, PrecisionType.FP8, bucket):
                GlobalBackendManager.set_attn_backend(BackendType.FLYDSL)
                GlobalBackendManager.set_attn_backend(BackendType.HIPKITTENS, precision=PrecisionType.FP8)
                assert GlobalBackendManager.get_attn_backend(bucket) is BackendType.FLYDSL
                GlobalBackendManager.set_attn_backend(None, precision=precision)
                assert GlobalBackendManager._attn_backend is None
                assert GlobalBackendManager.get_attn_backend(bucket) is BackendType.AITER  # the environment's
                assert GlobalBackendManager.get_attn_backend(PrecisionType.FP8) is BackendType.AITER
                assert kernel_selection().pin == "AITER"
    finally:
        os.environ.pop("PRIMUS_TURBO_ATTN_BACKEND", None)
        if saved is not None:
            os.environ["PRIMUS_TURBO_ATTN_BACKEND"] = saved


def test_every_fact_has_a_check_and_every_check_a_fact():
    ids = [f.id for f in FIDELITY]
    assert len(ids) == len(set(ids))
    assert set(ids) == set(CHECKS), (sorted(set(ids) - set(CHECKS)), sorted(set(CHECKS) - set(ids)))


@pytest.mark.parametrize("fact_id", [f.id for f in FIDELITY])
def test_the_fake_and_the_plan_hold_the_fact(fact_id):
    CHECKS[fact_id]()


def test_docs_fidelity_md_is_the_table():
    assert markdown() in DOC.read_text(), "regenerate docs/fidelity.md's table from primus_ext.testing.fidelity"
