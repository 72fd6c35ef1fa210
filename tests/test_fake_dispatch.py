"""The fake Primus-Turbo with an arch: per-call kernel dispatch, as real Primus-Turbo does it.

``fake_primus_turbo(arch=...)`` reads each call's features from the actual tensors and
arguments and asks `primus_ext.backends.dispatch.route` which kernel backend takes it.
The table below runs the fake over arch x dtype x sink x window x layout (dense, packed
with equal / unequal documents) x deterministic x GQA group and checks that it runs on
the routed backend or raises what real Primus-Turbo raises; that the plan refuses (B33)
the same rows; and that a known silent defect is reproduced, not silently fixed.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from primus_ext.backends.dispatch import DENSE, VARLEN, CallFeatures, route
from primus_ext.errors import UnsupportedConfigError
from primus_ext.plan import build_plan
from primus_ext.testing import fake_primus_turbo

from . import oracle
from .fuzz import oracle as fuzz_oracle
from .helpers import facts, settings

BF16 = torch.bfloat16
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
# Unit-scale inputs rounded to bf16 are fed to the float64 oracle as they are, so the only
# error left is the fake's own arithmetic and its one rounding of the output to bf16
# (8 significant bits: relative 2**-8 ~ 4e-3 on values of |out| <~ 3): atol 2e-2 is that
# with a margin.  fp16 (11 bits) fits the same bound.
OUT_TOL = dict(atol=2e-2, rtol=2e-2)
# Gradients add one more rounding and a reduction over keys: the fuzzer's bf16 tolerance.
GRAD_TOL = dict(atol=fuzz_oracle.GRAD_TOL[BF16].atol, rtol=fuzz_oracle.GRAD_TOL[BF16].rtol)

S, D = 16, 64          # D 64: FlyDSL-sized, and a power of two for AITER's sink kernel
EQUAL, UNEQUAL = [0, 8, 16], [0, 5, 16]
GROUPS = {"group2": (4, 2), "group8": (8, 1)}  # GQA group 2 never takes FlyDSL; 8 may
WINDOWS = {"causal": (-1, 0), "causal64": (64, 0), "causal8": (8, 0), "band4": (4, 4)}
LAYOUTS = ("dense", "packed-equal", "packed-unequal")
DISPATCHER = {DENSE: "FlashAttnDenseDispatcher", VARLEN: "FlashAttnVarlenDispatcher"}


def rand(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def sbhd_qkv(batch: int, hq: int, hkv: int, dtype: torch.dtype, d: int = D, seed: int = 0):
    """bshd views of sbhd memory, as Megatron hands them over (FlyDSL's dense layout)."""
    return tuple(rand(S, batch, h, d, dtype=dtype, seed=seed + i).transpose(0, 1)
                 for i, h in enumerate((hq, hkv, hkv)))


def features(arch, layout, dtype, sink, window, det, hq, hkv, equal=None, dropout=0.0) -> CallFeatures:
    """The row's features, written from the row (not read from tensors, as the fake does)."""
    return CallFeatures(arch=arch, entry=DENSE if layout == "dense" else VARLEN, dtype=dtype, head_dim=D,
                        head_dim_v=D, heads=hq, kv_heads=hkv, causal=window[1] == 0, window=window, sink=sink,
                        deterministic=det, equal_documents=equal, sbhd_storage=True, dropout=dropout)


def expected_error(found):
    """(type, text) real Primus-Turbo raises for a routed call, or None when it runs."""
    if found.backend is None:
        return ValueError, f"No compatible backend found for {DISPATCHER[found.features.entry]} with inputs"
    if found.failure and "deterministic" in found.failure:
        return AssertionError, "deterministic and sink cannot be enabled together"
    if found.failure:
        return ValueError, found.failure
    return None


def call_fake(ops, layout, q, k, v, **kw):
    if layout == "dense":
        return ops.flash_attn_func(q, k, v, **kw)
    bounds = EQUAL if layout == "packed-equal" else UNEQUAL
    cu = torch.tensor(bounds, dtype=torch.int32)
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    return ops.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, longest, longest, **kw)


def oracle_out(layout, q, k, v, window, sink):
    kw = dict(sink=sink.tolist() if sink is not None else None)
    if layout == "dense":
        return oracle.attention(q, k, v, oracle.window(*window), **kw)
    bounds = EQUAL if layout == "packed-equal" else UNEQUAL
    return oracle.packed_attention(q[0], k[0], v[0], bounds, *window, **kw)


