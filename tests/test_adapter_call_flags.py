"""One rule for calls that disagree with the plan (`primus_ext.call.agreement`).

* The adapter's ``causal`` / ``window_size`` default to the plan's: ``TurboFlexAttention(plan)(q, k, v)``
  on a causal plan computes causal attention (it used to compute full attention, the call's old default
  ``causal=False`` winning), checked against the independent float64 oracle on both backends.
* A call that asks for another mask is refused (B34; B11 on a hook layer) on every path, dense and packed,
  before any kernel runs; the same mask spelled otherwise (``causal=False, window_size=(-1, 0)`` on a
  causal plan) agrees and runs the plan's flags.
* Drop-in mode (``turbo_flex_attention_call_flags: drop_in`` or ``TurboFlexAttention(plan, drop_in=True)``)
  runs a call's own flags, checked by the layer's rules; a hook layer still refuses them (B11).
* ``check`` and the plan's description say which mode a layer is in; the Megatron modules run in both.
"""

from __future__ import annotations

import pytest
import torch

from primus_ext.call.adapter import TurboFlexAttention
from primus_ext.errors import UnsupportedConfigError, UnsupportedInputError
from primus_ext.plan import build_plan
from primus_ext.testing import fake_primus_turbo

from . import oracle
from .helpers import adapter, facts, packed_qkv, qkv, settings

TOL = dict(atol=1e-10, rtol=1e-10)
BACKENDS = ["reference", "turbo"]
LIB = "primus_ext.attention.masks"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_causal_plan_called_with_the_default_flags_runs_causal(backend):
    q, k, v = qkv()
    with fake_primus_turbo() as fake:
        run = adapter(settings(turbo_flex_attention_backend=backend), facts(causal=True, packed=False))
        assert run.plan.pattern.describe() == "causal"
        out = run(q, k, v)
        again = run(q, k, v)  # the memoised call (fast path) runs the same
    torch.testing.assert_close(out, oracle.attention(q, k, v, oracle.causal()), **TOL)
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    if backend == "turbo":
        assert [c.args["causal"] for c in fake.calls] == [True, True]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_window_plan_called_with_the_default_flags_runs_its_window(backend):
    q, k, v = qkv()
    with fake_primus_turbo():
        out = adapter(settings(turbo_flex_attention_backend=backend, sink_sliding_window=3), facts())(q, k, v)
    torch.testing.assert_close(out, oracle.attention(q, k, v, oracle.window(3, 0)), **TOL)


