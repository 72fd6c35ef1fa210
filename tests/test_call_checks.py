"""B34 at the adapter: every call input honoured or refused with the project's error.

The sweep calls the flex adapter (reference and turbo backends) and Megatron's direct path
with the inputs that used to escape as a kernel's ``ValueError`` or a torch ``RuntimeError``,
and asserts that only `PrimusExtError` subclasses come out; where an input is accepted
(int64 boundaries) the result is held to the float64 oracle.
"""

from __future__ import annotations

import types

from typing import Any, Callable

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType

from primus_ext.errors import PrimusExtError, UnsupportedInputError
from primus_ext.megatron import PrimusTurboLocalAttention
from primus_ext.plan import build_plan
from primus_ext.call.adapter import TurboFlexAttention
from primus_ext.testing import fake_primus_turbo

from . import oracle
from .helpers import adapter, facts, packed_qkv, qkv, settings
from .megatron import gpt

TOL = dict(atol=1e-10, rtol=1e-10)
CU = [0, 4, 11]


def _cu(dtype=torch.int32):
    return torch.tensor(CU, dtype=dtype)


def packed_call(run: Any, **over: Any):
    """``run.varlen`` (``flash_attn_varlen_func``'s arguments) on 11 packed tokens, ``over`` replacing them."""
    q, k, v = packed_qkv(11)
    kw = dict(causal=True, cu_seqlens_q=_cu(), cu_seqlens_kv=_cu(), max_seqlen_q=7, max_seqlen_kv=7)
    kw.update(over)
    bounds = [kw.pop(name) for name in ("cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q", "max_seqlen_kv")]
    return run.varlen(q, k, v, *bounds, **kw)


SWEEP: dict[str, Callable[[Callable], Any]] = {
    "max_seqlen below the longest document": lambda run: packed_call(run, max_seqlen_q=3, max_seqlen_kv=3),
    "cu_seqlens as a Python list": lambda run: packed_call(run, cu_seqlens_q=CU, cu_seqlens_kv=CU),
    "cu_seqlens not ending at T": lambda run: packed_call(run, cu_seqlens_q=torch.tensor([0, 4, 9], dtype=torch.int32),
                                                          cu_seqlens_kv=torch.tensor([0, 4, 9], dtype=torch.int32)),
    "cu_seqlens decreasing": lambda run: packed_call(run, cu_seqlens_q=torch.tensor([0, 8, 4, 11], dtype=torch.int32),
                                                     cu_seqlens_kv=torch.tensor([0, 8, 4, 11], dtype=torch.int32)),
    "cu_seqlens not starting at 0": lambda run: packed_call(run, cu_seqlens_q=torch.tensor([2, 11], dtype=torch.int32),
                                                            cu_seqlens_kv=torch.tensor([2, 11], dtype=torch.int32)),
    "cu_seqlens of one element": lambda run: packed_call(run, cu_seqlens_q=torch.tensor([0], dtype=torch.int32),
                                                         cu_seqlens_kv=torch.tensor([0], dtype=torch.int32)),
    "cu_seqlens 2-D": lambda run: packed_call(run, cu_seqlens_q=_cu()[None], cu_seqlens_kv=_cu()[None]),
    "cu_seqlens float": lambda run: packed_call(run, cu_seqlens_q=_cu().float(), cu_seqlens_kv=_cu().float()),
    "max_seqlen zero": lambda run: packed_call(run, max_seqlen_q=0, max_seqlen_kv=0),
    "mixed q/k/v dtypes": lambda run: run(*(lambda q, k, v: (q, k.float(), v))(*qkv())),
    "integer q": lambda run: run(*(lambda q, k, v: (q.long(), k.long(), v.long()))(*qkv())),
    "more query heads than planned": lambda run: run(*qkv(hq=8)),
    "fewer key/value heads than planned": lambda run: run(*qkv(hkv=1)),
    "window below -1": lambda run: run(*qkv(), causal=True, window_size=(-2, 0)),
    "window of three ints": lambda run: run(*qkv(), window_size=(1, 0, 2)),
    "window not ints": lambda run: run(*qkv(), window_size="wide"),
    "q not a tensor": lambda run: run([[1.0]], *qkv()[1:]),
    # found by the hostile review of issue 13 (the fast path), kept for both paths
    "k on the meta device": lambda run: run(*(lambda q, k, v: (q, k.to("meta"), v))(*qkv())),
    "bias that does not broadcast": lambda run: run(*qkv(), bias=torch.zeros(3, 16, 16, dtype=torch.float64)),
    "cu_seqlens empty": lambda run: packed_call(run, cu_seqlens_q=torch.empty(0, dtype=torch.int32),
                                                cu_seqlens_kv=torch.empty(0, dtype=torch.int32)),
    "q and kv with different document counts": lambda run: packed_call(
        run, cu_seqlens_q=_cu(), cu_seqlens_kv=torch.tensor([0, 5, 8, 11], dtype=torch.int32)),
    # found by the second hostile review of issue 13
    "alibi_slopes as a list": lambda run: run(*qkv(), causal=True, alibi_slopes=[0.1, 0.2, 0.3, 0.4]),
    "alibi_slopes of the wrong length": lambda run: run(*qkv(), causal=True, alibi_slopes=torch.ones(3)),
    "dropout_p above 1": lambda run: run(*qkv(), causal=True, dropout_p=1.5),
    "dropout_p negative": lambda run: run(*qkv(), causal=True, dropout_p=-0.1),
    "dropout_p too large for a float": lambda run: run(*qkv(), causal=True, dropout_p=10**400),
    "window of floats": lambda run: run(*qkv(), causal=True, window_size=(2.5, 0)),
    "window infinite": lambda run: run(*qkv(), causal=True, window_size=(float("inf"), 0)),
    "cu_seqlens int64 wrapping in int32": lambda run: packed_call(
        run, cu_seqlens_q=torch.tensor([0, 2**32 + 4, 11]), cu_seqlens_kv=torch.tensor([0, 2**32 + 4, 11])),
    "one boundary tensor for q and kv of different token counts": lambda run: (
        lambda q, kv, cu: run.varlen(q, kv[0], kv[1], causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=7,
                              max_seqlen_k=7))(packed_qkv(11)[0], packed_qkv(14)[1:], _cu()),
}


@pytest.mark.parametrize("backend", ["reference", "turbo"])
@pytest.mark.parametrize("name", sorted(SWEEP))
def test_no_foreign_exception_escapes_the_adapter(name, backend):
    with fake_primus_turbo(arch=None):
        run = adapter(settings(turbo_flex_attention_backend=backend), facts(packed=None))
        with pytest.raises(PrimusExtError) as err:
            SWEEP[name](run)
    assert isinstance(err.value, UnsupportedInputError), err.value
    assert err.value.settings, "the error names no argument or setting"


@pytest.mark.parametrize("name", [n for n in sorted(SWEEP) if "cu_seqlens" in n or "max_seqlen" in n])
def test_no_foreign_exception_escapes_megatrons_direct_packed_path(name):
    """The same packed inputs through PrimusTurboLocalAttention on the direct path (its own checks)."""
    with fake_primus_turbo() as fake:
        layer = PrimusTurboLocalAttention(gpt.config(kv_channels=8), 1, AttnMaskType.causal, "self",
                                          settings=gpt.settings())

        def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal):
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_k,
                                     max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_k)
            return layer(q.float(), k.float(), v.float(), None, packed_seq_params=params)

        run = types.SimpleNamespace(varlen=varlen)

        with pytest.raises(UnsupportedInputError):
            SWEEP[name](run)
    assert fake.calls == []