def plan_refusal(arch, dtype, sink, window, det, hq, hkv, packed, dropout=0.0):
    """The plan's B33 refusal for the row's layer (None: it builds)."""
    try:
        build_plan(settings(turbo_flex_attention_backend="turbo", turbo_arch=arch, use_sink_attention=sink,
                            deterministic_mode=det),
                   facts(num_heads=hq, num_kv_heads=hkv, head_dim=D, seq_length=S, dtype=dtype, packed=packed,
                         causal=window[1] == 0, window_size=window, attention_dropout=dropout))
    except UnsupportedConfigError as exc:
        return exc
    return None


ROWS = list(itertools.product(("gfx942", "gfx950"), ("bf16", "fp16", "fp32"), (False, True), WINDOWS,
                              LAYOUTS, (False, True), GROUPS, (0.0, 0.1)))


@pytest.mark.parametrize("arch, dtype, sink, window_name, layout, det, group, dropout", ROWS,
                         ids=["-".join(str(x) for x in row) for row in ROWS])
def test_fake_runs_or_refuses_as_routed_and_the_plan_agrees(arch, dtype, sink, window_name, layout, det, group,
                                                            dropout):
    hq, hkv = GROUPS[group]
    window = WINDOWS[window_name]
    equal = None if layout == "dense" else layout == "packed-equal"
    found = route(features(arch, layout, dtype, sink, window, det, hq, hkv, equal, dropout))
    q, k, v = sbhd_qkv(1 if layout != "dense" else 2, hq, hkv, DTYPES[dtype])
    if arch == "gfx942":  # what the modules pass there (`kernel_views`): AITER's v3 backward needs it
        q, k, v = (t.contiguous() for t in (q, k, v))
    sink_t = rand(hq, dtype=torch.float32, seed=9) if sink else None
    kw = dict(causal=window[1] == 0, window_size=window, sink=sink_t, deterministic=det, dropout_p=dropout)
    error = expected_error(found)
    with fake_primus_turbo(arch=arch) as fake:
        import primus_turbo.pytorch.ops as ops

        if error is not None:
            with pytest.raises(error[0], match=error[1].replace("(", r"\(").replace(")", r"\)")):
                call_fake(ops, layout, q, k, v, **kw)
            assert fake.calls[-1].backend == found.backend  # the backend that took it, then refused it
        else:
            out = call_fake(ops, layout, q, k, v, **kw)
            assert fake.calls[-1].backend == found.backend
            assert out.dtype == DTYPES[dtype]
            if not dropout:  # (with dropout the forward is random; its mask is tested in test_fake_math)
                # the forward is right even where the backward is not (the defect is backward only)
                want = oracle_out(layout, q, k, v, window, sink_t)
                torch.testing.assert_close(out.double(), want, **OUT_TOL)
        refusal = plan_refusal(arch, dtype, sink, window, det, hq, hkv, packed=layout != "dense", dropout=dropout)

    fake_fails_or_is_wrong = error is not None or bool(found.defects)
    if refusal is not None:
        assert set(refusal.codes) == {"B33"}, refusal
    if layout == "packed-equal":
        # The plan cannot know that documents will have equal lengths (no setting says so),
        # so it answers as for documents of any length: the unequal row.  It refuses
        # whatever the fake refuses, and more (calls FlyDSL would take with equal documents).
        unknown = route(features(arch, layout, dtype, sink, window, det, hq, hkv, None, dropout))
        assert (refusal is not None) is (not unknown.ok)
        assert refusal is not None or not fake_fails_or_is_wrong
    else:
        assert (refusal is not None) is fake_fails_or_is_wrong


# -- hand-written rows: the dispatch facts cited in primus_ext.backends.dispatch, written out -------
def _run(arch, q, k, v, entry="flash_attn_func", *args, **kw):
    if arch == "gfx942":  # contiguous bshd, as the modules pass it there (strided views: test_storage_layout)
        q, k, v = (t.contiguous() for t in (q, k, v))
    with fake_primus_turbo(arch=arch) as fake:
        import primus_turbo.pytorch.ops as ops

        getattr(ops, entry)(q, k, v, *args, **kw)
        return fake.calls[-1].backend


