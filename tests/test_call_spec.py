"""The call as one value: `CallSpec` keys the prepared-call cache, the ops' arguments are read by name, and
one builder makes a call's dispatch features."""

from __future__ import annotations

import inspect

import pytest
import torch

from primus_ext.backends.base import CallArgs
from primus_ext.call import ops
from primus_ext.call.adapter import TurboFlexAttention
from primus_ext.call.spec import CallSpec, call_spec
from primus_ext.plan import LayerFacts, build_plan
from primus_ext.settings import TurboAttentionSettings


def _adapter() -> TurboFlexAttention:
    settings = TurboAttentionSettings.from_dict({"use_turbo_attention": True, "use_turbo_flex_attention": True,
                                                 "turbo_flex_attention_backend": "reference"})
    return TurboFlexAttention(build_plan(settings, LayerFacts(num_heads=2, num_kv_heads=2, head_dim=8,
                                                              seq_length=16)))


def _qkv() -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    return tuple(torch.randn(1, 16, 2, 8) for _ in range(3))


def test_equal_calls_have_equal_specs_read_by_name():
    q, k, v = _qkv()
    one = call_spec(False, 0.0, None, True, (-1, -1), False, False, q, k, v, None)
    other = call_spec(False, 0.0, None, True, (-1, -1), False, False, q.clone(), k.clone(), v.clone(), None)
    assert isinstance(one, CallSpec) and one == other and hash(one) == hash(other)
    assert one.causal is True and one.window == (-1, -1) and (one.q_shape, one.q_stride, one.q_dtype) == (q.shape, q.stride(), q.dtype)
    assert call_spec(False, 0.0, None, True, (-1, -1), False, False, q, k, v.transpose(1, 2), None) != one


def test_values_equal_but_of_another_type_have_no_spec():
    q, k, v = _qkv()
    assert call_spec(False, 0.0, None, 1, None, False, False, q, k, v, None) is None  # causal=1 is no flag
    assert call_spec(False, 0.0, None, True, (2.0, 0), False, False, q, k, v, None) is None
    assert call_spec(False, 0.0, None, True, None, False, False, q, k, v, 1.0) is None  # a sink must be a tensor


def test_the_prepared_call_cache_is_keyed_by_the_calls_spec():
    run = _adapter()
    q, k, v = _qkv()
    run(q, k, v)
    run(q.clone(), k.clone(), v.clone())
    (spec,) = run.calls._entries
    assert isinstance(spec, CallSpec) and spec == call_spec(False, 0.0, None, None, None, False, False, q, k, v, None)
    assert (run.calls.hits, run.calls.misses) == (1, 1)


def test_every_op_argument_is_a_call_field_by_name():
    """The ops are read and called by their schemas' names: each argument maps to a `CallArgs` field, so a new
    call argument is one field here and one parameter there, with no position to count."""
    fields = set(CallArgs._fields)
    for names in (ops._DENSE_NAMES, ops._VARLEN_NAMES):
        for name in names:
            if name not in ("handle", "window_left", "window_right"):
                assert ops._OP_NAMES.get(name, name) in fields, name
    source = inspect.getsource(ops)
    assert "(None,) *" not in source  # no hand-counted gradient tail


def test_a_call_field_no_op_parameter_carries_is_an_error_not_a_none():
    """A field added to `CallArgs` without its op parameter would reach a compiled call's kernels as None."""
    q, k, v = _qkv()
    named = dict(q=q, k=k, v=v, cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=16, max_seqlen_kv=16, sink=None,
                 alibi_slopes=None, bias=None, causal=True, window_left=-1, window_right=-1, scale=None, dropout_p=0.0,
                 deterministic=False, return_lse=False)
    assert ops._call(named).q is q
    del named["bias"]  # as if the varlen op's caller forgot the bias it does not take
    with pytest.raises(KeyError):
        ops._call(named)


def test_one_builder_makes_a_calls_dispatch_features():
    from primus_ext.backends import call_route, turbo_kernels

    assert turbo_kernels.call_features is call_route.call_features
    assert "CallFeatures(" not in inspect.getsource(turbo_kernels)
    # every CallFeatures made there is made of `_feature_values`' tuple, the one description of a call's features
    source = inspect.getsource(call_route)
    assert source.count("CallFeatures(") == source.count("CallFeatures(*") == 2
    assert source.count("_feature_values(") == 3  # its definition, call_features and CallRoutes._lookup


def test_a_routed_call_seen_before_builds_no_dispatch_features(monkeypatch):
    """The route memo is keyed by the features' values: a hit makes no frozen `CallFeatures` (building and
    hashing one per call had doubled the route check's cost)."""
    from primus_ext.backends import call_route

    q, k, v = (t.transpose(0, 1) for t in (torch.randn(16, 1, 2, 8, dtype=torch.bfloat16) for _ in range(3)))
    a = CallArgs(q=q, k=k, v=v, cu_q=None, cu_kv=None, max_q=16, max_kv=16, sink=None, alibi=None, bias=None,
                 causal=True, window=(-1, 0), scale=None, dropout_p=0.0, deterministic=False)
    routes = call_route.CallRoutes("gfx942")
    routes.check("dense", a, True, (-1, 0))
    made = []
    real = call_route.CallFeatures
    monkeypatch.setattr(call_route, "CallFeatures", lambda *args, **kw: made.append(args) or real(*args, **kw))
    for _ in range(3):
        routes.check("dense", a, True, (-1, 0))
    assert routes.backend("dense", a, True, (-1, 0)) is not None and made == []
    features = call_route.call_features("gfx942", "dense", a, True, (-1, 0), equal_documents=None,
                                        build=routes.build)
    assert features.window == (-1, 0) and features.heads == 2 and features.sbhd_storage


def test_a_compiled_call_without_queries_gives_q_an_empty_gradient_as_eager_does():
    """The ops' backward hands q, k and v their gradients as they are: an empty q's is empty, not None."""
    run = _adapter()
    q = torch.randn(1, 0, 2, 8, requires_grad=True)
    k, v = (torch.randn(1, 16, 2, 8, requires_grad=True) for _ in range(2))
    compiled = torch.compile(lambda q, k, v: run(q, k, v), backend="aot_eager", fullgraph=True)
    compiled(q, k, v).sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape
