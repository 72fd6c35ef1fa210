"""One test per bug the differential fuzzer found, named after the bug.

Each reproduces the shrunk failing case (or its essence) with fixed inputs, so the
bug stays fixed even if the fuzzer's strategies change.
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from primus_ext.attention.pattern import Pattern

from primus_ext.call.adapter import TurboFlexAttention
from primus_ext.errors import UnsupportedConfigError, UnsupportedInputError
from primus_ext.plan import build_plan
from primus_ext.testing.fake_turbo import fake_primus_turbo
from tests.helpers import adapter, facts, packed_qkv, qkv, settings

from . import oracle

TOL = dict(atol=1e-10, rtol=1e-10)
DOCS_HOOK = dict(turbo_flex_attention_mask_mod="tests.fuzz.user_hooks:documents",
                 turbo_flex_attention_mask_mod_kwargs={"lengths": [4, 6], "causal": True})


def refused(keys: dict, layer=None) -> UnsupportedConfigError:
    with pytest.raises(UnsupportedConfigError) as info:
        build_plan(settings(**keys), layer or facts())
    return info.value


def test_regression_direct_sink_with_non_power_of_two_head_dim():
    """The direct path built a sink layer with head_dim 6; flash_attn_func then raised a bare
    ValueError at the first forward.  Its sink path has the same head-dim limits as the flex
    entries, so the `sink-shape` rule now refuses it at build time."""
    direct = dict(use_turbo_flex_attention=False, use_sink_attention=True)
    with fake_primus_turbo():
        err = refused(direct, facts(head_dim=6))
        assert "sink-shape" in err.codes and "kv_channels" in err.settings
        assert "use_turbo_flex_attention: true" in str(err)
        build_plan(settings(**direct), facts(head_dim=8))  # a power of two builds
        build_plan(settings(use_turbo_flex_attention=False), facts(head_dim=6))  # no sink: no limit


def test_regression_turbo_document_mask_dropped_the_bias():
    """A dense call with a `bias` on a layer whose hook is a packed-documents mask went to the
    varlen kernel on turbo, which takes no bias: the bias vanished (only lse showed it on a
    one-token case).  It is now refused at the call; the reference still adds it."""
    keys = dict(turbo_flex_attention_mask_mod="primus_ext.attention.masks:packed_documents",
                turbo_flex_attention_mask_mod_kwargs={"cu_seqlens": [0, 3, 8]})
    q, k, v = qkv(b=1, s=8)
    bias = torch.linspace(-1, 1, 64, dtype=torch.float64).view(8, 8)
    with fake_primus_turbo() as fake:
        run = adapter(settings(turbo_flex_attention_backend="turbo", **keys), facts(seq_length=8))
        with pytest.raises(UnsupportedInputError) as info:
            run(q, k, v, bias=bias)
        assert "bias" in info.value.settings and fake.calls == []
        run(q, k, v)  # without a bias it runs on the varlen kernel
        assert [c.entry for c in fake.calls] == ["flash_attn_varlen_func"]
    out = adapter(settings(**keys), facts(seq_length=8))(q, k, v, bias=bias)
    want, _ = oracle.attention(q, k, v, oracle.packed_mask([0, 3, 8], [0, 3, 8], causal=True, window=(-1, -1)),
                               bias=bias)
    torch.testing.assert_close(out, want, **TOL)


def test_regression_reference_refused_a_probed_hook_at_a_new_length():
    """On the reference backend a probed hook (here the library `chunked`, which carries no
    pattern) was recognised on the 512 grid as documents(256), then every call of another
    length was refused "not the documents(256) it was recognised as", with the alternative
    "set turbo_flex_attention_backend: reference" -- already set.  Megatron gives no
    seq_length, so such a layer could not run at all.  Hooks are now proven for every length
    (here: chunks of 2), so no length is special on either backend."""
    keys = dict(turbo_flex_attention_mask_mod="primus_ext.attention.masks:chunked",
                turbo_flex_attention_mask_mod_kwargs={"chunk_size": 2, "causal": False})
    run = adapter(settings(**keys), facts(seq_length=None))
    assert run.plan.pattern == Pattern(-1, -1, chunk=2)  # now proven, for every length
    with fake_primus_turbo():
        turbo = adapter(settings(turbo_flex_attention_backend="turbo", **keys), facts(seq_length=None))
        for s in (1, 5, 6):
            q, k, v = qkv(s=s)
            want, _ = oracle.attention(q, k, v, oracle.library_mask("chunked", {"chunk_size": 2, "causal": False},
                                                                    s, s))
            torch.testing.assert_close(run(q, k, v), want, **TOL)
            torch.testing.assert_close(turbo(q, k, v), want, **TOL)


def test_regression_fp8_refused_the_unbounded_window():
    """`window_size=(-1, -1)` with fp8 on the direct path was refused by B9 with the message
    "the fp8 kernel only takes window_size=(-1, -1); the window (-1, -1) would be dropped".
    (-1, -1) is exactly what the fp8 kernel computes, so it builds; a real window is refused."""
    fp8 = dict(use_turbo_flex_attention=False, enable_turbo_attention_float8=True)
    with fake_primus_turbo():
        plan = build_plan(settings(**fp8), facts(window_size=(-1, -1), head_dim=32))
        assert plan.dense_entry == "flash_attn_fp8_func"
        assert "B9" in refused(fp8, facts(window_size=(4, 0), head_dim=32)).codes


def test_regression_hook_that_raises_on_the_recognition_grid():
    """An attention-gym style document hook (`doc[q_idx] == doc[kv_idx]` over a 10-token id
    tensor) raised IndexError out of `build_plan`, because it was recognised on the 512 grid
    (no seq_length).  Now nothing is evaluated on a grid: the proof sees a fixed-length tensor
    indexed by position, so turbo refuses it by rule B31 naming the out-of-range index; the
    reference builds and runs it at its own length."""
    with fake_primus_turbo():
        err = refused(dict(turbo_flex_attention_backend="turbo", **DOCS_HOOK), facts(seq_length=None))
    assert "B31" in err.codes and "out of range" in str(err) and "length 10" in str(err)
    run = adapter(settings(**DOCS_HOOK), facts(seq_length=None))
    q, k, v = qkv(s=10)
    want, _ = oracle.attention(q, k, v, oracle.packed_mask([0, 4, 10], [0, 4, 10], causal=True, window=(-1, -1)))
    torch.testing.assert_close(run(q, k, v), want, **TOL)


def test_regression_turbo_packed_window_with_unequal_q_kv_documents():
    """A packed call whose q and kv documents differ in length, with a causal or windowed
    mask, went to flex_attention_varlen: a window came back aligned bottom-right (flash)
    instead of top-left (mask_mod, reference) -- a silently different answer -- and a causal
    mask died in the kernel's own ValueError.  Both are refused now; equal boundaries, even
    as two tensors, still run, and so does a full mask."""
    q, _, _ = packed_qkv(3)
    _, k, v = packed_qkv(5, seed=1)
    cu_q = torch.tensor([0, 1, 3], dtype=torch.int32)
    cu_kv = torch.tensor([0, 2, 5], dtype=torch.int32)
    with fake_primus_turbo() as fake:
        run = TurboFlexAttention(build_plan(settings(turbo_flex_attention_backend="turbo"), facts()), drop_in=True)
        for causal, window in ((False, (0, -1)), (True, (-1, -1))):
            with pytest.raises(UnsupportedInputError) as info:
                run.varlen(q, k, v, causal=causal, window_size=window, cu_seqlens_q=cu_q, cu_seqlens_k=cu_kv, max_seqlen_q=None, max_seqlen_k=None)
            assert info.value.settings == ("cu_seqlens_q", "cu_seqlens_kv")
        assert fake.calls == []
        full = run.varlen(q, k, v, causal=False, cu_seqlens_q=cu_q, cu_seqlens_k=cu_kv, max_seqlen_q=None, max_seqlen_k=None)
        want, _ = oracle.packed_attention(q, k, v, oracle.packed_mask([0, 1, 3], [0, 2, 5], causal=False,
                                                                      window=(-1, -1)))
        torch.testing.assert_close(full, want, **TOL)
        q, k, v = packed_qkv(5)
        same = run.varlen(q, k, v, causal=True, cu_seqlens_q=cu_kv, cu_seqlens_k=cu_kv.clone(), max_seqlen_q=None, max_seqlen_k=None)
    want, _ = oracle.packed_attention(q, k, v, oracle.packed_mask([0, 2, 5], [0, 2, 5], causal=True, window=(-1, -1)))
    torch.testing.assert_close(same, want, **TOL)


def test_regression_reference_cut_a_proven_chunk_mask_at_q_len():
    """On the reference backend a hook proven to be chunks (the library `chunked`, not causal)
    ran as its pattern, and `Pattern.at_length(q_len)` cut the chunks at the query length: on
    a dense call with kv_len > q_len every key past q_len landed in the last chunk (here keys
    8 and 9 joined chunk [4, 8) for query 4), a silently different answer.  The reference now
    evaluates every user hook itself; turbo refuses q_len != kv_len for such a mask."""
    keys = dict(turbo_flex_attention_mask_mod="primus_ext.attention.masks:chunked",
                turbo_flex_attention_mask_mod_kwargs={"chunk_size": 4, "causal": False})
    q, k, v = qkv(b=1, s=5, skv=10)
    want, _ = oracle.attention(q, k, v, oracle.library_mask("chunked", {"chunk_size": 4, "causal": False}, 5, 10))
    torch.testing.assert_close(adapter(settings(**keys), facts())(q, k, v), want, **TOL)
    with fake_primus_turbo():
        with pytest.raises(UnsupportedInputError):
            adapter(settings(turbo_flex_attention_backend="turbo", **keys), facts())(q, k, v)


SLOPES_F64 = torch.tensor([1 / 3, 0.5, 0.25, 0.125], dtype=torch.float64)


def alibi_float64_table(score, b, h, q_idx, kv_idx):
    return score + (SLOPES_F64[h] * (kv_idx - q_idx)).to(score.dtype)


def test_regression_float64_slope_table_proven_with_float32_slopes():
    """A captured float64 tensor was encoded with its values rounded to float32, so ALiBi
    from `torch.tensor([1/3, ...], dtype=float64)[h]` was proven with slope 0.33333334 and
    ran on turbo (1.5e-7 off the hook with float64 inputs), while the same slope written
    as `(kv_idx - q_idx) / 3.0` was refused.  Stored tensor values are now taken exactly:
    B31-score refuses it on turbo, naming the head; the reference runs it as written."""
    keys = dict(turbo_flex_attention_score_mod="tests.fuzz.test_regressions:alibi_float64_table")
    with fake_primus_turbo():
        err = refused(dict(turbo_flex_attention_backend="turbo", **keys))
    assert "B31-score" in err.codes and "not a float32 value" in str(err)
    q, k, v = qkv()
    causal = oracle.flash_mask(16, 16, causal=True, window=(-1, -1))  # the plan's mask (the call passes no flags)
    want, _ = oracle.attention(q, k, v, causal, score_fn=alibi_float64_table)
    torch.testing.assert_close(adapter(settings(**keys), facts())(q, k, v), want, **TOL)


GC_SEEN = 0


def _count_collections(phase, info):
    """A gc callback in non-standard-library code, like the one hypothesis installs to time
    collections (``junkdrawer._gc_cumulative_time``)."""
    global GC_SEEN
    GC_SEEN += 1


def causal_collecting(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx  # traced with gc's threshold at 1: collections, and callbacks, run meanwhile


def test_regression_gc_callback_became_a_proof_assumption():
    """While a hook was traced for its proof, every non-stdlib Python frame that ran was
    taken as the hook's own code (a `sys.setprofile` watcher), including a gc callback that
    fired then.  Under hypothesis a proven causal + ALiBi layer was built, then its first
    call was refused: "proven ... while the module global _gc_cumulative_time is still 3.74;
    that no longer holds".  The code a hook can run is now found from the hook itself."""
    gc.callbacks.append(_count_collections)
    threshold = gc.get_threshold()
    gc.set_threshold(1)  # a collection at nearly every allocation, so during the trace too
    try:
        with fake_primus_turbo() as fake:
            run = adapter(settings(turbo_flex_attention_backend="turbo",
                                   turbo_flex_attention_mask_mod="tests.fuzz.test_regressions:causal_collecting"),
                          facts())
            assert run.plan.pattern_text == "causal"
            assert not [a.what for a in run.plan.hook_assumptions if "GC_SEEN" in a.what]
            gc.collect()  # GC_SEEN changes; what the hook itself reads does not
            assert all(a.holds() for a in run.plan.hook_assumptions)
            q, k, v = qkv()
            out = run(q, k, v)
            assert len(fake.calls) == 1  # ran on the fake Turbo kernel
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(_count_collections)
    assert GC_SEEN > 0
    want, _ = oracle.attention(q, k, v, oracle.flash_mask(16, 16, causal=True, window=(-1, -1)))
    torch.testing.assert_close(out, want, **TOL)