def test_fast_shape_runs_on_flydsl_on_gfx950_and_on_aiter_on_gfx942():
    q, k, v = sbhd_qkv(2, 8, 1, BF16)
    assert _run("gfx950", q, k, v, causal=True) == "FlyDSL"
    assert _run("gfx942", q, k, v, causal=True) == "AITER"
    assert _run(None, q, k, v, causal=True) is None  # no arch: no dispatch modelled


def test_flydsl_dense_needs_sbhd_storage_or_batch_one():
    bshd = tuple(rand(2, S, h, D, dtype=BF16, seed=i) for i, h in enumerate((8, 1, 1)))
    assert _run("gfx950", *bshd, causal=True) == "AITER"
    assert _run("gfx950", *(t[:1] for t in bshd), causal=True) == "FlyDSL"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fp32_and_fp64_run_nowhere_when_an_arch_is_set_but_still_compute_without_one(dtype):
    q, k, v = sbhd_qkv(2, 4, 2, dtype, d=8)
    for arch in ("gfx942", "gfx950"):
        with pytest.raises(ValueError, match="No compatible backend found for FlashAttnDenseDispatcher"):
            _run(arch, q, k, v, causal=True)
    assert _run(None, q, k, v, causal=True) is None


def test_sink_on_packed_calls_runs_only_on_flydsl():
    q, k, v = sbhd_qkv(1, 8, 1, BF16)
    cu = torch.tensor(EQUAL, dtype=torch.int32)
    sink = torch.zeros(8)
    args = (cu, cu, 8, 8)
    assert _run("gfx950", q[0], k[0], v[0], "flash_attn_varlen_func", *args, causal=True, sink=sink) == "FlyDSL"
    with pytest.raises(ValueError, match="No compatible backend found for FlashAttnVarlenDispatcher"):
        _run("gfx942", q[0], k[0], v[0], "flash_attn_varlen_func", *args, causal=True, sink=sink)
    unequal = torch.tensor(UNEQUAL, dtype=torch.int32)
    with pytest.raises(ValueError, match="FlashAttnVarlenDispatcher"):
        _run("gfx950", q[0], k[0], v[0], "flash_attn_varlen_func", unequal, unequal, 11, 11, causal=True, sink=sink)


def test_aiter_refusals_raise_what_aiter_raises():
    q, k, v = sbhd_qkv(2, 4, 2, BF16)
    with pytest.raises(AssertionError, match="deterministic and sink cannot be enabled together"):
        _run("gfx942", q, k, v, causal=True, sink=torch.zeros(4), deterministic=True)
    q8, k8, v8 = sbhd_qkv(2, 8, 1, BF16)  # ... which FlyDSL takes on gfx950
    assert _run("gfx950", q8, k8, v8, causal=True, sink=torch.zeros(8), deterministic=True) == "FlyDSL"
    q96, k96, v96 = sbhd_qkv(2, 4, 2, BF16, d=96)
    with pytest.raises(ValueError, match="power-of-two head dim"):
        _run("gfx942", q96, k96, v96, causal=True, sink=torch.zeros(4))


def test_dropout_leaves_flydsl_for_aiter():
    q, k, v = sbhd_qkv(2, 8, 1, BF16)
    assert _run("gfx950", q, k, v, causal=True, dropout_p=0.1) == "AITER"


def test_flex_entries_reach_the_same_kernels():
    q, k, v = sbhd_qkv(1, 8, 1, BF16)
    with fake_primus_turbo(arch="gfx950") as fake:
        import primus_turbo.pytorch.ops as ops

        causal = ops.create_block_mask(lambda b, h, i, j: i >= j, None, None, S, S)
        ops.flex_attention_bshd(q, k, v, block_mask=causal, enable_gqa=True)
        assert fake.calls[-1].backend == "FlyDSL"
        narrow = ops.create_block_mask(lambda b, h, i, j: (i >= j) & (i - j <= 4), None, None, S, S)
        ops.flex_attention_bshd(q, k, v, block_mask=narrow, enable_gqa=True)  # left bound 4 < 64
        assert fake.calls[-1].backend == "AITER"
        with pytest.raises(ValueError, match="FlashAttnDenseDispatcher"):
            ops.flex_attention_bshd(q.float(), k.float(), v.float(), block_mask=causal, enable_gqa=True)
        cu = torch.tensor(EQUAL, dtype=torch.int32)
        ops.flex_attention_varlen(q[0], k[0], v[0], cu, cu, 8, 8, causal=True, sink=torch.zeros(8))
        assert fake.calls[-1].backend == "FlyDSL"
    with fake_primus_turbo(arch="gfx942"):
        import primus_turbo.pytorch.ops as ops

        with pytest.raises(ValueError, match="FlashAttnVarlenDispatcher"):
            ops.flex_attention_varlen(q[0], k[0], v[0], cu, cu, 8, 8, causal=True, sink=torch.zeros(8))


