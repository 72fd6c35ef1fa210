"""ALiBi runs on Primus-Turbo only where its kernels compute the hook's bias (B35).

AITER's CK fmha kernels add ``-slope * |q - kv|`` (symmetric, bottom-right aligned) for every
mask but plain causal, and ``+slope * kv`` for plain causal (docs/fidelity.md, fact `ck-alibi`, read from
ROCm/composable_kernel); with a sink AITER runs Triton kernels that add ``-slope * |q + Skv -
Sq - kv|`` for every mask (ROCm/aiter ``_compute_alibi_block``).  A proven ALiBi hook adds
``slope * (kv - q)``: the kernels agree with it after the softmax wherever no key lies right of
the diagonal, and differ for every key that does; a hook proven symmetric,
``score - slope * |q - kv|``, is what they compute on every mask.  The CPU fake computes the
kernels' formulas, so the outcomes below are those of the cluster.
"""

from __future__ import annotations

import pytest
import torch

from primus_ext.errors import UnsupportedConfigError, UnsupportedInputError
from primus_ext.testing import fake_primus_turbo

from . import hook_examples
from .fuzz import oracle
from .helpers import adapter, facts, qkv, settings

ALIBI = {"turbo_flex_attention_score_mod": "tests.hook_examples:alibi"}
SYMMETRIC = {"turbo_flex_attention_score_mod": "tests.hook_examples:symmetric_alibi"}
FULL = dict(causal=False, attn_mask_type="no_mask")
HEADS = 4


def slopes() -> torch.Tensor:
    return torch.tensor(hook_examples.SLOPES[:HEADS], dtype=torch.float32)


def hook_oracle(q, k, v, *, causal: bool, symmetric: bool = False, sink=None) -> torch.Tensor:
    """The hook as written, ``score + slope * (kv - q)`` (or ``score - slope * |q - kv|``), in float64."""
    mask = oracle.flash_mask(q.shape[1], k.shape[1], causal=causal, window=(-1, -1), align="top_left")
    if symmetric:
        distance = (torch.arange(k.shape[1]).view(1, -1) - torch.arange(q.shape[1]).view(-1, 1)).abs().double()
        return oracle.attention(q, k, v, mask, bias=-slopes().double().view(1, -1, 1, 1) * distance, sink=sink)[0]
    return oracle.attention(q, k, v, mask, alibi=slopes().double(), sink=sink)[0]


def test_the_fake_adds_cks_symmetric_bias_off_the_causal_case():
    q, k, v = qkv(b=1, s=8, dtype=torch.float32)
    with fake_primus_turbo() as fake:
        got = fake.module.flash_attn_func(q, k, v, alibi_slopes=slopes())
    distance = torch.arange(8).view(1, 8) - torch.arange(8).view(8, 1)
    symmetric = -slopes().double().view(1, -1, 1, 1) * distance.abs().double()
    want = oracle.attention(q, k, v, None, bias=symmetric)[0]
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    assert (got.double() - hook_oracle(q, k, v, causal=False)).abs().max() > 1e-2  # not the hook's


def test_a_causal_alibi_hook_runs_on_turbo_and_equals_the_hook():
    q, k, v = qkv(dtype=torch.float32)
    with fake_primus_turbo():
        run = adapter(settings(turbo_flex_attention_backend="turbo", **ALIBI), facts())
        out = run(q, k, v, causal=True)
    torch.testing.assert_close(out.double(), hook_oracle(q, k, v, causal=True), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("keys, layer, code", [
    ({}, FULL, "B35"),                                                         # full attention
    ({"turbo_flex_attention_mask_mod": "primus_ext.attention.masks:sliding_window",
      "turbo_flex_attention_mask_mod_kwargs": {"left": 4, "right": 4}}, FULL, "B35"),  # a two-sided band
    ({}, {"window_size": (4, 2), **FULL}, "B35"),                              # a window with a right bound
    ({"use_sink_attention": True}, FULL, "B35"),                               # Triton's ALiBi is symmetric too
])
def test_alibi_hooks_the_kernels_would_compute_otherwise_are_refused_on_turbo(keys, layer, code):
    with fake_primus_turbo():
        with pytest.raises(UnsupportedConfigError) as err:
            adapter(settings(turbo_flex_attention_backend="turbo", **ALIBI, **keys), facts(**layer))
        assert code in err.value.codes and "turbo_flex_attention_score_mod" in err.value.settings
        adapter(settings(**ALIBI, **keys), facts(**layer))  # the reference evaluates the hook itself: it builds


def test_a_full_attention_alibi_hook_on_the_reference_equals_the_hook():
    q, k, v = qkv()
    run = adapter(settings(**ALIBI), facts(**FULL))
    torch.testing.assert_close(run(q, k, v), hook_oracle(q, k, v, causal=False))


@pytest.mark.parametrize("call, code", [(dict(causal=False), "B35.right"),
                                        (dict(causal=False, window_size=(3, 3)), "B35.right"),
                                        (dict(causal=True, return_lse=True), "B35.lse")])
def test_explicit_alibi_slopes_are_refused_on_turbo_where_the_kernels_differ(call, code):
    q, k, v = qkv(dtype=torch.bfloat16)
    with fake_primus_turbo():
        layer = {**({} if call["causal"] else FULL), **({"window_size": call["window_size"]} if "window_size" in call
                                                         else {})}  # the plan's own mask: only the slopes refuse
        run = adapter(settings(turbo_flex_attention_backend="turbo"), facts(**layer))
        with pytest.raises(UnsupportedInputError) as err:
            run(q, k, v, alibi_slopes=slopes(), **call)
        assert code in err.value.codes and "alibi_slopes" in err.value.settings


@pytest.mark.parametrize("causal", [True, False])
def test_a_symmetric_alibi_hook_runs_on_turbo_for_every_mask_and_equals_the_hook(causal):
    q, k, v = qkv(dtype=torch.float32)
    with fake_primus_turbo():
        run = adapter(settings(turbo_flex_attention_backend="turbo", **SYMMETRIC), facts(**({} if causal else FULL)))
        assert run.plan.score_recognised == "alibi-symmetric"
        out = run(q, k, v, causal=causal)
        if not causal:  # full attention takes q_len != kv_len on turbo, but not with ALiBi: aligned otherwise
            with pytest.raises(UnsupportedInputError, match="q_len=16 != kv_len=12"):
                run(q, k[:, :12], v[:, :12])
    torch.testing.assert_close(out.double(), hook_oracle(q, k, v, causal=causal, symmetric=True),
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
@pytest.mark.parametrize("symmetric", [False, True])
def test_alibi_with_a_sink_is_refused_where_aiters_sink_path_reads_b_h_slopes(symmetric, arch):
    """With a sink AITER runs aiter's Triton kernels, which read ``alibi_slopes.stride(1)`` ([B, H] slopes,
    aiter@0f3c58e6 ops/triton/attention/mha.py l.275-276) while Primus-Turbo passes the [H] slopes as given:
    an IndexError on both archs (docs/fidelity.md, fact `aiter-sink-alibi`).  Refused at build; the fake raises
    what upstream raises for such a call."""
    q, k, v = qkv(dtype=torch.float32)
    sink = torch.randn(HEADS, generator=torch.Generator().manual_seed(4))
    keys = dict(turbo_flex_attention_backend="turbo", use_sink_attention=True, **(SYMMETRIC if symmetric else ALIBI))
    with fake_primus_turbo(arch=arch) as fake:
        with pytest.raises(UnsupportedConfigError, match="stride\\(1\\)") as err:
            adapter(settings(**keys), facts(head_dim=8, packed=False))
        assert "B33" in err.value.codes and "use_sink_attention" in err.value.settings
        with pytest.raises(IndexError):
            fake.module.flash_attn_func(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True, sink=sink,
                                        alibi_slopes=slopes())
    adapter(settings(**{**keys, "turbo_flex_attention_backend": "reference"}), facts(head_dim=8, packed=False))


def test_explicit_causal_alibi_slopes_run_on_turbo_as_on_the_reference():
    q, k, v = qkv(dtype=torch.float32)
    with fake_primus_turbo():
        turbo = adapter(settings(turbo_flex_attention_backend="turbo"), facts())(q, k, v, causal=True,
                                                                                  alibi_slopes=slopes())
    reference = adapter(settings(), facts())(q, k, v, causal=True, alibi_slopes=slopes())
    torch.testing.assert_close(turbo, reference, atol=2e-5, rtol=2e-5)
