"""The attention ops on gfx950's kernel levels: FlyDSL's and HipKittens' pairs (`turbo_pairs_gfx950`).

The gfx942 version is in `test_ops` (AITER's pair).  On the CPU fake with gfx950 modelled:

* ``torch.library.opcheck`` passes for the forward and backward ops where they call FlyDSL's
  ``_impl`` wrappers (dense sbhd with and without a sink, windows of 64 and unbounded;
  varlen with equal documents of exactly ``max_seqlen``) and HipKittens' (pinned with
  ``PRIMUS_TURBO_ATTN_BACKEND=hipkittens``, the only way its dispatcher reaches it);
* through the ops the forward runs the kernel-level forward once and the backward the
  kernel-level backward once, and gradients equal the public entry's own autograd;
* where the backend eager runs is not known from metadata (a varlen call whose documents may
  or may not be equal, autotune) or a gate fails, nothing is bound and the backward op
  recomputes through the public entry;
* the fake's kernel levels are never kinder than upstream's: FlyDSL's asserts and layouts,
  its ragged varlen backward without ``dsink``, HipKittens' envelope and the two faults.
"""

from __future__ import annotations

import pytest
import torch

from primus_ext.backends import turbo_kernels
from primus_ext.call.ops import CallArgs
from primus_ext.backends.turbo_pairs_gfx950 import FlydslPair, KernelOutputError
from primus_ext.testing import fake_primus_turbo
from primus_ext.testing._fake_math import FLYDSL_NARROW_WINDOW_BACKWARD_NAN, HIPKITTENS_FORWARD_SKIPS_ROWS

from ..helpers import adapter, facts, settings
from .test_ops import OPS, Case, backward_args, forward_args, forward_op, op_and_eager_grads

HQ, HKV, D = 8, 1, 64
BOUNDS = (0, 16, 32, 48)  # equal documents of 16 tokens: FlyDSL's uniform path
UNEQUAL = (0, 10, 32, 48)
_ALIVE: list = []

FLYDSL_CASES = [
    Case("flydsl-causal-sink", torch.bfloat16, sink=True, kv_heads=HKV, causal=True, window=(-1, -1), lse=True),
    Case("flydsl-window64", torch.bfloat16, sink=False, kv_heads=HKV, causal=True, window=(64, 0)),
    Case("flydsl-window64-sink", torch.bfloat16, sink=True, kv_heads=HKV, causal=True, window=(64, 0)),
]
FLYDSL_OPS = {"flash_attn_sbhd_flydsl_forward", "flash_attn_sbhd_flydsl_backward",
              "flash_attn_varlen_flydsl_forward", "flash_attn_varlen_flydsl_backward"}
HK_CASE = Case("hipkittens-causal", torch.bfloat16, sink=False, kv_heads=2, causal=True, window=(-1, -1), lse=True)


def handle(case: Case, packed: bool, seq: int = 80) -> int:
    window = case.window[0] if case.window[0] > 0 else 0
    keys = dict(turbo_flex_attention_backend="turbo", use_sink_attention=case.sink, sink_sliding_window=window,
                turbo_arch="gfx950")
    run = adapter(settings(**keys), facts(num_heads=HQ, num_kv_heads=case.kv_heads, head_dim=D, packed=packed,
                                          dtype="bf16", seq_length=seq))
    _ALIVE.append(run)
    return run.handle


def sbhd_inputs(case: Case, grad: bool, b: int = 2, s: int = 80) -> tuple:
    """bshd views of contiguous sbhd memory (Megatron's layout; FlyDSL takes nothing else)."""
    gen = torch.Generator().manual_seed(0)
    made = [torch.randn(s, b, h, D, generator=gen).to(torch.bfloat16).transpose(0, 1)
            for h in (HQ, case.kv_heads, case.kv_heads)]
    return tuple(t.requires_grad_(grad) for t in made)


