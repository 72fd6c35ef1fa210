"""A pinned backend or autotune changes which Primus-Turbo kernel runs a call: the plan follows.

Upstream's dispatcher asks ``GlobalBackendManager`` at every call: a backend set in code or in
``PRIMUS_TURBO_ATTN_BACKEND`` first (it must take the call, or ``ValueError``), then autotune
(``PRIMUS_TURBO_AUTO_TUNE=1``, which Primus's ``use_turbo_autotune`` sets), which keeps the fastest
backend that takes the call, then FlyDSL and the fallbacks in order (docs/fidelity.md, facts `dispatch-order`,
`pin-cannot-handle`, `autotune-any`).  So
the plan routes each call with the installed build's selection, and under autotune it must
hold for every backend that takes the call.  The fake's dispatcher reads the same manager.
"""

from __future__ import annotations

import pytest
import torch

from primus_ext.backends.dispatch import DEFAULT_ORDER, DENSE, VARLEN, CallFeatures, Selection, route
from primus_ext.errors import UnsupportedConfigError
from primus_ext.plan import build_plan
from primus_ext.testing import fake_primus_turbo

from .helpers import adapter, facts, settings

BF16 = torch.bfloat16
FLYDSL_LAYER = dict(num_heads=16, num_kv_heads=2, head_dim=64, dtype="bf16", packed=False)  # GQA 8, D 64


def features(**over) -> CallFeatures:
    base = dict(arch="gfx950", entry=DENSE, dtype="bf16", head_dim=64, head_dim_v=64, heads=16, kv_heads=2)
    return CallFeatures(**{**base, **over})


def test_a_pin_is_the_backend_or_upstreams_value_error():
    assert route(features()).backend == "FlyDSL"
    assert route(features(), Selection(pin="AITER")).backend == "AITER"
    gqa2 = route(features(kv_heads=8), Selection(pin="FLYDSL"))
    assert gqa2.backend is None and "pinned" in gqa2.problem()
    assert route(features(entry=VARLEN), Selection(pin="HIPKITTENS")).failure == "not registered"


def test_hipkittens_takes_no_query_longer_than_the_keys_nor_a_value_head_dim_of_its_own():
    """hipkittens_attn_supported: v shaped as k and Sq <= Skv; pinned, such a call has no backend,
    and the fake raises upstream's ValueError for it, as the plan's per-call route says."""
    pin = Selection(pin="HIPKITTENS")
    assert route(features(), pin).backend == "HipKittens"
    for over in (dict(q_within_kv=False), dict(head_dim_v=128)):
        found = route(features(**over), pin)
        assert found.backend is None and "Sq <= Skv" in found.problem(), over
    q = torch.randn(32, 1, 16, 64).to(BF16).transpose(0, 1)
    k = torch.randn(16, 1, 2, 64).to(BF16).transpose(0, 1)
    with fake_primus_turbo(arch="gfx950") as fake:
        import primus_turbo.pytorch.ops as ops
        from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager

        GlobalBackendManager.set_attn_backend(BackendType.HIPKITTENS)
        with pytest.raises(ValueError, match="cannot handle"):
            ops.flash_attn_func(q, k, k, causal=True)
        assert fake.calls[-1].backend is None


def test_autotune_answers_for_every_backend_that_takes_the_call():
    det_sink = features(sink=True, deterministic=True)
    assert route(det_sink).ok  # FlyDSL takes deterministic + sink ...
    tuned = route(det_sink, Selection(autotune=True))
    assert not tuned.ok and tuned.backend == "AITER"  # ... but autotune may keep AITER, which asserts
    assert set(tuned.candidates) == {"FlyDSL", "AITER"}
    reason = tuned.reason("dense calls")
    assert reason is not None and "use_turbo_autotune" in reason.settings and "autotune" in reason.reason
    plain = route(features(), Selection(autotune=True))
    assert plain.ok and set(plain.candidates) == {"FlyDSL", "AITER", "HipKittens"}


def test_the_plan_reads_use_turbo_autotune_and_refuses_what_any_candidate_refuses():
    keys = dict(turbo_flex_attention_backend="turbo", use_sink_attention=True, deterministic_mode=True)
    with fake_primus_turbo(arch="gfx950"):
        assert build_plan(settings(**keys), facts(**FLYDSL_LAYER)).selection == DEFAULT_ORDER
        with pytest.raises(UnsupportedConfigError, match="autotune") as err:
            build_plan(settings(use_turbo_autotune=True, **keys), facts(**FLYDSL_LAYER))
        assert "B33" in err.value.codes and "use_turbo_autotune" in err.value.settings
        plan = build_plan(settings(use_turbo_autotune=True, turbo_flex_attention_backend="turbo"),
                          facts(**FLYDSL_LAYER))
        assert plan.selection.autotune and "(autotune)" in plan.kernels[0]