def alibi_float64_tenth(score, b, h, q_idx, kv_idx):
    return score + (kv_idx - q_idx).double() * 0.1


def test_regression_float64_arithmetic_proven_with_the_constant_rounded_to_float32():
    """`score + (kv_idx - q_idx).double() * 0.1` was proven ALiBi with slope 0.10000000149011612 (the float32
    rounding of 0.1) and ran on turbo with that slope, while torch multiplies a float64 tensor by the double
    0.1 itself: the hook as torch calls it has slope 0.1, which is no float32 value, so B31-score must refuse
    it (as it refuses `/ 3.0` and a float64 table holding 0.1).  The difference is 1.5e-9 per position of
    distance.  `(kv_idx - q_idx) * 0.1` (int64 times a Python float: float32 arithmetic, torch's float32
    scalar 0.1) is rightly proven with 0.10000000149011612."""
    keys = dict(turbo_flex_attention_score_mod="tests.fuzz.test_regressions:alibi_float64_tenth")
    q, k, v = qkv()
    causal = oracle.flash_mask(16, 16, causal=True, window=(-1, -1))
    want, _ = oracle.attention(q, k, v, causal, score_fn=alibi_float64_tenth)
    torch.testing.assert_close(adapter(settings(**keys), facts())(q, k, v), want, **TOL)  # reference: exact
    with fake_primus_turbo():
        err = refused(dict(turbo_flex_attention_backend="turbo", **keys))
    assert "B31-score" in err.codes


