"""One dispatch model per Primus-Turbo build: a6a16cd, and a6a16cd with PT #509 / #480 / #469 / #481.

PT #509 widens FlyDSL's GQA gate to a power-of-two group in 1..256 with ``Hq*D % 128 == 0``; PT #480
gives FlyDSL's backward ``deterministic`` (default: atomic, not reproducible); PT #469 adds the opt-in,
forward-only Gluon backend (docs/fidelity.md, facts `pt509-gqa-gate`, `pt480-deterministic`,
`pt469-gluon`).  The build is read from the installed Primus-Turbo's signatures, and the plan's
predicted kernel and storage match what the fake of that build runs, eager and compiled.
"""

from __future__ import annotations

import inspect
import re
from collections import Counter

import pytest
import torch

from primus_ext.backends.dispatch import BUILD_A6A16CD, BUILD_PT509, DENSE, CallFeatures, Selection, route
from primus_ext.backends.turbo_build import installed_build
from primus_ext.cli import main
from primus_ext.errors import UnsupportedConfigError
from primus_ext.plan import build_plan
from primus_ext.testing import fake_primus_turbo

from ..helpers import facts, settings
from .test_compiled_layer import megatron_without_tp_group_warning  # noqa: F401

BF16 = torch.bfloat16
D, S, B = 128, 16, 2
SHAPES = {"32/8": (32, 8), "16/16": (16, 16)}
EXPECTED = {("a6a16cd", "32/8"): "AITER", ("a6a16cd", "16/16"): "AITER",  # groups 4 and 1: below 8
            ("pt509", "32/8"): "FlyDSL", ("pt509", "16/16"): "FlyDSL"}    # powers of two, Hq*D % 128 == 0
KERNEL_OPS = {"AITER": ("attention_aiter_forward_impl", "attention_aiter_backward_impl"),
              "FlyDSL": ("flash_attn_sbhd_flydsl_forward", "flash_attn_sbhd_flydsl_backward")}


def test_the_build_is_read_from_signatures_never_a_version(monkeypatch):
    assert installed_build() is None  # nothing installed here
    for build in ("a6a16cd", "pt509"):
        with fake_primus_turbo(kernels=build):
            assert installed_build().name == build
    with fake_primus_turbo(kernels="pt509"):
        import primus_turbo.pytorch.kernels.attention.attention_impl as impl

        assert list(inspect.signature(impl._gqa_group_ok).parameters) == ["num_heads_q", "num_heads_kv", "head_dim"]
        monkeypatch.setattr(impl, "_gqa_group_ok", lambda num_heads_q, num_heads_kv: True)  # #480 without #509
        mixed = installed_build()
        assert (mixed.name, mixed.wide_gqa, mixed.flydsl_deterministic) == ("installed", False, True)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("build", ["a6a16cd", "pt509"])
def test_pt509_moves_mha_and_32_8_layers_to_flydsl_on_that_build_only(build, shape):
    hq, hkv = SHAPES[shape]
    found = route(CallFeatures("gfx950", DENSE, "bf16", D, D, hq, hkv, build=BUILDS[build]))
    assert found.backend == EXPECTED[(build, shape)] and found.ok
    odd = route(CallFeatures("gfx950", DENSE, "bf16", 64, 64, 3, 3, build=BUILD_PT509))  # Hq*D = 192
    assert odd.backend == "AITER"


BUILDS = {"a6a16cd": BUILD_A6A16CD, "pt509": BUILD_PT509}


def _config(tmp_path, hq: int, hkv: int) -> str:
    path = tmp_path / f"l{hq}_{hkv}.yaml"
    path.write_text(f"num_layers: 1\nhidden_size: {hq * D}\nnum_attention_heads: {hq}\nnum_query_groups: {hkv}\n"
                    f"kv_channels: {D}\nseq_length: {S}\nbf16: true\nuse_turbo_attention: true\n"
                    "packed_sequences: false\n")
    return str(path)


