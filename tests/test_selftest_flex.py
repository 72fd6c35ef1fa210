"""B33 on the ``flex`` backend: the build-time self-test runs each flex route (dense with the plan's hooks,
packed without) forward and backward against the reference, through the layer's adapter.

torch's flex_attention has no CPU backward, so on the CPU the backward runs through the autograd stand-in
(`tests.flex_standin`, held to torch's forward in `tests/test_flex_backend.py`), passed as ``flex_kernel``;
with torch's own kernel on the CPU a route is checked forward only, and says so, and never fails for it.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from primus_ext.backends import flex as flex_module
from primus_ext.call import selftest
from primus_ext.call.selftest_flex import FORWARD_ONLY
from primus_ext.errors import UnsupportedConfigError
from primus_ext.plan import build_plan
from primus_ext.testing import fake_primus_turbo

from . import flex_hooks
from .flex_standin import flex_standin
from .helpers import facts, settings

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
HOOKS = "tests.flex_hooks:"
CPU = torch.device("cpu")


def flex_plan(packed=None, **keys):
    return build_plan(settings(turbo_flex_attention_backend="flex", **keys), facts(seq_length=48, packed=packed))


PLANS = {  # GQA (4 query heads, 2 key/value heads) in each
    "prefix-lm hook, sink": lambda: flex_plan(use_sink_attention=True,
                                              turbo_flex_attention_mask_mod=HOOKS + "prefix_lm"),
    "softcap score hook, sink": lambda: flex_plan(False, use_sink_attention=True,
                                                  turbo_flex_attention_score_mod=HOOKS + "softcap"),
    "dilated window and ALiBi": lambda: flex_plan(False, turbo_flex_attention_mask_mod=HOOKS + "dilated_window",
                                                  turbo_flex_attention_score_mod="tests.hook_examples:alibi"),
    "packed, sink, no hook": lambda: flex_plan(True, use_sink_attention=True),
}
ROUTES = {  # the rows each plan's self-test shows
    "prefix-lm hook, sink": ["flex dense on FlexAttention: mask_mod tests.flex_hooks:prefix_lm, sink, float32, "
                             "heads 4/2"],
    "softcap score hook, sink": ["flex dense on FlexAttention: causal, score_mod tests.flex_hooks:softcap, sink, "
                                 "float32, heads 4/2"],
    "dilated window and ALiBi": ["flex dense on FlexAttention: mask_mod tests.flex_hooks:dilated_window, score_mod "
                                 "tests.hook_examples:alibi, ALiBi, float32, heads 4/2"],
    "packed, sink, no hook": [f"flex packed on FlexAttention: causal, sink, documents {d}, float32, heads 4/2"
                              for d in ([0, 64], [0, 32, 64], [0, 16, 64])],
}


@pytest.fixture(autouse=True)
def fresh():
    selftest.clear()
    yield
    selftest.clear()


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient scaled: a backward that is silently wrong."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.25


def broken(kernel, where):
    """``kernel`` with its output (``where="forward"``) or its gradient (``"backward"``) perturbed."""
    def run(*args, **kwargs):
        found = kernel(*args, **kwargs)
        out, rest = (found[0], found[1:]) if isinstance(found, tuple) else (found, None)
        out = out * 1.01 + 0.01 if where == "forward" else _ScaleGrad.apply(out)
        return (out, *rest) if rest is not None else out
    return run


# ------------------------------------------------------------------ the healthy glue passes, forward and backward
@pytest.mark.parametrize("name", PLANS)
def test_each_flex_route_passes_forward_and_backward_with_the_standin(name):
    plan = PLANS[name]()
    assert plan.backend == "flex" and plan.gqa
    results = selftest.self_test([plan], device=CPU, flex_kernel=flex_standin)
    assert [r.route for r in results] == ROUTES[name]
    for r in results:
        assert r.ok and not r.unchecked and not r.skipped, r
        assert 0 <= r.forward_error < 1e-5 and 0 <= r.backward_error < 1e-5, r  # both measured
    selftest.refuse_failures(results, "layer 1")


def test_packed_hooks_are_not_a_flex_route():
    """B17 refuses hooks on packed batches; a layer taking either kind self-tests its dense calls only."""
    plan = PLANS["prefix-lm hook, sink"]()
    assert plan.packed is None and selftest.routes_of(plan) == [False]
    assert selftest.routes_of(PLANS["packed, sink, no hook"]()) == [True]
    assert selftest.routes_of(flex_plan()) == [False, True]
    assert selftest.routes_of(build_plan(settings(), facts())) == []  # reference: nothing to test


# ------------------------------------------------------------------ a broken kernel refuses the build, naming the route
@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("name", PLANS)
def test_a_broken_flex_kernel_fails_its_route_and_refuses_the_build(name, where):
    results = selftest.self_test([PLANS[name]()], device=CPU, flex_kernel=broken(flex_standin, where))
    assert results and all(not r.ok and where in r.error for r in results), results
    other = "backward" if where == "forward" else "forward"
    if where == "backward":
        assert all(other not in r.error and r.forward_error < 1e-5 for r in results)
    with pytest.raises(UnsupportedConfigError) as err:
        selftest.refuse_failures(results, "layer 3")
    assert "turbo_selftest" in err.value.settings and "B33" in err.value.codes
    for route in ROUTES[name]:
        assert f"self-test of route [{route}]" in str(err.value)


def test_a_kernel_that_raises_fails_its_route():
    def raising(*args, **kwargs):
        raise RuntimeError("kernel launch failed")

    (result,) = selftest.self_test([PLANS["softcap score hook, sink"]()], device=CPU, flex_kernel=raising)
    assert not result.ok and "kernel launch failed" in result.error


# ------------------------------------------------------------------ on the CPU with torch's own kernel: forward only
@pytest.mark.parametrize("name", PLANS)
def test_on_the_cpu_torchs_kernel_is_checked_forward_only_and_never_fails_the_build(name):
    results = selftest.self_test([PLANS[name]()], device=CPU)
    assert [r.route for r in results] == [f"{route}, {FORWARD_ONLY}" for route in ROUTES[name]]
    for r in results:
        assert r.ok and r.unchecked == FORWARD_ONLY and not r.skipped
        assert 0 <= r.forward_error < 1e-5 and math.isnan(r.backward_error)
    selftest.refuse_failures(results, "layer 1")


def test_on_the_cpu_the_forward_of_torchs_kernel_is_still_checked(monkeypatch):
    """Forward only is a real check: torch's kernel with a wrong output fails the route."""
    monkeypatch.setattr(flex_module, "flex_attention", broken(flex_module.flex_attention, "forward"))
    (result,) = selftest.self_test([PLANS["prefix-lm hook, sink"]()], device=CPU)
    assert not result.ok and "forward differ" in result.error and result.unchecked == FORWARD_ONLY
    with pytest.raises(UnsupportedConfigError, match="forward only"):
        selftest.refuse_failures([result], "layer 1")