def test_regression_untraceable_hook_on_a_megatron_flex_layer_is_the_expected_refusal():
    """The long fuzz drew a Megatron layer on ``flex`` whose hook calls ``math.isqrt`` of a captured int: once
    Dynamo has traced the same code with another value it makes the int symbolic and cannot trace isqrt, so the
    call is refused (B34.flex-trace), else it runs; the fuzzer's model expected it always to run.  Both
    outcomes are accepted now: alone this runs; after the same hook with other widths, it is refused."""
    from .strategies import Case
    from .test_differential import run_case

    case = Case(level="megatron", flex=True, backend="flex",
                fake={"flex_bshd": False, "flex_deterministic": True, "varlen_sink": True, "flex": True},
                settings={"use_turbo_attention": True, "use_turbo_flex_attention": True,
                          "turbo_flex_attention_backend": "flex", "use_sink_attention": False,
                          "deterministic_mode": False, "enable_turbo_attention_float8": False,
                          "reset_attention_mask": False, "sink_window_even_layers_only": False,
                          "turbo_flex_attention_mask_mod": "tests.fuzz.user_hooks:helper_window",
                          "turbo_flex_attention_mask_mod_kwargs": {"width": -1, "form": "math"}},
                layer={"num_heads": 1, "num_kv_heads": 1, "head_dim": 2, "head_dim_v": 2, "layer_number": 1,
                       "attn_mask_type": "causal", "window_size": None, "window_attn_skip_freq": None,
                       "softmax_type": "vanilla", "context_parallel_size": 1, "cp_comm_type": None,
                       "attention_dropout": 0.0, "position_embedding_type": "learned_absolute",
                       "softmax_scale": None, "params_bf16": False},
                call={"thd": False, "batch": 1, "q_len": 1, "kv_len": 1, "docs_q": None, "docs_kv": None,
                      "dtype": "float32", "padded": "none", "packed_params": "none", "attention_bias": False,
                      "four_dim_thd": False, "gain": None, "mutate": None},
                grad=False, seed=0)
    from .conftest import Tally

    tally = Tally()
    for width in (-1, 2, 3, -1):  # the later calls see the int made symbolic
        run_case(dataclasses.replace(case, settings={**case.settings, "turbo_flex_attention_mask_mod_kwargs": {
            "width": width, "form": "math"}}), tally)
    assert tally.outcomes["mismatched"] == 0 and tally.refusals.get("B34.flex-trace", 0) >= 1, tally.refusals