@pytest.mark.parametrize("backend", ["reference", "turbo"])
def test_int64_boundaries_are_cast_once_and_compute_exactly(backend):
    """torch's default integer dtype is accepted: cast to int32 on the device, then the kernel."""
    with fake_primus_turbo() as fake:
        run = adapter(settings(turbo_flex_attention_backend=backend), facts(packed=True))
        out = packed_call(run, cu_seqlens_q=_cu(torch.int64), cu_seqlens_kv=_cu(torch.int64))
    q, k, v = packed_qkv(11)
    torch.testing.assert_close(out, oracle.packed_attention(q, k, v, CU), **TOL)
    if backend == "turbo":
        assert fake.calls[-1].args["cu_seqlens_q"].dtype == torch.int32


def test_a_call_window_other_than_the_plans_is_planned_like_the_layer():
    """B34 / item 3: a sink layer planned causal on gfx942, called with a two-sided window, would run
    AITER's sink kernel whose backward drops the right bound: refused, as the plan refuses it.  Calls
    passing their own window are drop-in calls (a plan-mode adapter refuses every other window)."""
    q, k, v = (t.bfloat16() for t in qkv(d=16))
    sink = torch.zeros(4)
    with fake_primus_turbo(arch="gfx942") as fake:
        plan = build_plan(settings(turbo_flex_attention_backend="turbo", turbo_arch="gfx942", use_sink_attention=True),
                          facts(head_dim=16, dtype="bf16", packed=False))
        run = TurboFlexAttention(plan, drop_in=True)
        run(q, k, v, causal=True, sink=sink)  # the planned call
        run(q, k, v, causal=True, window_size=(4, 0), sink=sink)  # another window, also fine on AITER
        for _ in range(2):
            with pytest.raises(UnsupportedInputError, match="sink backward ignores") as err:
                run(q, k, v, causal=False, window_size=(4, 4), sink=sink)
        assert "B33" in err.value.codes and "window_size=(4, 4)" in str(err.value)
    assert [c.args["window_size"] for c in fake.calls] == [(-1, -1), (4, 0)]


def test_deterministic_at_a_call_reaches_the_kernel_on_every_build():
    q, k, v = qkv()
    for build in ("main", "old", "newest"):
        with fake_primus_turbo(build=build) as fake:
            adapter(settings(turbo_flex_attention_backend="turbo"))(q, k, v, causal=True, deterministic=True)
        assert fake.calls[-1].args["deterministic"] is True, build


DENSE_SWEEP = {
    "mixed q/k/v dtypes": lambda q, k, v: (q, k.double(), v),
    "integer q, k, v": lambda q, k, v: (q.long(), k.long(), v.long()),
    "more query heads than built": lambda q, k, v: (torch.cat([q, q], dim=2), k, v),
    "fewer key/value heads than built": lambda q, k, v: (q, k[:, :, :1], v[:, :, :1]),
    "v of another length": lambda q, k, v: (q, k, v[:-1]),
}


@pytest.mark.parametrize("path", ["direct", "flex-reference", "flex-turbo"])
@pytest.mark.parametrize("name", sorted(DENSE_SWEEP))
def test_no_foreign_exception_escapes_megatrons_dense_calls(name, path):
    from tests.megatron.test_refusals import qkv_sbhd

    flex = dict(use_turbo_flex_attention=True)
    keys = {"direct": {}, "flex-reference": dict(flex, turbo_flex_attention_backend="reference"),
            "flex-turbo": dict(flex, turbo_flex_attention_backend="turbo")}[path]
    with fake_primus_turbo() as fake:
        layer = PrimusTurboLocalAttention(gpt.config(kv_channels=16), 1, AttnMaskType.causal, "self",
                                          settings=gpt.settings(**keys))
        with pytest.raises(UnsupportedInputError):
            layer(*DENSE_SWEEP[name](*qkv_sbhd()), None)
    assert fake.calls == []


def _sbhd(h: int, dtype=torch.bfloat16, arch=None):
    """Megatron's sbhd memory as the modules pass it on ``arch``: a bshd view, contiguous on gfx942."""
    view = torch.randn(128, 2, h, 64).to(dtype).transpose(0, 1)
    return view.contiguous() if arch == "gfx942" else view


