"""The reference backend against an independent float64 oracle, values and gradients."""

from __future__ import annotations

import pytest
import torch

from primus_ext.attention.pattern import Pattern
from primus_ext.backends import KernelCall, ReferenceBackend

from . import oracle
from .helpers import adapter, facts, packed_qkv, qkv, settings

TOL = dict(atol=1e-10, rtol=1e-10)


def test_causal_matches_oracle():
    q, k, v = qkv()
    out = adapter(settings())(q, k, v, causal=True)
    torch.testing.assert_close(out, oracle.attention(q, k, v, oracle.causal()), **TOL)


@pytest.mark.parametrize("window", [(3, 0), (2, 2), (0, 3), (-1, 2), (4, 1), (0, 0)])
def test_windows_both_bounds_match_oracle(window):
    q, k, v = qkv()
    out = adapter(settings(), drop_in=True)(q, k, v, causal=False, window_size=window)  # flash-style calls
    torch.testing.assert_close(out, oracle.attention(q, k, v, oracle.window(*window)), **TOL)


def test_configured_window_comes_from_sink_sliding_window():
    q, k, v = qkv()
    run = adapter(settings(sink_sliding_window=3))
    assert run.plan.window == (3, 0)
    out = run(q, k, v, causal=True, window_size=run.plan.window)
    torch.testing.assert_close(out, oracle.attention(q, k, v, oracle.window(3, 0)), **TOL)


def test_sink_gqa_matches_oracle():
    q, k, v = qkv(hq=4, hkv=1)
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    run = adapter(settings(use_sink_attention=True), facts(num_kv_heads=1))
    out = run(q, k, v, causal=True, sink=sink)
    expected = oracle.attention(q, k, v, oracle.causal(), sink=sink.tolist())
    torch.testing.assert_close(out.double(), expected, **TOL)


def test_alibi_score_hook_matches_oracle(tmp_path, monkeypatch):
    (tmp_path / "my_alibi.py").write_text(
        "import torch\n"
        "SLOPES = [0.5, 0.25, 0.125, 0.0625]\n"
        "def alibi(score, b, h, q_idx, kv_idx):\n"
        "    slopes = torch.tensor(SLOPES, dtype=score.dtype)\n"
        "    return score + slopes[h] * (kv_idx - q_idx)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    q, k, v = qkv()
    run = adapter(settings(turbo_flex_attention_score_mod="my_alibi:alibi"))
    assert run.plan.score_recognised == "alibi"
    out = run(q, k, v, causal=True)
    expected = oracle.attention(q, k, v, oracle.causal(), alibi=[0.5, 0.25, 0.125, 0.0625])
    torch.testing.assert_close(out, expected, **TOL)


def test_prefix_lm_hook_matches_oracle():
    q, k, v = qkv()
    run = adapter(settings(turbo_flex_attention_mask_mod="primus_ext.attention.masks:prefix_lm",
                           turbo_flex_attention_mask_mod_kwargs={"prefix_length": 5}))
    assert run.plan.pattern is None  # not a fixed-kernel pattern: reference only
    out = run(q, k, v)
    torch.testing.assert_close(out, oracle.attention(q, k, v, oracle.prefix_lm(5)), **TOL)


@pytest.mark.parametrize("window", [(-1, 0), (2, 0), (-1, -1)])
def test_packed_documents_match_oracle(window):
    bounds = [0, 5, 6, 6, 13]  # includes a length-1 and an empty document
    q, k, v = packed_qkv(13)
    cu = torch.tensor(bounds, dtype=torch.int32)
    run = adapter(settings(), facts(packed=True), drop_in=True)
    out = run.varlen(q, k, v, causal=window[1] == 0, window_size=window, cu_seqlens_q=cu, cu_seqlens_k=cu,
              max_seqlen_q=7, max_seqlen_k=7)
    assert out.shape == q.shape
    torch.testing.assert_close(out, oracle.packed_attention(q, k, v, bounds, *window), **TOL)


def test_return_lse_is_log_normaliser():
    q, k, v = qkv(b=1, s=4, hq=2, hkv=2)
    out, lse = adapter(settings(), facts(num_heads=2))(q, k, v, causal=True, return_lse=True)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / 8 ** 0.5
    scores = scores.masked_fill(torch.ones(4, 4).triu(1).bool(), float("-inf"))
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores, -1), atol=1e-6, rtol=1e-6)


def test_gradcheck_causal_with_sink():
    q, k, v = qkv(b=1, s=5, hq=2, hkv=1, d=4, grad=True)
    sink = torch.tensor([0.3, -0.7], dtype=torch.float64, requires_grad=True)
    backend = ReferenceBackend()

    def fn(q, k, v, sink):
        return backend.dense(q, k, v, KernelCall(pattern=Pattern(-1, 0), sink=sink))

    assert torch.autograd.gradcheck(fn, (q, k, v, sink))


def test_gradcheck_packed():
    q, k, v = packed_qkv(7, hq=2, hkv=2, d=4, grad=True)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    backend = ReferenceBackend()

    def fn(q, k, v):
        return backend.packed(q, k, v, cu, cu, 4, 4, KernelCall(pattern=Pattern(2, 0)))

    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_sdpa_fast_path_equals_dense_math():
    q, k, v = qkv()
    backend = ReferenceBackend()
    fast = backend.dense(q, k, v, KernelCall(pattern=Pattern(-1, 0)))
    slow = backend.dense(q, k, v, KernelCall(pattern=Pattern(-1, 0), return_lse=True))[0]
    torch.testing.assert_close(fast, slow, **TOL)


def test_dropout_is_applied_in_the_math():
    q, k, v = qkv()
    run = adapter(settings(), facts(attention_dropout=0.5))
    torch.manual_seed(0)
    dropped = run(q, k, v, dropout_p=0.5, causal=True)
    assert not torch.allclose(dropped, run(q, k, v, causal=True))