@pytest.mark.parametrize("same", [True, False])
def test_regression_compiled_packed_call_with_a_cloned_kv_boundary_tensor(same):
    """Megatron's packed call with ``cu_seqlens_kv`` a clone of ``cu_seqlens_q``, compiled: the check that the
    q and kv documents agree compared the tensors' data pointers while Dynamo traced it (``Unsupported: Data
    pointer comparison``, found by the long profile's compiled cases); under compile the two are compared by
    value on the device, and differing documents are still refused."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from primus_ext.megatron import PrimusTurboLocalAttention
    from tests.megatron import gpt

    with fake_primus_turbo():
        # causal_bottom_right on the flex path: it aligns top-left, so q and kv documents must agree
        module = PrimusTurboLocalAttention(gpt.config(kv_channels=16), 1, AttnMaskType.causal_bottom_right, "self",
                                           settings=gpt.settings(use_turbo_flex_attention=True,
                                                                 turbo_flex_attention_backend="turbo"))
        cu = torch.tensor([0, 5, 12], dtype=torch.int32)
        cu_kv = cu.clone() if same else torch.tensor([0, 6, 12], dtype=torch.int32)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu_kv, max_seqlen_q=7,
                                 max_seqlen_kv=7)
        q, k, v = (torch.randn(12, n, 16) for n in (4, 2, 2))
        torch._dynamo.reset()
        compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
        with torch.no_grad():
            if same:
                torch.testing.assert_close(compiled(q, k, v, None, packed_seq_params=params),
                                           module(q, k, v, None, packed_seq_params=params))
            else:
                with pytest.raises(UnsupportedInputError):
                    compiled(q, k, v, None, packed_seq_params=params)


def test_regression_a_drop_in_call_is_planned_on_the_layers_backend_not_auto_again():
    """An ``auto`` layer with an ALiBi hook that turbo does not run here (no mask: ALiBi right of the diagonal,
    B35) runs on reference; a drop-in call asking for ``causal=True`` was planned by running ``auto`` again,
    which chose turbo for it and refused the call with turbo's sink-shape rule (found by the long profile)."""
    with fake_primus_turbo():
        layer = adapter(settings(turbo_flex_attention_backend="auto", use_sink_attention=True,
                                 turbo_flex_attention_score_mod="tests.fuzz.user_hooks:alibi",
                                 turbo_flex_attention_call_flags="drop_in"),
                        facts(num_heads=1, num_kv_heads=1, head_dim=6, causal=False, attn_mask_type="no_mask"))
        assert layer.plan.backend == "reference"
        q, k, v = qkv(b=1, s=4, hq=1, hkv=1, d=6)
        sink = torch.zeros(1, dtype=torch.float64)
        got = layer(q, k, v, causal=True, window_size=(-1, -1), sink=sink)
    from tests.fuzz import user_hooks
    want, _ = oracle.attention(q, k, v, oracle.flash_mask(4, 4, causal=True, window=(-1, -1), align="top_left"),
                               sink=sink, score_fn=user_hooks.alibi)
    torch.testing.assert_close(got, want, **TOL)


