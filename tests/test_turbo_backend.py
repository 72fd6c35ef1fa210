"""The turbo backend through the CPU fake of Primus-Turbo: entries and arguments."""

from __future__ import annotations

import pytest
import torch

from primus_ext.call.adapter import TurboFlexAttention
from primus_ext.backends import TurboBackend, make_backend, select_backend, sink_kwargs_for
from primus_ext.errors import UnsupportedConfigError
from primus_ext.plan import build_plan
from primus_ext.testing import fake_primus_turbo

from . import oracle
from .helpers import adapter, facts, packed_qkv, qkv, settings

TOL = dict(atol=1e-10, rtol=1e-10)


def turbo(**keys):
    return settings(turbo_flex_attention_backend="turbo", **keys)


def test_auto_picks_turbo_only_when_it_imports():
    assert select_backend("auto")[0] == "reference"
    with fake_primus_turbo():
        assert select_backend("auto")[:2] == ("turbo", "auto: primus_turbo imports")
        assert build_plan(settings(turbo_flex_attention_backend="auto"), facts()).backend == "turbo"


def test_turbo_without_primus_turbo_is_refused_at_build_time():
    with pytest.raises(UnsupportedConfigError, match="turbo_flex_attention_backend") as err:
        build_plan(turbo(), facts())
    assert "turbo_flex_attention_backend" in err.value.settings


def test_default_causal_reaches_flash_attn_func_with_direct_arguments():
    """B6: the flex path's default causal call is the direct call, kernel and arguments."""
    q, k, v = qkv(dtype=torch.float32)
    with fake_primus_turbo() as fake:
        run = adapter(turbo())
        out = run(q, k, v, dropout_p=0.0, softmax_scale=0.25, causal=True, deterministic=False)
        flex_call = fake.calls[-1]
        direct = fake.module.flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=0.25, causal=True)
        direct_call = fake.calls[-1]
    assert [c.entry for c in fake.calls] == ["flash_attn_func", "flash_attn_func"]
    assert flex_call.args.keys() == direct_call.args.keys()
    for name, value in direct_call.args.items():
        got = flex_call.args[name]
        assert got is value if isinstance(value, torch.Tensor) else got == value, name
    torch.testing.assert_close(out, direct)


@pytest.mark.parametrize("build", ["main", "old", "flex", "newest"])
def test_window_runs_on_flash_attn_func_on_every_build(build):
    """B7: a causal window is flash_attn_func(causal, window_size) on q itself, flex layer or not."""
    q, k, v = qkv()
    with fake_primus_turbo(build=build) as fake:
        run = adapter(turbo(sink_sliding_window=3))
        out = run(q, k, v, causal=True, window_size=(3, 0))
    (call,) = fake.calls
    assert call.entry == "flash_attn_func" and call.args["q"] is q
    assert (call.args["causal"], call.args["window_size"]) == (True, (3, 0))
    torch.testing.assert_close(out, oracle.attention(q, k, v, oracle.window(3, 0)), **TOL)


def test_non_causal_window_keeps_both_bounds_on_flash_entry():
    """B8: (4, 4) is never run as (4, 0)."""
    q, k, v = qkv()
    with fake_primus_turbo() as fake:
        out = adapter(turbo(), drop_in=True)(q, k, v, causal=False, window_size=(4, 4))
    (call,) = fake.calls
    assert call.entry == "flash_attn_func" and call.args["window_size"] == (4, 4)
    assert call.args["causal"] is False
    torch.testing.assert_close(out, oracle.attention(q, k, v, oracle.window(4, 4)), **TOL)


def test_packed_goes_to_flash_attn_varlen_func():
    """B16: the boundaries pass through untouched."""
    q, k, v = packed_qkv(11)
    cu = torch.tensor([0, 4, 11], dtype=torch.int32)
    with fake_primus_turbo() as fake:
        run = adapter(turbo(), facts(packed=True))
        out = run.varlen(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=7, max_seqlen_k=7)
    (call,) = fake.calls
    assert call.entry == "flash_attn_varlen_func" and call.args["causal"] is True
    assert call.args["cu_seqlens_q"] is cu
    assert out.shape == q.shape
    torch.testing.assert_close(out, oracle.packed_attention(q, k, v, [0, 4, 11]), **TOL)


def test_sink_keyword_omitted_where_entry_lacks_it_and_refused_when_set():
    """B13 on real signatures: flash_attn_varlen_func without `sink` (older builds)."""
    with fake_primus_turbo(varlen_sink=False) as fake:
        ops = fake.module
        assert sink_kwargs_for(ops.flash_attn_varlen_func, None, where="packed") == {}
        with pytest.raises(UnsupportedConfigError, match="use_sink_attention"):
            sink_kwargs_for(ops.flash_attn_varlen_func, torch.zeros(4), where="packed")
        assert sink_kwargs_for(ops.flash_attn_func, None, where="dense") == {"sink": None}


