"""Backends declare what they take; the plan's rules read the declaration, never a backend's name.

A toy fixed-kernel backend, written from ARCHITECTURE.md's recipe alone ("subclass `AttentionBackend`, write
`capabilities`, `dense`, `packed`"), gets the hook refusals of fixed kernels and, once it declares Primus-Turbo's
dispatch model, that model's routes and refusals; a backend that calls itself ``turbo`` but evaluates hooks gets
none of them.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch

from primus_ext.backends.base import (HOOKS_EVALUATED, HOOKS_PROVEN, TURBO_DISPATCH, AttentionBackend,
                                      BackendCapabilities, KernelCall, Output)
from primus_ext.call.adapter import TurboFlexAttention
from primus_ext.errors import UnsupportedConfigError
from primus_ext.plan import build_plan

from . import oracle
from .helpers import facts, qkv, settings

CAUSAL_HOOK = {"turbo_flex_attention_mask_mod": "primus_ext.attention.masks:causal",
               "turbo_flex_attention_mask_mod_kwargs": {}}
PREFIX_HOOK = {"turbo_flex_attention_mask_mod": "primus_ext.attention.masks:prefix_lm",
               "turbo_flex_attention_mask_mod_kwargs": {"prefix_length": 4}}
SOFTCAP_HOOK = {"turbo_flex_attention_score_mod": "tests.hook_examples:softcap"}


class ToyKernels(AttentionBackend):
    """Fixed kernels: full or causal attention, nothing else, dense bshd only."""

    name = "toy"

    def __init__(self, dispatch: Optional[str] = None, hooks: str = HOOKS_PROVEN, name: str = "toy") -> None:
        self.name = name
        self._caps = BackendCapabilities(name=name, hooks=hooks, softcap=False, dense_entry="toy_dense",
                                         packed_entry=None, learned_tables=False, dispatch=dispatch)

    def capabilities(self) -> BackendCapabilities:
        return self._caps

    def dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: KernelCall) -> Output:
        assert call.pattern is not None and call.pattern.kind in ("full", "causal"), call.pattern
        groups = q.shape[2] // k.shape[2]
        k, v = (t.repeat_interleave(groups, dim=2) for t in (k, v))
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=call.pattern.kind == "causal",
            scale=call.scale)
        return out.transpose(1, 2)

    def packed(self, *args, **kwargs) -> Output:
        raise NotImplementedError("toy kernels take dense calls only")


def _refused(keys: dict, backend: AttentionBackend, **layer) -> UnsupportedConfigError:
    with pytest.raises(UnsupportedConfigError) as err:
        build_plan(settings(**keys), facts(packed=False, **layer), backend=backend)
    return err.value


def test_a_toy_fixed_kernel_backend_gets_the_hook_refusals():
    assert "B31" in _refused(PREFIX_HOOK, ToyKernels()).codes
    assert "softcap" in _refused(SOFTCAP_HOOK, ToyKernels()).codes  # it declares softcap=False
    # the same settings build on a backend that evaluates hooks, whatever it is called
    for backend in (ToyKernels(hooks=HOOKS_EVALUATED), ToyKernels(hooks=HOOKS_EVALUATED, name="turbo")):
        build_plan(settings(**PREFIX_HOOK), facts(packed=False), backend=backend)


def test_a_proven_hook_runs_on_the_toy_kernels_and_matches_the_oracle():
    plan = build_plan(settings(**CAUSAL_HOOK), facts(packed=False), backend=ToyKernels())
    assert plan.mask_recognised and "causal" in plan.mask_recognised and plan.kernels == ()
    q, k, v = qkv()
    out = TurboFlexAttention(plan, backend=ToyKernels())(q, k, v)
    expected = oracle.attention(q, k, v, oracle.causal())
    assert torch.allclose(out, expected, atol=1e-10)


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_routes_come_from_the_declared_dispatch_model_not_the_name(arch):
    """A sink on packed batches with two query heads per group has no kernel on either arch (B33): the toy
    gets that refusal only when it declares Primus-Turbo's dispatch model."""
    keys = dict(use_sink_attention=True, turbo_arch=arch)
    layer = dict(packed=True, dtype="bf16")
    routed = ToyKernels(dispatch=TURBO_DISPATCH)
    routed._caps = dataclasses.replace(routed._caps, packed_entry="toy_varlen")
    with pytest.raises(UnsupportedConfigError) as err:
        build_plan(settings(**keys), facts(**layer), backend=routed)
    assert "B33" in err.value.codes and arch in str(err.value)
    unrouted = ToyKernels()
    unrouted._caps = dataclasses.replace(unrouted._caps, packed_entry="toy_varlen")
    plan = build_plan(settings(**keys), facts(**layer), backend=unrouted)
    assert plan.kernels == ()
    # a plain causal layer on the routed toy reports the kernels the model sends its calls to
    plan = build_plan(settings(turbo_arch=arch), facts(packed=False, dtype="bf16"), backend=ToyKernels(TURBO_DISPATCH))
    assert plan.kernels and plan.arch == arch