UNPLANNED_CALLS = [
    ("gfx942", {}, dict(deterministic=True)),  # AITER asserts on deterministic + sink
    ("gfx942", {}, dict(dtype=torch.float32)),  # no backend takes fp32
    ("gfx950", {"deterministic_mode": True}, dict(layout="bshd")),  # not sbhd: FlyDSL passes, AITER asserts
    ("gfx950", {"deterministic_mode": True}, dict(dropout_p=0.1)),  # dropout leaves FlyDSL for AITER
]


@pytest.mark.parametrize("warm", [False, True], ids=["first", "after-the-planned-call"])
@pytest.mark.parametrize("arch, keys, call", UNPLANNED_CALLS)
def test_a_call_the_plan_did_not_assume_is_routed_and_refused_by_us(arch, keys, call, warm):
    """Helper review of issue 10: a call with another layout, flag or dtype than the plan assumed
    used to reach a kernel backend that asserts; each is routed per call on the arch (B33), also
    after the planned call (whose memo must not let it through, `call_memo`)."""
    call = dict(call)
    dtype = call.pop("dtype", torch.bfloat16)
    layout = call.pop("layout", "sbhd")
    layer = facts(num_heads=8, num_kv_heads=1, head_dim=64, seq_length=128, dtype="bf16", packed=False)
    with fake_primus_turbo(arch=arch, build="main") as fake:
        plan = build_plan(settings(turbo_flex_attention_backend="turbo", turbo_arch=arch, use_sink_attention=True,
                                   **keys), layer)
        run = TurboFlexAttention(plan)
        if warm:
            run(*(_sbhd(h, arch=arch) for h in (8, 1, 1)), causal=True, sink=torch.zeros(8))
            fake.calls.clear()
        q, k, v = (_sbhd(h, dtype, arch) for h in (8, 1, 1))
        if layout == "bshd":
            q, k, v = (t.contiguous() for t in (q, k, v))
        with pytest.raises(UnsupportedInputError) as err:
            run(q, k, v, causal=True, sink=torch.zeros(8), **call)
        assert "B33" in err.value.codes
        run(*(_sbhd(h, arch=arch) for h in (8, 1, 1)), causal=True, sink=torch.zeros(8))  # the planned call runs
    assert len(fake.calls) == 1


def test_causal_flags_reach_the_kernel_normalised():
    """causal=False with window (-1, 0) is causal: the kernel gets causal=True, (-1, -1)."""
    with fake_primus_turbo() as fake:
        adapter(settings(turbo_flex_attention_backend="turbo"))(*qkv(), causal=False, window_size=(-1, 0))
    assert (fake.calls[-1].args["causal"], fake.calls[-1].args["window_size"]) == (True, (-1, -1))


@pytest.mark.parametrize("window", [(-5, 0), (1.5, 0), (1, 2, 3)])
def test_a_malformed_config_window_is_refused_at_build(window):
    from primus_ext.errors import UnsupportedConfigError

    with pytest.raises(UnsupportedConfigError, match="window_size"):
        build_plan(settings(), facts(window_size=window))


def test_boundaries_proven_once_are_checked_again_when_they_or_the_bound_change():
    """The value check runs once per boundary tensor (every layer of a step shares it), and again
    after an in-place change or for a tighter max_seqlen."""
    from primus_ext.call.checks import check_packed

    q = torch.randn(11, 4, 8)
    cu = _cu()
    check_packed(q, q, cu, cu, 7, 7)
    check_packed(q, q, cu, cu, 7, 7)  # proven: no second check needed, and none fails
    with pytest.raises(UnsupportedInputError, match="max_seqlen"):
        check_packed(q, q, cu, cu, 6, 6)  # a tighter bound is checked, not assumed
    cu[1] = 12  # in place (a new version): now 12 > 11, decreasing
    with pytest.raises(UnsupportedInputError, match="never decrease"):
        check_packed(q, q, cu, cu, 11, 11)