def test_unknown_arch_is_refused():
    with pytest.raises(ValueError, match="gfx942"):
        with fake_primus_turbo(arch="gfx90a"):
            pass


# -- the known defect is reproduced, not fixed ------------------------------------------------------
def _band_sink_grads(arch):
    """bf16 sink + window (4, 4) on gfx942-shaped inputs: (out, fake grads, float64 oracle grads)."""
    q, k, v = (t.detach().requires_grad_(True) for t in sbhd_qkv(1, 4, 2, BF16, d=16, seed=3))
    sink = rand(4, dtype=torch.float32, seed=5).requires_grad_(True)
    g = rand(1, S, 4, 16, dtype=BF16, seed=7)
    with fake_primus_turbo(arch=arch) as fake:
        import primus_turbo.pytorch.ops as ops

        out = ops.flash_attn_func(q, k, v, causal=False, window_size=(4, 4), sink=sink)
        backend = fake.calls[-1].backend
    got = torch.autograd.grad(out, (q, k, v), g)
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    allowed = fuzz_oracle.flash_mask(S, S, causal=False, window=(4, 4), align="bottom_right")
    ref, _ = fuzz_oracle.attention(*leaves, allowed, sink=sink.detach().double())
    want = torch.autograd.grad(ref, leaves, g.double())
    per_cell = oracle.attention(q, k, v, oracle.window(4, 4), sink=sink.tolist())
    return out, per_cell, backend, got, want


def test_sink_with_a_right_window_bound_has_wrong_gradients_on_an_arch_and_right_ones_without():
    feats = CallFeatures(arch="gfx942", entry=DENSE, dtype="bf16", head_dim=16, head_dim_v=16, heads=4,
                         kv_heads=2, causal=False, window=(4, 4), sink=True)
    assert route(feats).defects  # the model says AITER is silently wrong here ...
    out, per_cell, backend, got, want = _band_sink_grads("gfx942")
    assert backend == "AITER"
    torch.testing.assert_close(out.double(), per_cell, **OUT_TOL)  # ... the forward is right ...
    for g_fake, g_ref in zip(got, want):  # ... and the fake's gradients are wrong too
        assert not torch.allclose(g_fake.double(), g_ref, **GRAD_TOL)
    out, per_cell, backend, got, want = _band_sink_grads(None)
    assert backend is None
    torch.testing.assert_close(out.double(), per_cell, **OUT_TOL)
    for g_fake, g_ref in zip(got, want):
        torch.testing.assert_close(g_fake.double(), g_ref, **GRAD_TOL)


# -- context parallel: Ulysses around the per-rank entries (B22) ------------------------------
CP_ROWS = list(itertools.product(("gfx942", "gfx950"), (0.0, 0.1), (False, True), ((8, 2), (6, 3)), ("a2a", "p2p"),
                                 (True, False)))


@pytest.mark.parametrize("arch, dropout, sink, heads, comm, tracker", CP_ROWS,
                         ids=["-".join(map(str, r)) for r in CP_ROWS])