@pytest.mark.parametrize("flex", [False, True])
def test_packed_sink_is_refused_where_flash_attn_varlen_func_lacks_sink(flex):
    """B13/B7: packed sinks (and documents hooks with a sink) need `sink` on flash_attn_varlen_func;
    the flex varlen entry is never a fallback (it takes a sink only for equal-length documents,
    which no plan can know).  Dense-only sinks are kept."""
    documents = dict(turbo_flex_attention_mask_mod="primus_ext.attention.masks:chunked",
                     turbo_flex_attention_mask_mod_kwargs={"chunk_size": 4})
    with fake_primus_turbo(flex=flex, varlen_sink=False):
        with pytest.raises(UnsupportedConfigError, match="use_sink_attention"):
            build_plan(turbo(use_sink_attention=True), facts(packed=True))
        with pytest.raises(UnsupportedConfigError, match="use_sink_attention"):
            build_plan(turbo(use_sink_attention=True, **documents), facts(packed=False))
        build_plan(turbo(use_sink_attention=True), facts(packed=False))


def test_bf16_sink_reaches_kernel_as_fp32_and_gets_gradient():
    """B12."""
    q, k, v = qkv(dtype=torch.float32)
    sink = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    with fake_primus_turbo() as fake:
        run = adapter(turbo(use_sink_attention=True))
        run(q, k, v, causal=True, sink=sink).sum().backward()
    passed = fake.calls[-1].args["sink"]
    assert passed.dtype == torch.float32
    assert sink.grad is not None and sink.grad.abs().sum() > 0


def test_deterministic_reaches_both_direct_entries():
    """B24: every build's flash entries take `deterministic`, so it is threaded, never refused."""
    with fake_primus_turbo(build="old") as fake:
        run = adapter(turbo(deterministic_mode=True, sink_sliding_window=3))
        q, k, v = qkv()
        run(q, k, v, causal=True, window_size=(3, 0))
        pq, pk, pv = packed_qkv(6)
        cu = torch.tensor([0, 6], dtype=torch.int32)
        run.varlen(pq, pk, pv, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6, max_seqlen_k=6)
    assert [(c.entry, c.args["deterministic"]) for c in fake.calls] == [
        ("flash_attn_func", True), ("flash_attn_varlen_func", True)]


def test_documents_hook_runs_on_varlen_with_flattened_batch():
    q, k, v = qkv()
    with fake_primus_turbo() as fake:
        run = adapter(turbo(turbo_flex_attention_mask_mod="primus_ext.attention.masks:packed_documents",
                            turbo_flex_attention_mask_mod_kwargs={"cu_seqlens": [0, 6, 16]}))
        out = run(q, k, v)
    (call,) = fake.calls
    assert call.entry == "flash_attn_varlen_func"
    assert call.args["cu_seqlens_q"].tolist() == [0, 6, 16, 22, 32]
    torch.testing.assert_close(out, oracle.attention(q, k, v, oracle.documents([0, 6, 16])), **TOL)


def test_turbo_and_reference_agree_through_make_backend():
    q, k, v = qkv()
    with fake_primus_turbo():
        plan = build_plan(turbo(sink_sliding_window=5), facts())
        fast = TurboFlexAttention(plan, make_backend("turbo"))(q, k, v, causal=True, window_size=(5, 0))
    slow = adapter(settings(sink_sliding_window=5))(q, k, v, causal=True, window_size=(5, 0))
    torch.testing.assert_close(fast, slow, **TOL)


def test_trainable_alibi_slopes_are_refused_on_turbo_and_trained_on_reference():
    """AITER's backward returns no ALiBi gradient: slopes that require one would silently not
    train on Turbo, so they are refused there; the reference differentiates them."""
    from primus_ext.errors import UnsupportedInputError

    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], requires_grad=True)
    with fake_primus_turbo() as fake:
        q, k, v = qkv(dtype=torch.float32)
        with pytest.raises(UnsupportedInputError, match="alibi_slopes"):
            adapter(settings(turbo_flex_attention_backend="turbo"))(q, k, v, causal=True, alibi_slopes=slopes)
        assert fake.calls == []
        adapter(settings(turbo_flex_attention_backend="turbo"))(q, k, v, causal=True, alibi_slopes=slopes.detach())
        out = adapter(settings())(q, k, v, causal=True, alibi_slopes=slopes)
    (grad,) = torch.autograd.grad(out.sum(), [slopes])
    assert grad.abs().sum() > 0