@pytest.mark.parametrize("value, backend", [("aiter", "AITER"), ("AITER", "AITER"), ("bf16:aiter,other:flydsl", "AITER"),
                                            ("fp8:flydsl,other:aiter", "AITER"), ("flydsl", "FlyDSL")])
def test_an_environment_pin_reaches_the_plan_and_the_fake_alike(monkeypatch, value, backend):
    monkeypatch.setenv("PRIMUS_TURBO_ATTN_BACKEND", value)
    q = torch.randn(128, 2, 16, 64).to(BF16)
    k = torch.randn(128, 2, 2, 64).to(BF16)
    with fake_primus_turbo(arch="gfx950") as fake:
        run = adapter(settings(turbo_flex_attention_backend="turbo"), facts(**FLYDSL_LAYER))
        assert run.plan.selection.pin == backend.upper()
        run(q.transpose(0, 1), k.transpose(0, 1), k.transpose(0, 1), causal=True)
        assert fake.calls[-1].backend == backend


def test_a_pin_that_cannot_take_the_layers_calls_is_refused_at_build(monkeypatch):
    monkeypatch.setenv("PRIMUS_TURBO_ATTN_BACKEND", "flydsl")
    mha = dict(FLYDSL_LAYER, num_kv_heads=16)  # MHA: FlyDSL's gate wants a GQA group of 8 to 256
    with fake_primus_turbo(arch="gfx950") as fake:
        with pytest.raises(UnsupportedConfigError, match="pinned") as err:
            build_plan(settings(turbo_flex_attention_backend="turbo"), facts(**mha))
        assert "PRIMUS_TURBO_ATTN_BACKEND" in err.value.settings
        q = torch.randn(2, 128, 16, 64).to(BF16)
        with pytest.raises(ValueError, match="User specified backend FLYDSL cannot handle"):
            fake.module.flash_attn_func(q, q, q, causal=True)  # what the run would have met


def test_a_pin_set_in_code_and_an_unreadable_one(monkeypatch):
    with fake_primus_turbo(arch="gfx950"):
        from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager

        GlobalBackendManager.set_attn_backend(BackendType.AITER)
        assert build_plan(settings(turbo_flex_attention_backend="turbo"), facts(**FLYDSL_LAYER)).selection.pin == "AITER"
    monkeypatch.setenv("PRIMUS_TURBO_ATTN_BACKEND", "cuda")  # upstream raises KeyError at every call
    with fake_primus_turbo(arch="gfx950"):
        with pytest.raises(UnsupportedConfigError, match="cuda"):
            build_plan(settings(turbo_flex_attention_backend="turbo"), facts(**FLYDSL_LAYER))


def test_autotune_plans_for_a_backend_cached_for_the_calls_shape_that_would_run_it_unchecked():
    """Upstream's autotune cache key leaves out dropout, the scale, ALiBi, bias and the value head dim,
    and a cache hit skips can_handle: on gfx950 an eval call (no dropout) may cache FlyDSL, which then
    runs the training calls and drops their dropout.  So the plan refuses autotune there."""
    tuned = Selection(autotune=True)
    train = route(features(dropout=0.1), tuned)
    assert "FlyDSL" in train.candidates and not train.ok
    assert "use_turbo_autotune" in train.reason("dense calls").settings
    assert not route(features(default_scale=False), tuned).ok  # FlyDSL would assert on the scale
    assert route(features(), tuned).ok
    gfx942 = features(arch="gfx942", dropout=0.1)
    assert route(gfx942, tuned).ok and route(gfx942, tuned).candidates == ("AITER",)  # nothing else there
    layer = dict(FLYDSL_LAYER, attention_dropout=0.1)
    with fake_primus_turbo(arch="gfx950"):
        with pytest.raises(UnsupportedConfigError, match="autotune may cache FlyDSL") as err:
            build_plan(settings(use_turbo_autotune=True, turbo_flex_attention_backend="turbo"), facts(**layer))
        assert "use_turbo_autotune" in err.value.settings
        build_plan(settings(turbo_flex_attention_backend="turbo"), facts(**layer))  # no autotune: AITER, fine
