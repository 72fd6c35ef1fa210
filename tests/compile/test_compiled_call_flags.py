"""A call's causal / window_size under ``torch.compile(fullgraph=True)``: bound or refused at trace time.

The verdict (`primus_ext.call.agreement`) runs for real while Dynamo traces the call, and its
result is a graph constant: a drop-in call with another window compiles into one graph and equals eager
and the float64 oracle; a disagreeing call outside drop-in mode, a hook layer's call window, a malformed
window and tensor flags each raise our `UnsupportedInputError` (never a Dynamo exception), with or
without ``fullgraph``.
"""

from __future__ import annotations

import pytest
import torch

from primus_ext.call.agreement import CompiledCallRefusal
from primus_ext.errors import UnsupportedInputError
from primus_ext.testing import fake_primus_turbo

from .. import oracle
from ..helpers import adapter, facts, packed_qkv, qkv, settings

TOL = dict(atol=1e-10, rtol=1e-10)


def compiled(fn, backend: str = "aot_eager", fullgraph: bool = True):
    return torch.compile(fn, backend=backend, fullgraph=fullgraph)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_drop_in_call_with_another_window_compiles_and_equals_eager_and_the_oracle(backend):
    q, k, v = qkv(grad=True)
    run = adapter(settings(), facts(packed=False), drop_in=True)
    call = compiled(lambda q, k, v: run(q, k, v, causal=True, window_size=(3, 0)), backend)
    out = call(q, k, v)
    eager = run(q, k, v, causal=True, window_size=(3, 0))
    torch.testing.assert_close(out, eager, **TOL)
    torch.testing.assert_close(out, oracle.attention(q, k, v, oracle.window(3, 0)), **TOL)
    grads = torch.autograd.grad(out.pow(2).sum(), (q, k, v))
    for got, want in zip(grads, torch.autograd.grad(eager.pow(2).sum(), (q, k, v))):
        torch.testing.assert_close(got, want, **TOL)


def test_a_drop_in_window_that_changes_between_calls_recompiles_instead_of_failing():
    """After a second value Dynamo traces the window as a dynamic int; it is specialised for the verdict."""
    q, k, v = qkv()
    run = adapter(settings(), facts(packed=False), drop_in=True)
    call = compiled(lambda q, k, v, left: run(q, k, v, causal=True, window_size=(left, 0)))
    for left in (2, 3, 5):
        torch.testing.assert_close(call(q, k, v, left), oracle.attention(q, k, v, oracle.window(left, 0)), **TOL)


def test_a_drop_in_packed_call_with_another_window_compiles():
    bounds = [0, 5, 13]
    q, k, v = packed_qkv(13)
    cu = torch.tensor(bounds, dtype=torch.int32)
    run = adapter(settings(), facts(packed=True), drop_in=True)
    call = compiled(lambda q, k, v, cu: run.varlen(q, k, v, causal=True, window_size=(2, 0), cu_seqlens_q=cu,
                                            cu_seqlens_k=cu, max_seqlen_q=8, max_seqlen_k=8))
    torch.testing.assert_close(call(q, k, v, cu), oracle.packed_attention(q, k, v, bounds, 2, 0), **TOL)


def test_the_default_flags_compile_to_the_plans_mask():
    q, k, v = qkv()
    with fake_primus_turbo() as fake:
        run = adapter(settings(turbo_flex_attention_backend="turbo", sink_sliding_window=4), facts(packed=False))
        out = compiled(lambda q, k, v: run(q, k, v))(q, k, v)
    torch.testing.assert_close(out, oracle.attention(q, k, v, oracle.window(4, 0)), **TOL)
    assert fake.calls and all(c.args["window_size"] == (4, 0) for c in fake.calls)


@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("backend", ["reference", "turbo"])
def test_a_disagreeing_call_outside_drop_in_mode_is_our_refusal_under_compile(backend, fullgraph):
    q, k, v = qkv()
    with fake_primus_turbo() as fake:
        run = adapter(settings(turbo_flex_attention_backend=backend), facts(packed=False))
        call = compiled(lambda q, k, v: run(q, k, v, causal=True, window_size=(3, 0)), fullgraph=fullgraph)
        with pytest.raises(UnsupportedInputError) as err:
            call(q, k, v)
    assert isinstance(err.value, CompiledCallRefusal)
    assert err.value.codes == ("B34.call-flags",) and "turbo_flex_attention_call_flags" in err.value.settings
    assert "planned for causal=True, window_size=(-1, -1)" in str(err.value)
    assert fake.calls == []


def test_a_disagreeing_packed_call_is_our_refusal_under_compile():
    q, k, v = packed_qkv(13)
    cu = torch.tensor([0, 5, 13], dtype=torch.int32)
    run = adapter(settings(), facts(packed=True))
    call = compiled(lambda q, k, v, cu: run.varlen(q, k, v, causal=False, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                            max_seqlen_q=8, max_seqlen_k=8))
    with pytest.raises(UnsupportedInputError) as err:
        call(q, k, v, cu)
    assert err.value.codes == ("B34.call-flags",)


@pytest.mark.parametrize("drop_in", [False, True])
def test_a_call_window_on_a_hook_layer_is_our_refusal_under_compile(drop_in):
    keys = dict(turbo_flex_attention_mask_mod="primus_ext.attention.masks:sliding_window",
                turbo_flex_attention_mask_mod_kwargs={"left": 3})
    q, k, v = qkv()
    run = adapter(settings(**keys), facts(packed=False), drop_in=drop_in)
    torch.testing.assert_close(compiled(lambda q, k, v: run(q, k, v))(q, k, v),
                               oracle.attention(q, k, v, oracle.window(3, 0)), **TOL)
    with pytest.raises(UnsupportedInputError) as err:
        compiled(lambda q, k, v: run(q, k, v, causal=True))(q, k, v)
    assert err.value.codes == ("B11",)


def test_a_drop_in_window_the_layers_rules_refuse_is_our_refusal_under_compile():
    """The drop-in binding (the layer's rules, B33 on gfx942 here) runs at trace time too."""
    q, k, v = (t.bfloat16() for t in qkv(d=16))
    sink = torch.zeros(4)
    with fake_primus_turbo(arch="gfx942") as fake:
        run = adapter(settings(turbo_flex_attention_backend="turbo", turbo_arch="gfx942", use_sink_attention=True),
                      facts(head_dim=16, dtype="bf16", packed=False), drop_in=True)
        call = compiled(lambda q, k, v, s: run(q, k, v, causal=False, window_size=(4, 4), sink=s))
        with pytest.raises(UnsupportedInputError) as err:
            call(q, k, v, sink)
    assert "B33" in err.value.codes and fake.calls == []


@pytest.mark.parametrize("flags, what", [
    (dict(causal=True, window_size=(2.5, 0)), "window_size must be a pair"),
    (dict(causal=True, window_size=(-2, 0)), "each bound is -1"),
    (dict(causal=torch.tensor(True)), "causal is a Tensor"),
    (dict(causal=True, window_size=(torch.tensor(3), 0)), "window_size is a Tensor"),
])
def test_malformed_or_tensor_flags_are_our_refusal_under_compile(flags, what):
    q, k, v = qkv()
    run = adapter(settings(), facts(packed=False), drop_in=True)
    with pytest.raises(UnsupportedInputError, match=what):
        compiled(lambda q, k, v: run(q, k, v, **flags))(q, k, v)
