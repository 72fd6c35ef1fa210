"""The registry of the fidelity table's checks (`check`, `CHECKS`), and the checks of the rows read on 2026-12-02
(`primus_ext.testing.fidelity_round3`); tests/test_fidelity.py adds the others and runs them all.  Each holds
what its row says: the fake does what upstream does, the plan what the row's last column says.  The fuller
tests are named where they live."""

from __future__ import annotations

import inspect
from typing import Callable

import pytest
import torch

from primus_ext.backends.dispatch import (AITER_DENSE, BUILD_PT509, DENSE, VARLEN, CallFeatures, Selection, route)
from primus_ext.errors import UnsupportedConfigError
from primus_ext.plan import build_plan
from primus_ext.testing import fake_primus_turbo

from .helpers import facts, qkv, settings

BF16 = torch.bfloat16
CHECKS: dict[str, Callable[[], None]] = {}


def check(fact_id: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
    def register(fn: Callable[[], None]) -> Callable[[], None]:
        CHECKS[fact_id] = fn
        return fn
    return register


def features(**over) -> CallFeatures:
    base = dict(arch="gfx950", entry=DENSE, dtype="bf16", head_dim=64, head_dim_v=64, heads=16, kv_heads=2)
    return CallFeatures(**{**base, **over})


def split_thd(tokens: int = 32, hq: int = 16, hkv: int = 2, d: int = 64):
    fused = torch.randn(tokens, hkv, (hq // hkv + 2) * d, generator=torch.Generator().manual_seed(0)).to(BF16)
    q, k, v = fused.split([hq // hkv * d, d, d], dim=-1)
    return q.reshape(tokens, hq, d), k, v


@check("aiter-pinned-tag")
def _():
    rows = AITER_DENSE.refuses
    assert any("l.78-79" in c.text for c in rows) and any("mha_fwd_kernels.cu l.275" in c.text for c in rows)


@check("flydsl-varlen-strides")
def _():
    # tests/test_flydsl_varlen_strides.py: the Megatron module on megatron-core's views, and the drop-in refusal
    q, k, v = split_thd()
    cu = torch.tensor([0, 32], dtype=torch.int32)
    with fake_primus_turbo(arch="gfx950") as fake:
        strided = fake.module.flash_attn_varlen_func(q, k, v, cu, cu, 32, 32, causal=True)
        right = fake.module.flash_attn_varlen_func(q, k.contiguous(), v.contiguous(), cu, cu, 32, 32, causal=True)
        assert fake.calls[-1].backend == "FlyDSL"
        plan = build_plan(settings(use_turbo_flex_attention=False, use_turbo_attention=True, packed_sequences=True),
                          facts(num_heads=16, num_kv_heads=2, head_dim=64, dtype="bf16", packed=True))
    assert (strided.float() - right.float()).abs().max() > 0.1 and plan.storage == "contiguous-thd"
    assert not route(features(entry=VARLEN, equal_documents=True, contiguous_thd=False)).ok


@check("flydsl-varlen-runtime")
def _():
    q, k, v = (t.contiguous() for t in split_thd())
    with fake_primus_turbo(arch="gfx950") as fake:
        for bounds, backend in (([0, 32], "FlyDSL"), ([0, 16, 32], "FlyDSL"), ([0, 10, 32], "AITER")):
            cu = torch.tensor(bounds, dtype=torch.int32)
            fake.module.flash_attn_varlen_func(q, k, v, cu, cu, 32, 32, causal=True)
            assert fake.calls[-1].backend == backend, bounds
        plan = build_plan(settings(use_turbo_flex_attention=False, use_turbo_attention=True, packed_sequences=True),
                          facts(num_heads=16, num_kv_heads=2, head_dim=64, dtype="bf16", packed=True))
    assert "packed with equal documents: FlyDSL" in plan.kernels


@check("aiter-sink-bias")
def _():
    assert not route(features(arch="gfx942", sink=True, bias=True)).ok
    q, k, v = qkv(d=64, dtype=BF16)
    with fake_primus_turbo(arch="gfx942") as fake:
        with pytest.raises(ValueError, match="any bias"):
            fake.module.flash_attn_func(q, k, v, causal=True, sink=torch.zeros(4), bias=torch.zeros(16, 16, dtype=BF16))


@check("aiter-sink-alibi")
def _():
    # tests/test_alibi_kernels.py: the ALiBi hook with a sink refused at build on both archs
    q, k, v = qkv(d=64, dtype=BF16)
    with fake_primus_turbo(arch="gfx942") as fake:
        with pytest.raises(IndexError):
            fake.module.flash_attn_func(q, k, v, causal=True, sink=torch.zeros(4), alibi_slopes=torch.ones(4))
    assert not route(features(sink=True, alibi=True, kv_heads=16)).ok


@check("aiter-sink-1d")
def _():
    q, k, v = qkv(d=64, dtype=BF16)
    with fake_primus_turbo(arch="gfx942") as fake:
        with pytest.raises((ValueError, RuntimeError, AssertionError)):
            fake.module.flash_attn_func(q, k, v, causal=True, sink=torch.zeros(8))  # not one per query head
        fake.module.flash_attn_func(q, k, v, causal=True, sink=torch.zeros(4))


@check("ck-bias-alibi")
def _():
    q, k, v = qkv(d=64, dtype=BF16)
    with fake_primus_turbo(arch="gfx942") as fake:
        with pytest.raises(RuntimeError, match="cannot apply bias and alibi"):
            fake.module.flash_attn_func(q, k, v, causal=True, bias=torch.zeros(16, 16, dtype=BF16),
                                        alibi_slopes=torch.ones(4))


@check("ck-head-dims")
def _():
    assert not route(features(arch="gfx942", head_dim=264, head_dim_v=264)).ok
    assert route(features(arch="gfx942", head_dim=12, head_dim_v=12)).ok  # padded to 16 before CK sees it
    with fake_primus_turbo(arch="gfx942"):
        with pytest.raises(UnsupportedConfigError) as err:
            build_plan(settings(turbo_flex_attention_backend="turbo"), facts(head_dim=288, dtype="bf16"))
        build_plan(settings(turbo_flex_attention_backend="turbo"), facts(head_dim=12, dtype="bf16"))
    assert "B33" in err.value.codes


def _fp8_refusal(head_dim: int, dtype: str) -> UnsupportedConfigError:
    with pytest.raises(UnsupportedConfigError) as err:
        build_plan(settings(use_turbo_flex_attention=False, enable_turbo_attention_float8=True),
                   facts(head_dim=head_dim, dtype=dtype, causal=False, attn_mask_type="no_mask"))
    return err.value


@check("fp8-bf16-output")
def _():
    q, k, v = qkv(d=64, dtype=torch.float16)
    with fake_primus_turbo() as fake:
        assert fake.module.flash_attn_fp8_func(q, k, v).dtype == BF16
        assert "fp8-dtype" in _fp8_refusal(64, "fp16").codes


@check("fp8-head-dims")
def _():
    with fake_primus_turbo() as fake:
        with pytest.raises(AssertionError, match=">= 32"):
            fake.module.flash_attn_fp8_func(*qkv(d=16, dtype=BF16))
        assert "fp8-head-dim" in _fp8_refusal(16, "bf16").codes
        q, k, v = qkv(d=64, dtype=BF16)
        sbhd = [t.transpose(0, 1).contiguous().transpose(0, 1) for t in (q, k, v)]
        assert not torch.allclose(fake.module.flash_attn_fp8_func(*sbhd).float(),
                                  fake.module.flash_attn_fp8_func(q, k, v).float(), atol=1e-1)


@check("autotune-profile")
def _():
    tuned = route(features(deterministic=True, sink=True, kv_heads=2), Selection(autotune=True))
    assert "FlyDSL" in tuned.candidates and "AITER" in tuned.candidates and not tuned.ok  # AITER asserts: refused
    # FlyDSL takes a strided sbhd view and asserts contiguity while timed: skipped, AITER cached and run.
    fused = torch.randn(16, 2, 16 * 64 + 2 * 2 * 64, generator=torch.Generator().manual_seed(0)).to(BF16)
    q, k, v = (t.unflatten(-1, (-1, 64)).transpose(0, 1) for t in fused.split([16 * 64, 128, 128], dim=-1))
    with pytest.MonkeyPatch.context() as env, fake_primus_turbo(arch="gfx950") as fake:
        env.setenv("PRIMUS_TURBO_AUTO_TUNE", "1")
        fake.module.flash_attn_func(q, k, v, causal=True)
    assert [c.backend for c in fake.calls] == ["AITER"]


@check("usp-varlen-ring")
def _():
    from primus_ext.testing._fake_entries import _usp_asserts, _usp_groups

    group = type("G", (), {"size": lambda self: 1, "rank": lambda self: 0})()
    assert _usp_groups("flash_attn_varlen_usp_func", {"ulysses_group": group, "ring_group": None}, fp8=False,
                       varlen=True)[1] == 1
    ring = type("R", (), {"size": lambda self: 2})()
    with pytest.raises(NotImplementedError):
        _usp_groups("flash_attn_varlen_usp_func", {"ulysses_group": group, "ring_group": ring}, fp8=False,
                    varlen=True)
    _usp_asserts("flash_attn_fp8_usp_func", {"dropout_p": 0.0, "bias": None, "return_attn_probs": True}, 4, 2, 1,
                 fp8=True)
    with pytest.raises(AssertionError):
        _usp_asserts("flash_attn_fp8_usp_func", {"dropout_p": 0.1, "bias": None}, 4, 2, 1, fp8=True)


@check("primus-condition-raises")
def _():
    from primus_ext.testing import fake_primus

    source = inspect.getsource(fake_primus)
    assert "before running any handler" in source  # its runner's order, with the upstream lines it cites
    from primus_ext.primus import patch

    assert "Raises our error" in (patch.applies.__doc__ or "")


@check("primus-megatron-version")
def _():
    from primus_ext.testing import fake_primus

    assert "package_info.py" in inspect.getsource(fake_primus)


@check("pt509-gqa-gate")
def _():
    # tests/compile/test_turbo_builds.py: check --turbo-build and the fake of each build, eager and compiled
    assert route(features(heads=16, kv_heads=16, head_dim=128, head_dim_v=128, build=BUILD_PT509)).backend == "FlyDSL"
    assert route(features(heads=16, kv_heads=16, head_dim=128, head_dim_v=128)).backend == "AITER"
    with fake_primus_turbo(kernels="pt509"):
        import primus_turbo.pytorch.kernels.attention.attention_impl as impl

        assert "head_dim" in inspect.signature(impl._gqa_group_ok).parameters


@check("pt480-deterministic")
def _():
    with fake_primus_turbo(kernels="pt509"):
        import primus_turbo.pytorch.kernels.attention.attention_flydsl_impl as flydsl

        assert "deterministic" in inspect.signature(flydsl.flash_attn_sbhd_flydsl_backward_impl).parameters
    with fake_primus_turbo():
        import primus_turbo.pytorch.kernels.attention.attention_flydsl_impl as flydsl

        assert "deterministic" not in inspect.signature(flydsl.flash_attn_sbhd_flydsl_backward_impl).parameters


@check("pt469-gluon")
def _():
    with fake_primus_turbo(kernels="pt509"):
        from primus_turbo.pytorch.core.backend import BackendType

        assert "GLUON" in BackendType.__members__
    pinned = route(features(causal=False, kv_heads=16, build=BUILD_PT509), Selection(pin="GLUON"))
    assert pinned.backend is None and "forward-only" in pinned.problem()


@check("primus-1033-owner")
def _():
    from primus_ext.settings.primus_owner import owner_reasons

    assert callable(owner_reasons)
    assert "turbo_flex_attention_owner" in TurboSettingsKeys()


def TurboSettingsKeys() -> set:
    from primus_ext.settings import TurboAttentionSettings

    return {f for f in TurboAttentionSettings.__dataclass_fields__}


__all__ = ["CHECKS"]