# ------------------------------------------------------------------ results are keyed apart
def test_flex_and_turbo_routes_never_share_a_result():
    """One pattern on the turbo backend (the CPU fake) and on flex: two entries, two rows; and a result of one
    flex kernel is not taken for another."""
    with fake_primus_turbo():
        on_turbo = build_plan(settings(turbo_flex_attention_backend="turbo"), facts(seq_length=48, packed=False))
        on_flex = flex_plan(False)
        assert on_turbo.pattern == on_flex.pattern and on_turbo.backend == "turbo"
        results = selftest.self_test([on_turbo, on_flex], device=CPU, flex_kernel=flex_standin)
        assert [r.route.split(":")[0] for r in results] == ["flex dense", "flex dense on FlexAttention"]
        assert all(r.ok for r in results) and len(selftest._DONE) == 2
    bad = selftest.check_route(on_flex, False, CPU, torch.float32, flex_kernel=broken(flex_standin, "forward"))
    good = selftest.check_route(on_flex, False, CPU, torch.float32, flex_kernel=flex_standin)
    assert not bad.ok and good.ok and len(selftest._DONE) == 3


def test_a_failure_is_not_hidden_behind_a_passing_row_of_the_same_name():
    """Two layers of one hook name whose hooks are other objects (a factory makes one per layer) are tested
    apart, and where one fails the row shows the failure."""
    healthy = PLANS["prefix-lm hook, sink"]()

    def same_mask(b, h, q_idx, kv_idx):
        return flex_hooks.prefix_lm(b, h, q_idx, kv_idx)

    other = dataclasses.replace(healthy, mask_mod=same_mask)

    def wrong_for_other(*args, block_mask=None, **kwargs):
        out, aux = flex_standin(*args, block_mask=block_mask, **kwargs)
        return (out + 1.0 if block_mask.mask_mod is same_mask else out), aux

    for plans in ([healthy, other], [other, healthy]):
        selftest.clear()
        (row,) = selftest.self_test(plans, device=CPU, flex_kernel=wrong_for_other)
        assert not row.ok and row.error.startswith("forward") and len(selftest._DONE) == 2


def test_under_autotune_a_flex_route_pins_no_turbo_backend():
    """Autotune picks among Primus-Turbo's kernels; a flex layer's calls run on torch's, so its route runs once,
    unpinned, whatever the arch."""
    shape = dict(num_heads=8, num_kv_heads=1, head_dim=64, dtype="bf16", seq_length=48, packed=False)
    with fake_primus_turbo(arch="gfx950"):
        keys = dict(turbo_arch="gfx950", use_turbo_autotune=True)
        plan = build_plan(settings(turbo_flex_attention_backend="flex", **keys,
                                   turbo_flex_attention_mask_mod=HOOKS + "prefix_lm"), facts(**shape))
        on_turbo = build_plan(settings(turbo_flex_attention_backend="turbo", **keys), facts(**shape))
        assert plan.selection.autotune and plan.arch == "gfx950"
        assert selftest.candidates(on_turbo, False, None, torch.bfloat16)  # Turbo's calls of this shape: pinned
        assert selftest.candidates(plan, False, None, torch.bfloat16) == ()
        (row,) = selftest.self_test([plan], device=CPU, flex_kernel=flex_standin)
    assert row.ok and not row.pinned and "pinned" not in row.route and "bfloat16, heads 8/1" in row.route


def test_a_hook_reading_captured_per_token_ids_runs_at_the_models_length():
    """`document_ids` indexes a captured tensor of 48 ids: at the self-test's own 64 tokens it would fail
    (an IndexError; on a GPU a device-side assert), so hook routes run at the plan's seq_length."""
    plan = flex_plan(turbo_flex_attention_mask_mod=HOOKS + "document_ids")
    assert plan.seq_length == len(flex_hooks.DOC_IDS) < selftest.MIN_SEQ
    results = selftest.self_test([plan], device=CPU, flex_kernel=flex_standin)
    assert [r.ok and not r.skipped for r in results] == [True], results


def test_without_a_known_length_such_a_hook_route_is_skipped_with_the_reason():
    plan = build_plan(settings(turbo_flex_attention_backend="flex",
                               turbo_flex_attention_mask_mod=HOOKS + "document_ids"), facts(seq_length=None))
    (result,) = selftest.self_test([plan], device=CPU, flex_kernel=flex_standin)
    assert result.ok and "seq_length is not known" in result.skipped
    # a hook that captures no tensor is still tested at the self-test's own length
    plain = build_plan(settings(turbo_flex_attention_backend="flex", turbo_flex_attention_mask_mod=HOOKS + "prefix_lm"),
                       facts(seq_length=None))
    (ran,) = selftest.self_test([plain], device=CPU, flex_kernel=flex_standin)
    assert ran.ok and not ran.skipped and math.isfinite(ran.backward_error)