def thd_inputs(case: Case, grad: bool, bounds=BOUNDS) -> tuple:
    gen = torch.Generator().manual_seed(1)
    made = [torch.randn(bounds[-1], h, D, generator=gen).to(torch.bfloat16) for h in (HQ, case.kv_heads,
                                                                                      case.kv_heads)]
    return tuple(t.requires_grad_(grad) for t in made)


def sink_for(case: Case, grad: bool = False):
    return torch.linspace(-1.0, 1.0, HQ).requires_grad_(grad) if case.sink else None


def patched_layout(monkeypatch, bounds=BOUNDS) -> None:
    """`test_ops`' helpers, for this file's shapes: inputs, boundaries and the longest document."""
    from . import test_ops

    monkeypatch.setattr(test_ops, "BOUNDS", bounds)
    monkeypatch.setattr(test_ops, "LONGEST", max(b - a for a, b in zip(bounds, bounds[1:])))
    monkeypatch.setattr(test_ops, "inputs", lambda case, packed, grad: (
        thd_inputs(case, grad, bounds) if packed else sbhd_inputs(case, grad)))
    monkeypatch.setattr(test_ops, "sink_for", lambda case, grad=False, dtype=None: sink_for(case, grad))


def opcheck_both(case: Case, packed: bool, h: int) -> list:
    q, k, v = (thd_inputs if packed else sbhd_inputs)(case, grad=True)
    sink = sink_for(case, grad=True)
    results = [torch.library.opcheck(forward_op(packed), forward_args(case, h, packed, q, k, v, sink))]
    q, k, v = (t.detach() for t in (q, k, v))
    grad_out = torch.randn(*q.shape[:-1], v.shape[-1], generator=torch.Generator().manual_seed(5)).to(q.dtype)
    op = OPS.varlen_attention_backward.default if packed else OPS.dense_attention_backward.default
    plain = None if sink is None else sink.detach()
    results.append(torch.library.opcheck(op, backward_args(case, h, packed, grad_out, q, k, v, plain)))
    return results


LAYOUTS = [("bshd", c) for c in FLYDSL_CASES] + [("thd", FLYDSL_CASES[1])]  # no varlen sink on gfx950 (B33)


@pytest.mark.parametrize("layout,case", LAYOUTS, ids=str)
def test_opcheck_on_flydsls_kernel_pair(layout, case, monkeypatch):
    packed = layout == "thd"
    patched_layout(monkeypatch)
    with fake_primus_turbo(arch="gfx950") as fake:
        results = opcheck_both(case, packed, handle(case, packed))
    for result in results:
        assert set(result.values()) == {"SUCCESS"}, result
    assert {c.entry for c in fake.calls} <= FLYDSL_OPS and fake.calls, {c.entry for c in fake.calls}


@pytest.mark.parametrize("layout,case", LAYOUTS, ids=str)
def test_flydsl_pair_gradients_equal_the_public_entrys_autograd(layout, case, monkeypatch):
    packed = layout == "thd"
    patched_layout(monkeypatch)
    with fake_primus_turbo(arch="gfx950") as fake:
        out, got, expected_out, expected, kernel = op_and_eager_grads(handle(case, packed), case, packed, fake)
        eager = [(c.entry, c.backend) for c in fake.calls][len(kernel):]
    prefix = "flash_attn_varlen_flydsl_" if packed else "flash_attn_sbhd_flydsl_"
    assert kernel == [prefix + "forward", prefix + "backward"], kernel
    assert eager == [("flash_attn_varlen_func" if packed else "flash_attn_func", "FlyDSL")], eager
    torch.testing.assert_close(out, expected_out, rtol=0, atol=0)
    for name, g, e in zip(("dq", "dk", "dv", "dsink"), got, expected):
        assert g.abs().sum() > 0, f"{name} is zero: the comparison would prove nothing"
        torch.testing.assert_close(g, e, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("bounds,longest", [(UNEQUAL, 22), (BOUNDS, 20)], ids=["unequal", "equal-loose-max"])
def test_a_varlen_call_eager_may_give_to_flydsl_or_aiter_binds_nothing(bounds, longest, monkeypatch):
    """Equal documents are proven by metadata only when ``B * max_seqlen`` is the token count;
    otherwise eager's dispatcher reads the boundaries (FlyDSL if equal, else AITER), so the
    compiled backward recomputes through ``flash_attn_varlen_func``, as eager picks."""
    patched_layout(monkeypatch, bounds)
    from . import test_ops

    monkeypatch.setattr(test_ops, "LONGEST", longest)
    case = FLYDSL_CASES[1]
    with fake_primus_turbo(arch="gfx950") as fake:
        _, got, _, expected, kernel = op_and_eager_grads(handle(case, True), case, True, fake)
    assert set(kernel) == {"flash_attn_varlen_func"} and len(kernel) == 2, kernel  # forward, and the recompute
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_hipkittens_pair_where_a_pin_routes_the_call_there(monkeypatch):
    monkeypatch.setenv("PRIMUS_TURBO_ATTN_BACKEND", "hipkittens")
    patched_layout(monkeypatch)
    with fake_primus_turbo(arch="gfx950") as fake:
        h = handle(HK_CASE, False)
        results = opcheck_both(HK_CASE, False, h)
        fake.reset()
        out, got, expected_out, expected, kernel = op_and_eager_grads(h, HK_CASE, False, fake)
        eager = [(c.entry, c.backend) for c in fake.calls][len(kernel):]
    for result in results:
        assert set(result.values()) == {"SUCCESS"}, result
    assert kernel == ["hipkittens_attn_forward", "hipkittens_attn_backward"], kernel
    assert eager == [("flash_attn_func", "HipKittens")], eager
    torch.testing.assert_close(out, expected_out, rtol=0, atol=0)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_autotune_binds_nothing_where_more_than_one_backend_takes_the_call(monkeypatch):
    monkeypatch.setenv("PRIMUS_TURBO_AUTO_TUNE", "1")
    patched_layout(monkeypatch)
    case = Case("autotuned", torch.bfloat16, sink=False, kv_heads=HKV, causal=True, window=(-1, -1))
    with fake_primus_turbo(arch="gfx950") as fake:
        _, _, _, _, kernel = op_and_eager_grads(handle(case, False), case, False, fake)
    assert kernel == ["flash_attn_func", "flash_attn_func"], kernel  # FlyDSL, AITER or HipKittens: timed


# -- the gates, one at a time ----------------------------------------------------------------
def call(q, k, v, *, sink=None, window=(-1, -1), scale=None, cu=None, longest=0) -> CallArgs:
    return CallArgs(q, k, v, cu, cu, longest or q.shape[1], longest or k.shape[1], sink, None, None, True, window,
                    scale, 0.0, False)


@pytest.mark.parametrize("change,bound", [
    ({}, True), ({"window": (63, 0)}, False), ({"window": (64, 0)}, True), ({"window": (64, 1)}, False),
    ({"scale": 0.2}, False), ({"kv_heads": 2}, False), ({"kv_heads": 4}, False), ({"sink32": False}, False),
    ({"bshd": True}, False),
], ids=["bound", "window-63", "window-64", "right-1", "scale", "group-4", "group-2", "bf16-sink", "bshd-storage"])
def test_flydsl_gates(change, bound):
    case = Case("gate", torch.bfloat16, sink=True, kv_heads=change.get("kv_heads", HKV), causal=True,
                window=change.get("window", (-1, -1)))
    q, k, v = sbhd_inputs(case, grad=False)
    if change.get("bshd"):
        q, k, v = (t.contiguous() for t in (q, k, v))
    sink = torch.zeros(HQ, dtype=torch.float32 if change.get("sink32", True) else torch.bfloat16)
    with fake_primus_turbo(arch="gfx950"):
        routes = turbo_kernels.CallRoutes("gfx950")
        pair = turbo_kernels.kernel_pair(turbo_kernels.discover_kernels(), routes,
                                         call(q, k, v, sink=sink, window=case.window, scale=change.get("scale")),
                                         True, case.window)
    assert isinstance(pair, FlydslPair) is bound, pair


def test_flydsl_pair_refuses_a_backward_that_drops_dsink():
    """FlyDSL's ragged varlen backward returns no dsink: the pair raises our error rather than
    train the sink with a zero gradient (it binds only the uniform path, where dsink exists)."""
    case = FLYDSL_CASES[0]
    q, k, v = thd_inputs(case, grad=False)
    cu = torch.tensor(BOUNDS, dtype=torch.int32)
    with fake_primus_turbo(arch="gfx950"):
        fns = turbo_kernels.discover_kernels().flydsl
        pair = FlydslPair(fns, True, (-1, -1))
        ragged = call(q, k, v, sink=torch.zeros(HQ), cu=cu, longest=20)  # loose max: the ragged path
        out, lse, rng = pair.forward(ragged)
        with pytest.raises(KernelOutputError, match="no dsink"):
            pair.backward(ragged, torch.ones_like(out), out.contiguous(), lse.contiguous(), rng)
        uniform = ragged._replace(max_q=16, max_kv=16)
        out, lse, rng = pair.forward(uniform)
        assert pair.backward(uniform, torch.ones_like(out), out.contiguous(), lse.contiguous(), rng)[3].shape == (HQ,)


# -- the fake's kernel levels: upstream's preconditions and the faults ------------------------
def test_fake_flydsl_asserts_and_layouts():
    from primus_ext.testing import _fake_flydsl as fly

    case = FLYDSL_CASES[0]
    q, k, v = (t.transpose(0, 1) for t in sbhd_inputs(case, grad=False, s=16))  # contiguous sbhd
    with fake_primus_turbo(arch="gfx950"):
        out, lse = fly.flash_attn_sbhd_flydsl_forward_impl(q, k, v, return_lse=True, sink=torch.zeros(HQ))
        assert out.shape == q.shape and out.is_contiguous() and lse.shape == (2 * 16, HQ)
        assert fly.flash_attn_sbhd_flydsl_forward_impl(q, k, v, return_lse=False).shape == q.shape
        assert torch.ops.primus_turbo.flash_attn_sbhd_flydsl_forward(q, k, v, -1, False, None)[1].shape == (0,)
        non_contiguous = k.transpose(0, 1).contiguous().transpose(0, 1)
        for (tq, tk), kw, match in (((q, k), dict(causal=False), "causal"), ((q, k), dict(softmax_scale=0.2), "1/sqrt"),
                                    ((q, k), dict(window_size=(64, 3)), "left-window"),
                                    ((q, k), dict(sink=torch.zeros(HQ).bfloat16()), "fp32"),
                                    ((q.float(), k), {}, "bf16"), ((q, non_contiguous), {}, "contiguous")):
            with pytest.raises(AssertionError, match=match):
                fly.flash_attn_sbhd_flydsl_forward_impl(tq, tk, v, **kw)
        bhsq = lse.view(2, 16, HQ).permute(0, 2, 1)
        assert len(fly.flash_attn_sbhd_flydsl_backward_impl(out, q, k, v, out, bhsq)) == 3
        with pytest.raises(RuntimeError, match="lse must be"):  # the forward's own layout, unconverted
            fly.flash_attn_sbhd_flydsl_backward_impl(out, q, k, v, out, lse)
        gqa2 = k.expand(-1, -1, 4, -1).contiguous()
        with pytest.raises(NotImplementedError, match="outside what the dkdv kernel"):
            fly.flash_attn_sbhd_flydsl_backward_impl(out, q, gqa2, gqa2, out, bhsq)
    with fake_primus_turbo(arch="gfx942"), pytest.raises(RuntimeError, match="gfx950"):
        fly.flash_attn_sbhd_flydsl_forward_impl(q, k, v)


@pytest.mark.parametrize("arch,faults,nan", [
    ("gfx950", (), True), (None, (), False), (None, (FLYDSL_NARROW_WINDOW_BACKWARD_NAN,), True)],
    ids=["gfx950-always", "no-arch-off", "no-arch-switched-on"])
def test_flydsl_fault_narrow_window_backward_nan(arch, faults, nan):
    from primus_ext.testing import _fake_flydsl as fly

    case = FLYDSL_CASES[1]
    q, k, v = (t.transpose(0, 1) for t in sbhd_inputs(case, grad=False, s=16))
    kw = dict(window_size=(8, 0))
    with fake_primus_turbo(arch=arch, faults=faults):
        out, lse = fly.flash_attn_sbhd_flydsl_forward_impl(q, k, v, return_lse=True, **kw)
        assert torch.isfinite(out.float()).all()  # the forward is right
        dq, dk, dv = fly.flash_attn_sbhd_flydsl_backward_impl(out, q, k, v, out, lse.view(2, 16, HQ).permute(0, 2, 1),
                                                             **kw)
        wide = fly.flash_attn_sbhd_flydsl_backward_impl(out, q, k, v, out, lse.view(2, 16, HQ).permute(0, 2, 1),
                                                       window_size=(64, 0))
    assert bool(torch.isnan(dq.float()).any()) is nan and torch.isfinite(dk.float()).all()
    assert torch.isfinite(wide[0].float()).all()


@pytest.mark.parametrize("faults", [(), (HIPKITTENS_FORWARD_SKIPS_ROWS,)], ids=["checked", "fault"])
def test_fake_hipkittens_envelope_and_the_rows_fault(faults):
    from primus_ext.testing import _fake_hipkittens as hk

    gen = torch.Generator().manual_seed(2)
    q = torch.randn(24, 1, 4, 64, generator=gen).bfloat16()
    k = v = torch.randn(16, 1, 2, 64, generator=gen).bfloat16()
    with fake_primus_turbo(arch="gfx950", faults=faults):
        ok, why = hk.hipkittens_attn_supported_impl(q, k, v, causal=True)
        assert hk.hipkittens_attn_supported(q[:16], k, v, causal=True) == (True, "")
        for bad, match in (((q[:16], k, v[:, :, :1].contiguous()), "shape mismatch"), ((q[:16].float(), k, v), "bf16"),
                           ((q[:16].transpose(0, 2).contiguous().transpose(0, 2), k, v), "contiguous")):
            refused, reason = hk.hipkittens_attn_supported(*bad, causal=True)
            assert not refused and match in reason, reason
        assert hk.hipkittens_attn_supported(q[:16], k, v, causal=True, sink=torch.zeros(4))[0] is False
        if not faults:
            assert not ok and "Sq > Skv" in why
            with pytest.raises(NotImplementedError, match="Sq > Skv"):
                hk.flash_attn_sbhd_hipkittens_forward_impl(q, k, v)
            return
        assert ok
        out, lse = hk.flash_attn_sbhd_hipkittens_forward_impl(q, k, v)
    assert lse.shape == (1, 4, 1, 24) and not lse.is_contiguous()  # a view of the tile-padded buffer
    assert torch.isnan(out[:8].float()).all() and torch.isfinite(out[8:].float()).all()


def test_fake_hipkittens_forward_has_a_fixed_zero_reference_max():
    """Fact `hipkittens-zero-max`: exp2 of each logit in fp32 with no running max.  Query rows (sbhd, batch 0,
    head 0) 20: logits of 100 (NaN, lse inf); 60: 61 logits of 85 each, whose sum alone overflows (zeros, lse
    inf); 40: every logit at -100, flushed (NaN, lse -inf).  Every other row is the online softmax's, the
    public entry pinned to HipKittens returns the kernel level's answer, and its backward runs from it."""
    from primus_ext.testing import _fake_hipkittens as hk

    gen = torch.Generator().manual_seed(4)
    s, d = 96, 64
    q, k, v = (torch.randn(s, 1, h, d, generator=gen) for h in (4, 2, 2))
    unit = torch.ones(d) / d ** 0.5
    k[:64, 0, 0] = 8 * unit + 0.01 * torch.randn(64, d, generator=gen)  # a logit is about (q . unit) against these
    q[20, 0, 0] = 100 * unit  # causal: row i sees keys 0..i, all of them aligned here
    q[60, 0, 0] = 85 * unit  # 61 e^85 > FLT_MAX, each term finite
    q[40, 0, 0] = -100 * unit
    q, k, v = (t.bfloat16() for t in (q, k, v))
    with fake_primus_turbo(arch="gfx950") as fake:
        out, lse = hk.hipkittens_attn_forward(q, k, v)
        from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager

        GlobalBackendManager.set_attn_backend(BackendType.HIPKITTENS)
        views = [t.transpose(0, 1).requires_grad_() for t in (q, k, v)]
        public, public_lse = fake.module.flash_attn_func(*views, causal=True, return_lse=True)
        public.float().sum().backward()
        GlobalBackendManager.set_attn_backend(BackendType.AITER)
        online = fake.module.flash_attn_func(*(t.transpose(0, 1) for t in (q, k, v)), causal=True)
    rows = out[:, 0, 0].float()
    assert torch.isnan(rows[20]).all() and lse[0, 0, 0, 20] == float("inf")
    assert (rows[60] == 0).all() and lse[0, 0, 0, 60] == float("inf")
    assert torch.isnan(rows[40]).all() and lse[0, 0, 0, 40] == float("-inf")
    bad = torch.zeros(s, 1, 4, dtype=torch.bool)
    bad[[20, 40, 60], 0, 0] = True
    assert torch.isfinite(online).all() and torch.isfinite(out[~bad].float()).all()
    torch.testing.assert_close(out[~bad], online.transpose(0, 1)[~bad], rtol=0, atol=0)
    torch.testing.assert_close(public.transpose(0, 1), out, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(public_lse, lse.squeeze(2), rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(views[0].grad[0, 20, 0].float()).all()  # the NaN row reaches the gradients too


@pytest.mark.parametrize("layout", ["bshd", "thd"])
@pytest.mark.parametrize("env,atomic", [(None, True), ("0", False), ("yes", True)], ids=["unset", "0", "other"])
def test_aiter_pair_on_gfx950_passes_the_backward_flags_flash_attn_func_would(layout, env, atomic, monkeypatch):
    """A GQA group of 4 sends the call to AITER on gfx950 too; its backward then gets
    ``how_v3_bf16_cvt=0`` (compute capability 9.5) and ``is_v3_atomic_fp32`` read from
    ``PRIMUS_TURBO_ATTN_V3_ATOMIC_FP32``, as the public entry passes them."""
    if env is not None:
        monkeypatch.setenv("PRIMUS_TURBO_ATTN_V3_ATOMIC_FP32", env)
    packed = layout == "thd"
    patched_layout(monkeypatch)
    case = Case("aiter-gfx950", torch.bfloat16, sink=False, kv_heads=2, causal=True, window=(-1, -1))
    with fake_primus_turbo(arch="gfx950") as fake:
        op_and_eager_grads(handle(case, packed), case, packed, fake)
        name = "attention_aiter_varlen_backward_impl" if packed else "attention_aiter_backward_impl"
        (backward,) = fake.calls_to(name)
    assert (backward.args["is_v3_atomic_fp32"], backward.args["how_v3_bf16_cvt"]) == (atomic, 0)


def test_each_kernel_backend_has_a_fault_switch():
    from primus_ext.testing import _fake_math

    assert set(_fake_math.FAULT_BACKEND) == _fake_math.FAULTS
    assert set(_fake_math.FAULT_BACKEND.values()) == {"AITER", "FlyDSL", "HipKittens"}
    with pytest.raises(ValueError, match="unknown"):
        with fake_primus_turbo(faults=("flydsl_is_slow",)):
            pass