def _megatron_run(build: str, hq: int, hkv: int, compiled: bool) -> tuple[Counter, str]:
    """One forward and backward of a causal core attention on megatron-core's split views: the fake's calls
    per (entry, backend), and the plan's storage."""
    from megatron.core.transformer.enums import AttnMaskType

    from primus_ext.megatron import PrimusTurboLocalAttention

    from ..megatron import gpt

    cfg = gpt.config(hidden_size=hq * D, num_attention_heads=hq, num_query_groups=hkv, kv_channels=D,
                     params_dtype=BF16, bf16=True)
    gen = torch.Generator().manual_seed(0)
    fused = torch.randn(S, B, hkv, (hq // hkv + 2) * D, generator=gen).to(BF16).requires_grad_(True)
    with fake_primus_turbo(arch="gfx950", kernels=build) as fake:
        module = PrimusTurboLocalAttention(cfg, 1, AttnMaskType.causal, "self",
                                           settings=gpt.settings(use_turbo_flex_attention=False, packed_sequences=False))
        q, k, v = fused.split([hq // hkv * D, D, D], dim=-1)
        run = torch.compile(module, backend="aot_eager", fullgraph=False) if compiled else module
        run(q.reshape(S, B, hq, D), k, v, None).float().sum().backward()
        return Counter(fake.calls.by_backend), module.plan.storage


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("build", ["a6a16cd", "pt509"])
def test_check_predicts_the_kernel_and_storage_the_fake_of_that_build_runs_eager_and_compiled(
        build, shape, tmp_path, capsys, megatron_without_tp_group_warning):
    hq, hkv = SHAPES[shape]
    assert main(["check", _config(tmp_path, hq, hkv), "--arch", "gfx950", "--turbo-build", build]) == 0
    out = capsys.readouterr().out
    assert f"Primus-Turbo build {build}" in out and "assumed" in out
    line = re.search(r"^kernels on gfx950 \(Primus-Turbo build (\S+)\): layer 1: dense: (\w+).*q/k/v stored (\S+)$",
                     out, re.M)
    assert line is not None, out
    predicted, storage = line.group(2), line.group(3)
    assert (line.group(1), predicted) == (build, EXPECTED[(build, shape)])
    eager, eager_storage = _megatron_run(build, hq, hkv, compiled=False)
    assert eager == {("flash_attn_func", predicted): 1} and eager_storage == storage
    torch._dynamo.reset()
    compiled, _ = _megatron_run(build, hq, hkv, compiled=True)
    # PT #480's backward wrapper records the deterministic it was given (test below)
    compiled.pop(("flash_attn_sbhd_flydsl_backward_impl", "FlyDSL"), None)
    forward, backward = KERNEL_OPS[predicted]
    assert compiled == {(forward, predicted): 1, (backward, predicted): 1}, compiled
    assert storage == ("contiguous-sbhd" if predicted == "FlyDSL" else "as-given")


def test_turbo_build_is_refused_without_arch_or_against_the_installed_build(tmp_path, capsys):
    path = _config(tmp_path, 32, 8)
    assert main(["check", path, "--turbo-build", "pt509"]) == 2
    assert "give --arch too" in capsys.readouterr().err
    with fake_primus_turbo(kernels="a6a16cd"):
        assert main(["check", path, "--arch", "gfx950", "--turbo-build", "pt509"]) == 2
    assert "the installed Primus-Turbo is build a6a16cd" in capsys.readouterr().err


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_compiled_flydsl_backward_passes_deterministic_on_pt480(deterministic, megatron_without_tp_group_warning):
    """The compiled pair calls FlyDSL's backward ``_impl`` itself, so it passes ``deterministic`` as
    ``flash_attn_func`` passes ``ctx.deterministic``; without it PT #480's backward is atomic."""
    from primus_ext.backends.turbo_pairs_gfx950 import FlydslPair
    from primus_ext.call.ops import CallArgs

    with fake_primus_turbo(arch="gfx950", kernels="pt509") as fake:
        import primus_turbo.pytorch.kernels.attention.attention_flydsl_impl as flydsl

        pair = FlydslPair({n: getattr(flydsl, n) for n in flydsl.__all__}, True, (-1, -1))
        q = torch.randn(S, B, 16, D).to(BF16).transpose(0, 1)
        k = v = torch.randn(S, B, 16, D).to(BF16).transpose(0, 1)
        a = CallArgs(q, k, v, None, None, S, S, None, None, None, True, (-1, -1), None, 0.0, deterministic)
        out, lse, rng = pair.forward(a)
        pair.backward(a, torch.ones_like(out), out, lse, rng)
        (call,) = fake.calls_to("flash_attn_sbhd_flydsl_backward_impl")
        assert call.args == {"deterministic": deterministic}


@pytest.mark.parametrize("build, refused", [("a6a16cd", True), ("pt509", False)])
def test_the_new_gates_lift_sink_with_deterministic_and_packed_sinks_at_small_groups_on_that_build_only(
        build, refused):
    mha_sink = facts(num_heads=16, num_kv_heads=16, head_dim=64, dtype="bf16", packed=False)
    packed_sink = facts(num_heads=8, num_kv_heads=4, head_dim=64, dtype="bf16", packed=True)
    cases = [(settings(turbo_flex_attention_backend="turbo", use_sink_attention=True, deterministic_mode=True),
              mha_sink),
             (settings(turbo_flex_attention_backend="turbo", use_sink_attention=True, packed_sequences=True,
                       packed_equal_documents=True), packed_sink)]
    with fake_primus_turbo(arch="gfx950", kernels=build):
        for keys, layer in cases:
            if refused:
                with pytest.raises(UnsupportedConfigError) as err:
                    build_plan(keys, layer)
                assert "B33" in err.value.codes
            else:
                assert any("FlyDSL" in k for k in build_plan(keys, layer).kernels)


def test_gluon_is_registered_on_pt469_only_and_takes_no_training_call():
    common = dict(arch="gfx950", entry=DENSE, dtype="bf16", head_dim=64, head_dim_v=64, heads=8, kv_heads=8,
                  causal=False)
    old = route(CallFeatures(**common), Selection(pin="GLUON"))
    assert old.backend is None and "not registered" in old.problem() or "not registered" in old.failure
    new = route(CallFeatures(**common, build=BUILD_PT509), Selection(pin="GLUON"))
    assert new.backend is None and "forward-only" in new.problem()
    assert route(CallFeatures(**common, build=BUILD_PT509, needs_backward=False), Selection(pin="GLUON")).ok
    assert route(CallFeatures(**common, build=BUILD_PT509)).backend == "AITER"  # opt-in: never by default
    assert "Gluon" not in route(CallFeatures(**common, build=BUILD_PT509), Selection(autotune=True)).candidates


@pytest.mark.parametrize("flex", [False, True], ids=["direct", "flex-turbo"])
@pytest.mark.parametrize("bounds", [(0, 64), (0, 32, 64)], ids=["one-document", "two-equal"])
def test_compiled_packed_calls_on_mi355_reach_flydsl_varlen_contiguous_and_right(bounds, flex,
                                                                                  megatron_without_tp_group_warning):
    """The compiled step binds FlyDSL's varlen pair for megatron-core's split views: the kernel level gets
    contiguous q, k and v (FlyDSL reads fixed strides) and the output is the float64 oracle's."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from primus_ext.megatron import PrimusTurboLocalAttention

    from ..megatron import gpt
    from ..test_flydsl_varlen_strides import HKV, HQ, oracle_thd, split_thd

    tokens, d = 64, 64
    cfg = gpt.config(hidden_size=HQ * d, num_attention_heads=HQ, num_query_groups=HKV, kv_channels=d,
                     params_dtype=BF16, bf16=True)
    q, k, v = (t.detach().requires_grad_(True) for t in split_thd(seed=1, tokens=tokens))
    cu = torch.tensor(bounds, dtype=torch.int32)
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                             max_seqlen_kv=longest)
    torch._dynamo.reset()
    with fake_primus_turbo(arch="gfx950") as fake:
        module = PrimusTurboLocalAttention(cfg, 1, AttnMaskType.causal, "self", settings=gpt.settings(
            packed_sequences=True, use_turbo_flex_attention=flex, turbo_flex_attention_backend="turbo"))
        out = torch.compile(module, backend="aot_eager")(q[:, None], k[:, None], v[:, None], None,
                                                          packed_seq_params=params)
        out.float().sum().backward()
        calls = [c for c in fake.calls if c.entry.startswith("flash_attn_varlen_flydsl")]
        assert [c.entry for c in calls] == ["flash_attn_varlen_flydsl_forward", "flash_attn_varlen_flydsl_backward"]
        assert all(c.args[n].is_contiguous() for c in calls for n in ("q", "k", "v"))
    want = oracle_thd(q.detach(), k.detach(), v.detach(), bounds).reshape(tokens, 1, HQ * d)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