def test_no_rule_compares_a_backend_name():
    """The rule table and what it reads never test ``backend`` against a name (a scan of their source)."""
    import inspect
    import re

    from primus_ext.plan import build, rule_input, rules, rules_fp8

    for module in (rules, rules_fp8, rule_input, build):
        source = inspect.getsource(module)
        found = re.findall(r"""(?:backend|name|\.backend)\s*(?:==|!=|in)\s*\(?["'](?:turbo|flex|reference)["']""", source)
        assert not found, (module.__name__, found)


def test_calls_on_a_backend_without_a_dispatch_model_get_no_turbo_routes():
    """Call-time routes and layout checks are Primus-Turbo's dispatch model's: a fixed-kernel backend that declares
    none runs what Turbo's kernels refuse (fp32, q, k and v in different layouts) and what its own kernels take."""
    plan = build_plan(settings(turbo_arch="gfx942"), facts(packed=False), backend=ToyKernels())
    run = TurboFlexAttention(plan, backend=ToyKernels())
    q, k, v = qkv(dtype=torch.float32)
    expected = oracle.attention(q, k, v, oracle.causal())
    torch.testing.assert_close(run(q, k, v).double(), expected, atol=1e-5, rtol=1e-5)
    k_sbhd = k.transpose(0, 1).contiguous().transpose(0, 1)  # another layout than q's (bshd storage)
    torch.testing.assert_close(run(q, k_sbhd, v).double(), expected, atol=1e-5, rtol=1e-5)


def test_what_fixed_kernels_do_not_take_is_refused_not_dropped():
    """A proven-hook backend is given no score_mod: a softcap is refused even where it declares softcap; ALiBi
    (as a hook, or as slopes at the call) and a bias are refused where it declares it takes none."""
    softcapped = ToyKernels()
    softcapped._caps = dataclasses.replace(softcapped._caps, softcap=True)
    assert "softcap" in _refused(SOFTCAP_HOOK, softcapped).codes
    alibi = {"turbo_flex_attention_score_mod": "tests.hook_examples:alibi"}
    assert "alibi-entry" in _refused(alibi, ToyKernels()).codes
    plan = build_plan(settings(), facts(packed=False), backend=ToyKernels())
    run = TurboFlexAttention(plan, backend=ToyKernels())
    q, k, v = qkv(dtype=torch.float32)
    from primus_ext.errors import UnsupportedInputError

    with pytest.raises(UnsupportedInputError) as err:
        run(q, k, v, alibi_slopes=torch.ones(4, dtype=torch.float32))
    assert err.value.codes == ("B34.backend-lacks",) and "alibi_slopes" in err.value.settings
    with pytest.raises(UnsupportedConfigError) as err:  # the plan was checked for that object, not another
        TurboFlexAttention(plan)
    assert err.value.codes == ("backend-given",)