def test_regression_a_compiled_call_without_queries_still_checks_the_proofs_assumptions():
    """An eager call of no query refuses a proof whose captured table changed (B31.assumption) before returning
    the empty result; compiled, the empty result came before the op, which checks it (found by the long
    profile: a changed per-head width table, sequence 0, aot_eager)."""
    from tests.fuzz import user_hooks

    with fake_primus_turbo():
        layer = adapter(settings(turbo_flex_attention_backend="turbo",
                                 turbo_flex_attention_mask_mod="tests.fuzz.user_hooks:head_width_table"),
                        facts(num_heads=1, num_kv_heads=1, head_dim=2))
        q, k, v = qkv(b=1, s=0, hq=1, hkv=1, d=2, dtype=torch.float32)
        torch._dynamo.reset()
        compiled = torch.compile(lambda q, k, v: layer(q, k, v, causal=False, window_size=(-1, -1)),
                                 fullgraph=True, backend="aot_eager")
        assert compiled(q, k, v).shape == (1, 0, 1, 2)
        saved = user_hooks.HEAD_WIDTHS.clone()
        try:
            user_hooks.HEAD_WIDTHS[0] += 1
            with pytest.raises(UnsupportedInputError) as err:
                compiled(q, k, v)
            assert "B31.assumption" in err.value.codes
        finally:
            with torch.no_grad():
                user_hooks.HEAD_WIDTHS.copy_(saved)


