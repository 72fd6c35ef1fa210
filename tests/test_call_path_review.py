"""Hostile review of the call path: `TurboFlexAttention.__call__` / `.varlen`, the refusal
catalogue (`primus_ext.refusals.CALL_RULES`) and the Megatron thd path.

The promise under test: every call is computed exactly as the layer's plan says, or refused
with `UnsupportedInputError` whose ``codes`` hold a code listed in docs/refusals.md; never a
torch / Dynamo / Python exception from deep inside, never a silently different result.

Tests named ``test_finding_*`` showed a break of that promise on the code as reviewed; each
says what it showed, and each is now a regression test of its fix.  Tests named
``test_held_*`` are attacks that were handled, kept so they stay handled.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType

from primus_ext.errors import UnsupportedInputError
from primus_ext.megatron import PrimusTurboLocalAttention
from primus_ext.refusals import CALL_RULES
from primus_ext.testing import fake_primus_turbo

from . import oracle
from .helpers import adapter, facts, packed_qkv, qkv, settings
from .megatron import gpt

TOL = dict(atol=1e-10, rtol=1e-10)
CU = [0, 4, 11]
BACKENDS = ["reference", "turbo"]
DOCS = Path(__file__).resolve().parents[1] / "docs" / "refusals.md"


def cu(values=CU, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def documented_codes() -> set[str]:
    text = DOCS.read_text()
    return set(re.findall(r"^\| `([\w.-]+)` \|", text, flags=re.M))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def refused(fn: Callable[[], Any]) -> UnsupportedInputError:
    """``fn()`` must be our refusal with a documented code (a foreign exception propagates: the test fails)."""
    with pytest.raises(UnsupportedInputError) as err:
        fn()
    assert set(err.value.codes) & documented_codes(), err.value.codes
    return err.value


def compiled(fn: Callable, fullgraph: bool = True) -> Callable:
    return torch.compile(fn, backend="aot_eager", fullgraph=fullgraph)


def megatron_layer(path: str, mask_type=AttnMaskType.causal) -> PrimusTurboLocalAttention:
    keys = {"direct": {}, "flex-turbo": dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="turbo"),
            "flex-reference": dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="reference")}[path]
    return PrimusTurboLocalAttention(gpt.config(kv_channels=16), 1, mask_type, "self", settings=gpt.settings(**keys))


def thd(t: int = 11):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(t, 4, 16, generator=gen), torch.randn(t, 2, 16, generator=gen),
            torch.randn(t, 2, 16, generator=gen))


# =====================================================================================
# Findings (each failed on the code as reviewed; fixed since)
# =====================================================================================

# F1. Under torch.compile(fullgraph=True) every call-time refusal other than the causal /
# window_size verdict escapes as Dynamo's `Unsupported` ("Attempted to call a super() attribute
# that is not a function or method": the `UnsupportedInputError` constructor cannot be traced).
# docs/compile.md says fullgraph=True is supported and refusals are ours; only the flag verdict
# is wrapped as `CompiledCallRefusal`.  Without fullgraph the graph breaks and eager refuses.
FULLGRAPH_REFUSALS: dict[str, Callable] = {
    "cu_seqlens float": lambda run, q, k, v: run.varlen(q, k, v, cu().float(), cu().float(), 7, 7),
    "cu_seqlens as a list": lambda run, q, k, v: run.varlen(q, k, v, CU, CU, 7, 7),
    "max_seqlen float": lambda run, q, k, v: run.varlen(q, k, v, cu(), cu(), 7.0, 7.0),
    "max_seqlen tensor (B34.max-seqlen-traced)": lambda run, q, k, v: run.varlen(q, k, v, cu(), cu(),
                                                                                 torch.tensor(7), torch.tensor(7)),
    "mixed dtypes": lambda run, q, k, v: run.varlen(q, k.float(), v, cu(), cu(), 7, 7),
    "return_attn_probs": lambda run, q, k, v: run.varlen(q, k, v, cu(), cu(), 7, 7, return_attn_probs=True),
    "dropout_p above 1": lambda run, q, k, v: run.varlen(q, k, v, cu(), cu(), 7, 7, dropout_p=2.0),
    "dense call on a packed_sequences layer": lambda run, q, k, v: run(q[None], k[None], v[None]),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(FULLGRAPH_REFUSALS))
def test_finding_fullgraph_refusals_escape_as_dynamo_unsupported(name, backend):
    with fake_primus_turbo(arch=None):
        run = adapter(settings(turbo_flex_attention_backend=backend), facts(packed=True))
        call = FULLGRAPH_REFUSALS[name]
        refused(lambda: compiled(lambda q, k, v: call(run, q, k, v))(*packed_qkv(11)))


# F2. A max_seqlen too large for the boundary check's int32 comparison: eager raises Python's
# OverflowError ("int too big to convert") on both backends and through Megatron's thd path;
# compiled, Dynamo's TorchRuntimeError.  It should be B34.max-seqlen.
@pytest.mark.parametrize("backend", BACKENDS)
def test_finding_huge_max_seqlen_is_an_overflow_error(backend):
    with fake_primus_turbo(arch=None):
        run = adapter(settings(turbo_flex_attention_backend=backend), facts(packed=True))
        refused(lambda: run.varlen(*packed_qkv(11), cu(), cu(), 2**70, 2**70))


def test_finding_huge_max_seqlen_is_a_torch_error_under_compile():
    run = adapter(settings(), facts(packed=True))
    refused(lambda: compiled(lambda q, k, v, c: run.varlen(q, k, v, c, c, 2**70, 2**70), fullgraph=False)(
        *packed_qkv(11), cu()))


@pytest.mark.parametrize("path", ["direct", "flex-turbo"])
def test_finding_huge_max_seqlen_through_megatron_thd_is_an_overflow_error(path):
    with fake_primus_turbo():
        layer = megatron_layer(path)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu(), cu_seqlens_kv=cu(), max_seqlen_q=2**70,
                                 max_seqlen_kv=2**70)
        refused(lambda: layer(*thd(), None, packed_seq_params=params))


# F3. max_seqlen = 2**31 bounds every document (4 and 7 tokens), yet the call is refused as
# B34.boundaries claiming a document is longer than max_seqlen (the int32 comparison wraps it to a
# negative number).  2**32 + 7 wraps to 7 and is accepted.  Either run it, or refuse it for what it
# is (B34.max-seqlen: above what the kernels take), not with a false diagnosis.
def test_finding_max_seqlen_2_pow_31_is_refused_with_a_false_diagnosis():
    run = adapter(settings(), facts(packed=True))
    q, k, v = packed_qkv(11)
    try:
        out = run.varlen(q, k, v, cu(), cu(), 2**31, 2**31)
    except UnsupportedInputError as err:
        assert "B34.boundaries" not in err.codes, str(err)
    else:
        torch.testing.assert_close(out, oracle.packed_attention(q, k, v, CU), **TOL)


# F4. A max_seqlen tensor on another device than the boundaries is not checked: on the meta
# device (the only other device on CPU) the boundary value check becomes a no-op, so boundaries
# that do not end at the token count run: on reference tokens 9..10 silently get a zero output; on
# turbo the bad boundaries reach the kernel (the fake's ValueError "cu_seqlens_q[-1]=9 but there are
# 11 tokens"; with good boundaries, RuntimeError ".item() cannot be called on meta tensors").
@pytest.mark.parametrize("backend", BACKENDS)
def test_finding_max_seqlen_tensor_on_another_device_disables_the_boundary_check(backend):
    with fake_primus_turbo(arch=None):
        run = adapter(settings(turbo_flex_attention_backend=backend), facts(packed=True))
        bad = cu([0, 4, 9])  # ends at 9, the call has 11 tokens
        meta = torch.tensor(7, device="meta")
        refused(lambda: run.varlen(*packed_qkv(11), bad, bad, meta, meta))


# F5. softmax_scale is never checked: "x" raises float()'s ValueError from inside the backend (and a
# numeric string such as "0.3" is silently accepted); a 0-d tensor runs eagerly but fails under
# torch.compile with Dynamo's TorchRuntimeError (the op schema takes a float).
@pytest.mark.parametrize("backend", BACKENDS)
def test_finding_softmax_scale_string_is_a_value_error(backend):
    with fake_primus_turbo(arch=None):
        run = adapter(settings(turbo_flex_attention_backend=backend), facts(packed=True))
        refused(lambda: run.varlen(*packed_qkv(11), cu(), cu(), 7, 7, softmax_scale="x"))


def test_finding_softmax_scale_tensor_runs_eagerly_but_is_a_torch_error_compiled():
    run = adapter(settings(), facts(packed=True))
    q, k, v = packed_qkv(11)
    scale = torch.tensor(0.5, dtype=torch.float64)
    fn = compiled(lambda q, k, v, c, s: run.varlen(q, k, v, c, c, 7, 7, softmax_scale=s), fullgraph=False)
    try:  # fixed: a tensor scale is refused (B34.scale), eagerly and compiled alike
        eager = run.varlen(q, k, v, cu(), cu(), 7, 7, softmax_scale=scale)
    except UnsupportedInputError as err:
        assert "B34.scale" in err.codes
        refused(lambda: fn(q, k, v, cu(), scale))
        return
    torch.testing.assert_close(eager, oracle.packed_attention(q, k, v, CU, scale=0.5), **TOL)
    try:
        out = fn(q, k, v, cu(), scale)
    except UnsupportedInputError:
        return
    torch.testing.assert_close(out, eager, **TOL)


# F6. A drop-in window bound too large for the kernels' ints: OverflowError from inside, on both
# entries and both backends (check_window accepts any Python int).
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("entry", ["dense", "varlen"])
def test_finding_window_bound_beyond_int64_is_an_overflow_error(entry, backend):
    with fake_primus_turbo(arch=None):
        run = adapter(settings(turbo_flex_attention_backend=backend), facts(packed=None), drop_in=True)
        if entry == "dense":
            refused(lambda: run(*qkv(), causal=False, window_size=(2**70, 0)))
        else:
            refused(lambda: run.varlen(*packed_qkv(11), cu(), cu(), 7, 7, causal=False, window_size=(2**70, 0)))


# F7. causal as a tensor of two flags: bool(causal) in the agreement raises torch's RuntimeError
# ("Boolean value of Tensor with more than one value is ambiguous").
@pytest.mark.parametrize("drop_in", [False, True])
def test_finding_causal_tensor_of_two_flags_is_a_runtime_error(drop_in):
    run = adapter(settings(), facts(packed=None), drop_in=drop_in)
    refused(lambda: run(*qkv(), causal=torch.tensor([True, False])))


# F8. Megatron's thd path compares distinct boundary tensors on the host before the adapter's
# device check: cu_seqlens_kv (or cu_seqlens_q_padded) on another device than the inputs raises
# NotImplementedError ("Cannot copy out of meta tensor") from `check_same_boundaries` / `_packing`
# instead of B34.cu-device (which the flex-reference path, that skips the comparison, gives).
@pytest.mark.parametrize("path, mask_type", [("direct", AttnMaskType.causal),
                                             ("flex-turbo", AttnMaskType.causal_bottom_right)])
def test_finding_megatron_cu_seqlens_kv_on_another_device(path, mask_type):
    with fake_primus_turbo():
        layer = megatron_layer(path, mask_type)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu(), cu_seqlens_kv=cu().to("meta"), max_seqlen_q=7,
                                 max_seqlen_kv=7)
        refused(lambda: layer(*thd(), None, packed_seq_params=params))


@pytest.mark.parametrize("path", ["direct", "flex-reference", "flex-turbo"])
def test_finding_megatron_padded_boundaries_on_another_device(path):
    with fake_primus_turbo():
        layer = megatron_layer(path)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu(), cu_seqlens_kv=cu(), max_seqlen_q=7,
                                 max_seqlen_kv=7, cu_seqlens_q_padded=cu().to("meta"))
        refused(lambda: layer(*thd(), None, packed_seq_params=params))


# F9. `.varlen` takes flash_attn_varlen_func's names, cu_seqlens_k / max_seqlen_k, but its
# refusals name cu_seqlens_kv / max_seqlen_kv (Megatron's PackedSeqParams names), which `.varlen`
# does not accept: following the message (`cu_seqlens_kv=...`) is a TypeError.
VARLEN_KV_REFUSALS = {
    "cu_seqlens_k a list": (lambda run, q, k, v: run.varlen(q, k, v, cu(), CU, 7, 7), "cu_seqlens_k"),
    "cu_seqlens_k float": (lambda run, q, k, v: run.varlen(q, k, v, cu(), cu().float(), 7, 7), "cu_seqlens_k"),
    "cu_seqlens_k not ending at T": (lambda run, q, k, v: run.varlen(q, k, v, cu(), cu([0, 4, 9]), 7, 7),
                                     "cu_seqlens_k"),
    "max_seqlen_k zero": (lambda run, q, k, v: run.varlen(q, k, v, cu(), cu(), 7, 0), "max_seqlen_k"),
    "max_seqlen_k below a document": (lambda run, q, k, v: run.varlen(q, k, v, cu(), cu().clone(), 7, 3),
                                      "max_seqlen_k"),
}


@pytest.mark.parametrize("name", sorted(VARLEN_KV_REFUSALS))
def test_finding_varlen_refusals_name_parameters_varlen_does_not_have(name):
    call, argument = VARLEN_KV_REFUSALS[name]
    run = adapter(settings(), facts(packed=True))
    err = refused(lambda: call(run, *packed_qkv(11)))
    assert argument in err.settings, (err.settings, str(err))


# F10. The catalogue promises each refusal names "the alternative"; these rules have none, so the
# user is told what is wrong but not what to do (B34.qkv-type, .mixed-devices, .mixed-ranks,
# .qkv-shapes, .bias-type, .bias-shape, .sink-type, .sink-shape, .cu-shape, .max-seqlen-tensor,
# .document-count, .mask-object, B25.tokens).
def test_finding_every_call_rule_names_an_alternative():
    missing = sorted(code for code, found in CALL_RULES.items() if not found.alternative.strip())
    assert missing == [], f"call-time rules without an alternative: {missing}"


# F11. A 2-D q/k/v to `.varlen` ([T, D], heads dropped) is refused as B34.heads, "the call has 11
# query and 11 key/value heads" (the token count read as heads), with the alternative "build the
# layer with the head counts ...": the rank is wrong, not the heads (B34.packed-rank).
def test_finding_two_d_varlen_inputs_are_diagnosed_as_wrong_heads():
    run = adapter(settings(), facts(packed=True))
    q, k, v = (t[:, 0] for t in packed_qkv(11))
    err = refused(lambda: run.varlen(q, k, v, cu(), cu(), 7, 7))
    assert "B34.packed-rank" in err.codes, str(err)


# F12. On a hook layer (the mask is the hook, the call passes no causal / window_size) with
# q_len != kv_len on turbo, the refusal B34.unequal-lengths names [causal, window_size], arguments
# the user never passed, not the setting that made the mask (turbo_flex_attention_mask_mod).
def test_finding_unequal_lengths_on_a_hook_layer_names_flags_the_user_did_not_pass():
    window = {"turbo_flex_attention_mask_mod": "primus_ext.attention.masks:sliding_window",
              "turbo_flex_attention_mask_mod_kwargs": {"left": 3}}
    with fake_primus_turbo(arch=None):
        run = adapter(settings(turbo_flex_attention_backend="turbo", **window), facts(packed=False))
        err = refused(lambda: run(*qkv(s=8, skv=16)))
    assert "turbo_flex_attention_mask_mod" in err.settings, (err.settings, str(err))


# =====================================================================================
# Held (attacks that were handled)
# =====================================================================================

def test_held_entries_have_exactly_primus_turbos_parameters():
    """Names and order as the fake's (real) signatures; other flash-attn versions' keywords
    (cu_seqlens_kv, softcap) are Python's TypeError, as the replaced function's would be."""
    import inspect

    from primus_ext.call import TurboFlexAttention
    from primus_ext.testing import BuildOptions, entry_signatures

    sigs = entry_signatures(BuildOptions())
    for ours, name in ((TurboFlexAttention.__call__, "flash_attn_func"),
                       (TurboFlexAttention.varlen, "flash_attn_varlen_func")):
        assert [p for p in inspect.signature(ours).parameters if p != "self"] == list(sigs[name].parameters)


@pytest.mark.parametrize("backend", BACKENDS)
def test_held_wrong_entry_for_the_layout_is_refused_with_the_other_entry_named(backend):
    with fake_primus_turbo(arch=None):
        run = adapter(settings(turbo_flex_attention_backend=backend), facts(packed=None))
        err = refused(lambda: run(*packed_qkv(11)))
        assert "B34.dense-rank" in err.codes and "varlen" in str(err)
        err = refused(lambda: run.varlen(*qkv(b=1), cu([0, 16]), cu([0, 16]), 16, 16))
        assert "B34.packed-rank" in err.codes


HELD_BOUNDARIES = {
    "None": None, "list": CU, "numpy": np.array(CU, dtype=np.int32), "int16": cu(dtype=torch.int16),
    "meta": cu().to("meta"), "2-D": cu()[None], "float": cu().float(),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(HELD_BOUNDARIES))
def test_held_bad_boundaries_are_refused(name, backend):
    with fake_primus_turbo(arch=None):
        run = adapter(settings(turbo_flex_attention_backend=backend), facts(packed=True))
        bounds = HELD_BOUNDARIES[name]
        refused(lambda: run.varlen(*packed_qkv(11), bounds, bounds, 7, 7))


HELD_EXACT_VARLEN = {
    "flash-attn positional order": lambda run, q, k, v: run.varlen(q, k, v, cu(), cu(), 7, 7, 0.0, None, True),
    "window_size as a list": lambda run, q, k, v: run.varlen(q, k, v, cu(), cu(), 7, 7, causal=True,
                                                             window_size=[-1, 0]),
    "int64 boundaries": lambda run, q, k, v: run.varlen(q, k, v, cu(dtype=torch.int64), cu(dtype=torch.int64), 7, 7),
    "max_seqlen None": lambda run, q, k, v: run.varlen(q, k, v, cu(), cu(), None, None),
    "max_seqlen 0-d tensors": lambda run, q, k, v: run.varlen(q, k, v, cu(), cu(), torch.tensor(7), torch.tensor(7)),
    "return_lse": lambda run, q, k, v: run.varlen(q, k, v, cu(), cu(), 7, 7, return_lse=True)[0],
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(HELD_EXACT_VARLEN))
def test_held_accepted_varlen_calls_are_exact(name, backend):
    q, k, v = packed_qkv(11)
    with fake_primus_turbo(arch=None):
        run = adapter(settings(turbo_flex_attention_backend=backend), facts(packed=True))
        out = HELD_EXACT_VARLEN[name](run, q, k, v)
    torch.testing.assert_close(out, oracle.packed_attention(q, k, v, CU), **TOL)


@pytest.mark.parametrize("value", [True, 7.0, 0, -3, np.int64(7)])
def test_held_bad_max_seqlen_scalars_are_refused(value):
    run = adapter(settings(), facts(packed=True))
    err = refused(lambda: run.varlen(*packed_qkv(11), cu(), cu(), value, value))
    assert "B34.max-seqlen" in err.codes


def test_held_return_lse_agrees_between_backends():
    q, k, v = packed_qkv(11)
    lses = []
    with fake_primus_turbo(arch=None):
        for backend in BACKENDS:
            run = adapter(settings(turbo_flex_attention_backend=backend), facts(packed=True))
            lses.append(run.varlen(q, k, v, cu(), cu(), 7, 7, return_lse=True)[1])
    torch.testing.assert_close(lses[0], lses[1], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("window", [(2, 0), (2, 1), (0, 0), (-1, -1)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_held_drop_in_varlen_windows_are_exact(backend, window):
    q, k, v = packed_qkv(11)
    with fake_primus_turbo(arch=None):
        run = adapter(settings(turbo_flex_attention_backend=backend), facts(packed=True), drop_in=True)
        out = run.varlen(q, k, v, cu(), cu(), 7, 7, causal=False, window_size=window)
    torch.testing.assert_close(out, oracle.packed_attention(q, k, v, CU, *window), **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_held_sink_and_alibi_of_wrong_shape_dtype_device_are_refused(backend):
    q, k, v = packed_qkv(11)
    with fake_primus_turbo(arch=None):
        sinks = adapter(settings(turbo_flex_attention_backend=backend, use_sink_attention=True), facts(packed=True))
        for sink in (torch.zeros(1, 4), torch.zeros(2), torch.zeros(4, device="meta"), torch.zeros(4).int(),
                     [0.0] * 4, torch.tensor(0.0)):
            refused(lambda: sinks.varlen(q, k, v, cu(), cu(), 7, 7, sink=sink))
        run = adapter(settings(turbo_flex_attention_backend=backend), facts(packed=True))
        for slopes in (torch.ones(1, 4), torch.ones(4, device="meta"), torch.ones(4, dtype=torch.int32)):
            refused(lambda: run.varlen(q, k, v, cu(), cu(), 7, 7, alibi_slopes=slopes))
        if backend == "turbo":  # the kernels' own limits
            refused(lambda: run.varlen(q, k, v, cu(), cu(), 7, 7, alibi_slopes=torch.ones(4), return_lse=True))
            refused(lambda: run.varlen(q, k, v, cu(), cu(), 7, 7, alibi_slopes=torch.ones(4).double()))


def test_held_hook_layer_and_packed_declaration_refuse_the_other_kind_of_call():
    window = {"turbo_flex_attention_mask_mod": "primus_ext.attention.masks:sliding_window",
              "turbo_flex_attention_mask_mod_kwargs": {"left": 3}}
    err = refused(lambda: adapter(settings(**window)).varlen(*packed_qkv(11), cu(), cu(), 7, 7))
    assert "B17" in err.codes and "turbo_flex_attention_mask_mod" in err.settings
    assert "B34.packed-call" in refused(lambda: adapter(settings(), facts(packed=False)).varlen(
        *packed_qkv(11), cu(), cu(), 7, 7)).codes
    assert "B34.dense-call" in refused(lambda: adapter(settings(), facts(packed=True))(*qkv())).codes


@pytest.mark.parametrize("backend", BACKENDS)
def test_held_fullgraph_varlen_calls_compile_and_are_exact(backend):
    q, k, v = packed_qkv(11)
    want = oracle.packed_attention(q, k, v, CU)
    with fake_primus_turbo(arch=None):
        run = adapter(settings(turbo_flex_attention_backend=backend), facts(packed=True))
        for bounds, longest in ((cu(), 7), (cu(dtype=torch.int64), 7), (cu(), None)):
            torch._dynamo.reset()
            out = compiled(lambda q, k, v, c: run.varlen(q, k, v, c, c, longest, longest))(q, k, v, bounds)
            torch.testing.assert_close(out, want, **TOL)
        torch._dynamo.reset()
        out, lse = compiled(lambda q, k, v, c: run.varlen(q, k, v, c, c, 7, 7, return_lse=True))(q, k, v, cu())
        torch.testing.assert_close(out, want, **TOL)
        torch.testing.assert_close(lse, run.varlen(q, k, v, cu(), cu(), 7, 7, return_lse=True)[1], **TOL)


def test_held_fullgraph_bad_boundary_values_are_our_refusal():
    run = adapter(settings(), facts(packed=True))
    fn = compiled(lambda q, k, v, c: run.varlen(q, k, v, c, c, 7, 7))
    assert "B34.boundaries" in refused(lambda: fn(*packed_qkv(11), cu([0, 4, 9]))).codes


@pytest.mark.parametrize("path", ["direct", "flex-reference", "flex-turbo"])
def test_held_megatron_thd_with_separate_int64_boundaries_is_exact(path):
    q, k, v = thd()
    with fake_primus_turbo():
        layer = megatron_layer(path)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu(dtype=torch.int64),
                                 cu_seqlens_kv=cu(dtype=torch.int64), max_seqlen_q=None, max_seqlen_kv=None)
        out = layer(q, k, v, None, packed_seq_params=params)
    torch.testing.assert_close(out.reshape(11, 4, 16).double(), oracle.packed_attention(q, k, v, CU),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", ["direct", "flex-reference", "flex-turbo"])
def test_held_megatron_thd_bad_boundaries_are_refused(path):
    with fake_primus_turbo():
        layer = megatron_layer(path)
        for cu_kv, longest in ((CU, 7), (cu().float(), 7), (cu(), 7.0), (cu(), 0)):
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu(), cu_seqlens_kv=cu_kv, max_seqlen_q=longest,
                                     max_seqlen_kv=longest)
            refused(lambda: layer(*thd(), None, packed_seq_params=params))