def test_context_parallel_rows_are_refused_exactly_where_ulysses_cannot_carry_them(arch, dropout, sink, heads, comm,
                                                                                    tracker):
    """Both paths run CP as Ulysses around flash_attn_func (which takes a sink): the plan refuses dropout
    without megatron-core's seeded RNG tracker (B30-rng) and heads not divisible by the CP size (cp-heads),
    nothing else, on either arch and path.  The layers themselves are run over 2 and 4 processes in
    tests/megatron/test_cp_ulysses.py, and their dropout in tests/megatron/test_dropout_rng.py."""
    hq, hkv = heads
    layer = facts(num_heads=hq, num_kv_heads=hkv, head_dim=D, seq_length=S, dtype="bf16", packed=False,
                  attention_dropout=dropout, context_parallel_size=2, cp_comm_type=comm, rng_tracker=tracker)
    expected = {"B30-rng"} if dropout and not tracker else set()
    expected |= {"cp-heads"} if hq % 2 or hkv % 2 else set()
    with fake_primus_turbo(arch=arch):
        for flex in (False, True):
            keys = dict(use_turbo_flex_attention=flex, turbo_flex_attention_backend="turbo", turbo_arch=arch,
                        use_sink_attention=sink)
            try:
                build_plan(settings(**keys), layer)
                codes: set = set()
            except UnsupportedConfigError as exc:
                codes = set(exc.codes)
            assert codes == expected, (flex, codes, expected)


def test_fake_flex_varlen_refuses_a_sink_with_documents_of_unequal_length():
    """No backend takes it on any arch (attention_impl.py l.331-334, l.375-394 at a6a16cd), so the flex layer
    refuses it; the fake is never kinder."""
    q, k, v = sbhd_qkv(1, 8, 1, BF16)
    with fake_primus_turbo():
        import primus_turbo.pytorch.ops as ops

        unequal = torch.tensor(UNEQUAL, dtype=torch.int32)
        with pytest.raises(ValueError, match="equal length"):
            ops.flex_attention_varlen(q[0], k[0], v[0], unequal, unequal, 11, 11, causal=True, sink=torch.zeros(8))
        equal = torch.tensor(EQUAL, dtype=torch.int32)
        ops.flex_attention_varlen(q[0], k[0], v[0], equal, equal, 8, 8, causal=True, sink=torch.zeros(8))


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_a_sink_with_a_left_window_of_zero_is_attended_unbounded_by_aiter_and_refused(arch):
    """aiter's Triton sink kernels apply the left bound only when it is > 0: a window (0, 0) with a
    sink attends causally.  The fake computes that (never kinder), and the plan refuses the layer."""
    q, k, v = (t.contiguous() for t in sbhd_qkv(2, 4, 2, BF16))
    sink = rand(4, dtype=torch.float32, seed=9)
    with fake_primus_turbo(arch=arch) as fake:
        import primus_turbo.pytorch.ops as ops

        out = ops.flash_attn_func(q, k, v, causal=True, window_size=(0, 0), sink=sink)
        assert fake.calls[-1].backend == "AITER"
        want = oracle.attention(q, k, v, oracle.window(-1, 0), sink=sink.tolist())  # the kernel's answer
        torch.testing.assert_close(out.double(), want, **OUT_TOL)
        with pytest.raises(UnsupportedConfigError, match="left window bound of 0") as err:
            build_plan(settings(turbo_flex_attention_backend="turbo", turbo_arch=arch, use_sink_attention=True,
                                turbo_flex_attention_mask_mod="primus_ext.attention.masks:sliding_window",
                                turbo_flex_attention_mask_mod_kwargs={"left": 0, "right": 0}),
                       facts(num_heads=4, num_kv_heads=2, head_dim=D, seq_length=S, dtype="bf16", packed=False))
        assert "B33" in err.value.codes


def test_flydsl_takes_a_value_head_dim_of_its_own_and_reads_it_wrong_so_it_is_refused():
    """FlyDSL's gate reads q's head dim only: D 128 with Dv 64 is taken, and its output is allocated
    like q.  The fake will not compute what it cannot reproduce; the plan refuses the call."""
    q = rand(1, S, 8, 128, dtype=BF16, seed=0)
    k = rand(1, S, 1, 128, dtype=BF16, seed=1)
    v = rand(1, S, 1, 64, dtype=BF16, seed=2)
    found = route(CallFeatures(arch="gfx950", entry=DENSE, dtype="bf16", head_dim=128, head_dim_v=64, heads=8,
                               kv_heads=1))
    assert found.backend == "FlyDSL" and not found.ok
    with fake_primus_turbo(arch="gfx950") as fake:
        import primus_turbo.pytorch.ops as ops

        with pytest.raises(NotImplementedError, match="cannot reproduce"):
            ops.flash_attn_func(q, k, v, causal=True)
        assert fake.calls[-1].backend == "FlyDSL"