def test_regression_an_auto_layer_the_prover_may_decline_is_judged_where_it_ran():
    """A mask hook computing in float64 (either outcome on turbo: the prover may decline it) with an ALiBi
    score hook on ``auto``: the prover declined, the layer ran on reference with ``return_lse`` and matched
    the oracle, and the fuzzer, expecting turbo, demanded turbo's ALiBi-lse refusal (B35) (found by the long
    profile). The library was right; the expectation now follows where an undecided ``auto`` went."""
    from . import test_differential as T

    case = T.Case(
        level="adapter", flex=True, backend="auto",
        fake={"flex_bshd": False, "flex_deterministic": True, "varlen_sink": True, "flex": True, "arch": None},
        settings={"use_turbo_attention": True, "use_turbo_flex_attention": True, "turbo_flex_attention_backend": "auto",
                  "use_sink_attention": False, "deterministic_mode": False, "enable_turbo_attention_float8": False,
                  "reset_attention_mask": False, "sink_window_even_layers_only": False,
                  "turbo_flex_attention_mask_mod": "tests.fuzz.user_hooks:float64_window",
                  "turbo_flex_attention_mask_mod_kwargs": {"width": 0},
                  "turbo_flex_attention_score_mod": "tests.fuzz.user_hooks:alibi_list",
                  "turbo_flex_attention_call_flags": "drop_in"},
        layer={"num_heads": 1, "num_kv_heads": 1, "head_dim": 2, "head_dim_v": 2, "layer_number": 1,
               "attn_mask_type": "causal", "window_size": None, "window_attn_skip_freq": None,
               "softmax_type": "vanilla", "context_parallel_size": 1, "cp_comm_type": None, "attention_dropout": 0.0,
               "position_embedding_type": "learned_absolute", "softmax_scale": None, "seq_length": 1, "packed": None},
        call={"thd": False, "batch": 1, "q_len": 1, "kv_len": 1, "docs_q": None, "docs_kv": None, "dtype": "float32",
              "causal": False, "window": [-1, -1], "drop_in": "setting", "sink": "planned", "sink_dtype": "float32",
              "alibi": False, "bias": False, "scale": None, "gain": None, "mutate": None, "return_lse": True,
              "return_attn_probs": False, "max_seqlen": "exact"},
        grad=False, seed=0, compiled=None)
    outcomes = []

    class Tally:
        def record(self, _case, outcome, problem=""):
            outcomes.append((outcome, problem))

    assert T.undecided_auto(case)
    T.run_case(case, Tally())
    assert outcomes == [("matched", "")]


def test_regression_a_direct_call_without_queries_was_refused_for_its_empty_tensors_layout():
    """A Megatron direct-path call of sequence length 0: the strides of the empty sbhd views read as
    "bshd, sbhd, bshd", and the layout check refused a call that reaches no kernel (the core returns the
    empty result) (found by the long profile)."""
    from . import test_differential as T

    case = T.Case(
        level="megatron", flex=False, backend="turbo",
        fake={"flex_bshd": False, "flex_deterministic": True, "varlen_sink": True, "flex": True, "arch": None},
        settings={"use_turbo_attention": True, "use_turbo_flex_attention": False, "turbo_flex_attention_backend": "turbo",
                  "use_sink_attention": False, "deterministic_mode": False, "enable_turbo_attention_float8": False,
                  "reset_attention_mask": False, "sink_window_even_layers_only": False},
        layer={"num_heads": 1, "num_kv_heads": 1, "head_dim": 2, "head_dim_v": 2, "layer_number": 1,
               "attn_mask_type": "causal", "window_size": None, "window_attn_skip_freq": None,
               "softmax_type": "vanilla", "context_parallel_size": 1, "cp_comm_type": None, "attention_dropout": 0.0,
               "position_embedding_type": "learned_absolute", "softmax_scale": 16.0, "params_bf16": False},
        call={"thd": False, "batch": 1, "q_len": 0, "kv_len": 0, "docs_q": None, "docs_kv": None, "dtype": "float32",
              "padded": "none", "packed_params": "none", "attention_bias": False, "four_dim_thd": False, "gain": 1,
              "mutate": None},
        grad=False, seed=0, compiled=None)
    outcomes = []

    class Tally:
        def record(self, _case, outcome, problem=""):
            outcomes.append((outcome, problem))

    T.run_case(case, Tally())
    assert outcomes == [("matched", "")]