def test_a_packed_causal_plan_called_with_the_default_flags_runs_causal_documents():
    bounds = [0, 5, 13]
    q, k, v = packed_qkv(13)
    cu = torch.tensor(bounds, dtype=torch.int32)
    out = adapter(settings(), facts(packed=True)).varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=8,
                                                  max_seqlen_k=8)
    torch.testing.assert_close(out, oracle.packed_attention(q, k, v, bounds, -1, 0), **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("call", [dict(causal=False), dict(window_size=(4, 0)), dict(causal=True, window_size=(2, 2)),
                                  dict(causal=False, window_size=(-1, -1))])
def test_a_call_asking_for_another_mask_is_refused_outside_drop_in_mode(backend, call):
    q, k, v = qkv()
    with fake_primus_turbo() as fake:
        run = adapter(settings(turbo_flex_attention_backend=backend), facts(packed=False))
        assert not run.drop_in
        with pytest.raises(UnsupportedInputError) as err:
            run(q, k, v, **call)
    assert err.value.codes == ("B34.call-flags",) and "turbo_flex_attention_call_flags" in err.value.settings
    assert "drop_in=True" in str(err.value) and "planned for causal=True, window_size=(-1, -1)" in str(err.value)
    assert fake.calls == []


def test_a_packed_call_asking_for_another_mask_is_refused_outside_drop_in_mode():
    q, k, v = packed_qkv(13)
    cu = torch.tensor([0, 5, 13], dtype=torch.int32)
    with fake_primus_turbo() as fake:
        run = adapter(settings(turbo_flex_attention_backend="turbo"), facts(packed=True))
        with pytest.raises(UnsupportedInputError) as err:
            run.varlen(q, k, v, causal=True, window_size=(2, 0), cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=None, max_seqlen_k=None)
    assert err.value.codes == ("B34.call-flags",) and fake.calls == []


def test_the_same_mask_spelled_otherwise_agrees_and_runs_the_plans_flags():
    q, k, v = qkv()
    with fake_primus_turbo() as fake:
        run = adapter(settings(turbo_flex_attention_backend="turbo"), facts(packed=False))
        out = run(q, k, v, causal=False, window_size=(-1, 0))  # causal, as flash_attn_func reads it
        run(q, k, v, causal=True, window_size=[-1, 3])  # causal caps the right bound at 0
    assert [(c.args["causal"], c.args["window_size"]) for c in fake.calls] == [(True, (-1, -1))] * 2
    torch.testing.assert_close(out, oracle.attention(q, k, v, oracle.causal()), **TOL)


@pytest.mark.parametrize("how", ["setting", "argument"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_drop_in_mode_runs_a_calls_own_flags(backend, how):
    q, k, v = qkv()
    keys = dict(turbo_flex_attention_backend=backend)
    if how == "setting":
        keys["turbo_flex_attention_call_flags"] = "drop_in"
    with fake_primus_turbo():
        run = adapter(settings(**keys), facts(packed=False), **({"drop_in": True} if how == "argument" else {}))
        assert run.drop_in
        windowed = run(q, k, v, causal=True, window_size=(3, 0))
        full = run(q, k, v, causal=False)
        default = run(q, k, v)  # no flags: still the plan's
    torch.testing.assert_close(windowed, oracle.attention(q, k, v, oracle.window(3, 0)), **TOL)
    torch.testing.assert_close(full, oracle.attention(q, k, v), **TOL)
    torch.testing.assert_close(default, oracle.attention(q, k, v, oracle.causal()), **TOL)


def test_drop_in_mode_still_plans_each_call_by_the_layers_rules():
    """A call's own window the plan's rules refuse (B33 here) is refused in drop-in mode too."""
    q, k, v = (t.bfloat16() for t in qkv(d=16))
    sink = torch.zeros(4)
    with fake_primus_turbo(arch="gfx942") as fake:
        plan = build_plan(settings(turbo_flex_attention_backend="turbo", turbo_arch="gfx942", use_sink_attention=True,
                                   turbo_flex_attention_call_flags="drop_in"),
                          facts(head_dim=16, dtype="bf16", packed=False))
        run = TurboFlexAttention(plan)
        with pytest.raises(UnsupportedInputError) as err:
            run(q, k, v, causal=False, window_size=(4, 4), sink=sink)
    assert "B33" in err.value.codes and fake.calls == []


def test_the_constructor_argument_overrides_the_setting_and_is_checked():
    plan = build_plan(settings(turbo_flex_attention_call_flags="drop_in"), facts())
    assert TurboFlexAttention(plan).drop_in and not TurboFlexAttention(plan, drop_in=False).drop_in
    with pytest.raises(UnsupportedInputError) as err:
        TurboFlexAttention(plan, drop_in="yes")
    assert err.value.settings == ("drop_in",)
    with pytest.raises(UnsupportedConfigError) as bad:
        settings(turbo_flex_attention_call_flags="flash")
    assert "turbo_flex_attention_call_flags" in bad.value.settings and "drop_in" in str(bad.value)


@pytest.mark.parametrize("drop_in", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_hook_layer_refuses_call_flags_in_either_mode(backend, drop_in):
    """B11: the hook is the whole mask; only causal=False, window_size=(-1, -1) (or nothing) agree."""
    q, k, v = qkv()
    keys = dict(turbo_flex_attention_backend=backend, turbo_flex_attention_mask_mod=f"{LIB}:sliding_window",
                turbo_flex_attention_mask_mod_kwargs={"left": 3})
    with fake_primus_turbo():
        run = adapter(settings(**keys), facts(packed=False), drop_in=drop_in)
        want = oracle.attention(q, k, v, oracle.window(3, 0))
        torch.testing.assert_close(run(q, k, v), want, **TOL)
        torch.testing.assert_close(run(q, k, v, causal=False, window_size=(-1, -1)), want, **TOL)
        for call in (dict(causal=True), dict(window_size=(3, 0)), dict(causal=False, window_size=(-1, 0))):
            with pytest.raises(UnsupportedInputError) as err:
                run(q, k, v, **call)
            assert err.value.codes == ("B11",) and "not silently composed" in str(err.value), call


def test_the_plan_and_check_show_the_mode(tmp_path, capsys):
    from primus_ext.cli.check import run_check

    plan = build_plan(settings(turbo_flex_attention_call_flags="drop_in"), facts())
    assert plan.call_flags == "drop_in" and "drop-in calls" in plan.describe()
    assert "drop-in" not in build_plan(settings(), facts()).describe()
    base = ("use_turbo_attention: true\nuse_turbo_flex_attention: true\nturbo_flex_attention_backend: reference\n"
            "num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nseq_length: 32\n")
    for flags, text in (("plan", "run the plan's causal / window_size; others are refused "
                                 "(turbo_flex_attention_call_flags: plan, B34)"),
                        ("drop_in", "drop-in, each call's own causal / window_size checked by the layer's rules "
                                    "(turbo_flex_attention_call_flags: drop_in, B34)")):
        path = tmp_path / f"{flags}.yaml"
        path.write_text(base + f"turbo_flex_attention_call_flags: {flags}\n")
        assert run_check(str(path)) == 0
        assert f"calls: layers 1, 2: {text}" in capsys.readouterr().out


@pytest.mark.parametrize("flags", ["plan", "drop_in"])
def test_the_megatron_module_runs_in_either_mode_and_computes_the_same(flags):
    """The modules pass the plan's own causal / window, so both modes agree with the plan."""
    from megatron.core.transformer.enums import AttnMaskType

    from primus_ext.megatron import PrimusTurboLocalAttention
    from tests.megatron import gpt
    from tests.megatron.test_refusals import qkv_sbhd

    q, k, v = qkv_sbhd()
    outs = {}
    for mode in ("plan", flags):
        layer = PrimusTurboLocalAttention(gpt.config(kv_channels=16), 1, AttnMaskType.causal, "self",
                                          settings=gpt.settings(use_turbo_flex_attention=True, sink_sliding_window=4,
                                                                turbo_flex_attention_backend="reference",
                                                                turbo_flex_attention_call_flags=mode))
        assert layer.plan.call_flags == mode
        outs[mode] = layer(q, k, v, None)
    torch.testing.assert_close(outs[flags], outs["plan"], rtol=0, atol=0)
    bshd = [t.transpose(0, 1).double() for t in (q, k, v)]
    want = oracle.attention(*bshd, oracle.window(4, 0)).transpose(0, 1).reshape(16, 2, -1)
    torch.testing.assert_close(outs[flags].double(), want, atol=1e-5, rtol=1e-5)
