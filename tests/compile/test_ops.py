"""The attention custom ops on their own (`primus_ext.call.ops`).

* ``torch.library.opcheck`` (schema, fake tensor, autograd registration, AOT dispatch
  with static and dynamic shapes) passes for ``dense_attention``, ``varlen_attention``
  and both backward ops, on handles of real flex adapters: the reference backend and
  the turbo backend over the CPU fake of Primus-Turbo;
* the fake implementations answer from input shapes alone (under ``FakeTensorMode``,
  with a handle that names no target and boundaries that hold no data);
* gradients through the ops (the registered backward op) equal the target's own
  autograd, sink included, and finite differences;
* with dropout, the backward op replays the forward's dropout mask.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from primus_ext.backends.base import CallArgs
from primus_ext.call import ops
from primus_ext.testing import fake_primus_turbo

from ..helpers import adapter, facts, packed_qkv, qkv, settings

OPS = torch.ops.primus_ext
HEADS = 4
BOUNDS = (0, 5, 11, 16)  # three documents, 16 tokens
LONGEST = 6
NO_RNG = torch.empty(0, dtype=torch.uint8)
_ALIVE: list = []
UNREGISTERED = -1  # a handle no target owns: any call of the real implementation would fail


@dataclass(frozen=True)
class Case:
    name: str
    dtype: torch.dtype
    sink: bool
    kv_heads: int  # 4 = MHA, 2 = GQA, 1 = MQA
    causal: bool
    window: tuple[int, int]
    scale: Optional[float] = None
    lse: bool = False

    def __str__(self) -> str:
        return self.name


CASES = [
    Case("causal-gqa-fp32", torch.float32, sink=False, kv_heads=2, causal=True, window=(-1, -1)),
    Case("causal-sink-gqa-fp64", torch.float64, sink=True, kv_heads=2, causal=True, window=(-1, -1), lse=True),
    Case("window-sink-mqa-fp32", torch.float32, sink=True, kv_heads=1, causal=True, window=(3, 0), scale=0.3),
    Case("window-mha-fp64", torch.float64, sink=False, kv_heads=4, causal=True, window=(3, 0), lse=True),
    Case("two-sided-window-sink-gqa-fp64", torch.float64, sink=True, kv_heads=2, causal=False, window=(2, 2)),
    Case("full-gqa-fp32", torch.float32, sink=False, kv_heads=2, causal=False, window=(-1, -1), lse=True),
]
BACKENDS = ["reference", "turbo"]


@contextlib.contextmanager
def on_backend(name: str) -> Iterator[Optional[object]]:
    """The reference backend as is; the turbo backend inside the CPU fake of Primus-Turbo."""
    if name == "turbo":
        with fake_primus_turbo() as fake:
            yield fake
    else:
        yield None


def handle_for(backend: str, case: Case, packed: bool) -> int:
    """A registered target: a flex adapter whose plan matches the case."""
    window = case.window[0] if case.causal and case.window[0] > 0 else 0
    keys = dict(turbo_flex_attention_backend=backend, use_sink_attention=case.sink, sink_sliding_window=window)
    run = adapter(settings(**keys), facts(num_kv_heads=case.kv_heads, packed=packed))
    _ALIVE.append(run)  # a handle lives as long as its adapter (the registry lets go of dropped ones)
    return run.handle


def sink_for(case: Case, grad: bool = False, dtype=torch.float32) -> Optional[torch.Tensor]:
    if not case.sink:
        return None
    return torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=dtype).requires_grad_(grad)


def inputs(case: Case, packed: bool, grad: bool):
    if packed:
        return packed_qkv(BOUNDS[-1], hq=HEADS, hkv=case.kv_heads, dtype=case.dtype, grad=grad)
    return qkv(hq=HEADS, hkv=case.kv_heads, dtype=case.dtype, grad=grad)


def cu() -> torch.Tensor:
    return torch.tensor(BOUNDS, dtype=torch.int32)


def forward_args(case: Case, handle: int, packed: bool, q, k, v, sink, dropout_p: float = 0.0,
                 lse: Optional[bool] = None) -> tuple:
    lse = case.lse if lse is None else lse
    tail = (case.causal, *case.window, case.scale, dropout_p, False, lse)
    if packed:
        return (q, k, v, cu(), cu(), sink, None, handle, LONGEST, LONGEST) + tail
    return (q, k, v, sink, None, None, handle) + tail


def backward_args(case: Case, handle: int, packed: bool, grad_out, q, k, v, sink) -> tuple:
    """The backward op's arguments, with the ``out``, ``lse`` and ``rng_state`` of a real forward op
    call (a kernel pair's backward gets the forward's own rng_state, as in a graph)."""
    out, lse, rng = forward_op(packed)(*forward_args(case, handle, packed, q, k, v, sink, lse=False))
    tail = (case.causal, *case.window, case.scale, 0.0, False, False)
    if packed:
        return (grad_out, q, k, v, out, lse, cu(), cu(), sink, None, rng, handle, LONGEST, LONGEST) + tail
    return (grad_out, q, k, v, out, lse, sink, None, None, rng, handle) + tail


def forward_op(packed: bool):
    return OPS.varlen_attention.default if packed else OPS.dense_attention.default


def target_call(handle: int, case: Case, packed: bool, q, k, v, sink, dropout_p: float = 0.0):
    """The same call straight on the target, with its own autograd (what eager runs)."""
    bounds = (cu(), cu(), LONGEST, LONGEST) if packed else (None, None, q.shape[1], k.shape[1])
    return ops.target(handle).run(CallArgs(q, k, v, *bounds, sink, None, None, case.causal, case.window, case.scale,
                                           dropout_p, False, False))


def assert_turbo_ran(fake, packed: bool) -> None:
    if fake is None:
        return
    entries = {c.entry for c in fake.calls}
    assert entries, "no Primus-Turbo entry ran under the op"
    if packed:
        assert entries == {"flash_attn_varlen_func"}


# -- opcheck ------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_opcheck_forward_ops(layout, backend, case):
    packed = layout == "thd"
    with on_backend(backend) as fake:
        handle = handle_for(backend, case, packed)
        q, k, v = inputs(case, packed, grad=True)
        args = forward_args(case, handle, packed, q, k, v, sink_for(case, grad=True))
        result = torch.library.opcheck(forward_op(packed), args)
    assert set(result.values()) == {"SUCCESS"}, result
    assert_turbo_ran(fake, packed)


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_opcheck_backward_ops(layout, backend, case):
    """Backward ops get no autograd of their own: they are called on plain tensors."""
    packed = layout == "thd"
    op = OPS.varlen_attention_backward.default if packed else OPS.dense_attention_backward.default
    with on_backend(backend) as fake:
        handle = handle_for(backend, case, packed)
        q, k, v = inputs(case, packed, grad=False)
        grad_out = torch.randn(*q.shape[:-1], v.shape[-1], dtype=case.dtype,
                               generator=torch.Generator().manual_seed(5))
        result = torch.library.opcheck(op, backward_args(case, handle, packed, grad_out, q, k, v, sink_for(case)))
    assert set(result.values()) == {"SUCCESS"}, result
    assert_turbo_ran(fake, packed)


# -- fake implementations -----------------------------------------------------------
def test_fake_implementations_answer_from_input_shapes_only():
    """No target is consulted (the handle names none) and no tensor data is read
    (fake boundaries have none); shapes follow q and v, whatever the boundaries say."""
    rng_numel = torch.get_rng_state().numel()
    with FakeTensorMode():
        q = torch.empty(3, 10, 4, 8, dtype=torch.bfloat16)
        k = torch.empty(3, 12, 2, 8, dtype=torch.bfloat16)
        v = torch.empty(3, 12, 2, 16, dtype=torch.bfloat16)
        sink = torch.empty(4)
        out, lse, rng = OPS.dense_attention(q, k, v, sink, None, None, UNREGISTERED, True, 3, 0, None, 0.1,
                                            False, True)
        assert (out.shape, out.dtype) == ((3, 10, 4, 16), torch.bfloat16)
        assert (lse.shape, lse.dtype) == ((3, 4, 10), torch.float32)
        assert (rng.shape, rng.dtype) == ((rng_numel,), torch.uint8)
        out, lse, rng = OPS.dense_attention(q, k, v, None, None, None, UNREGISTERED, True, -1, -1, None, 0.0,
                                            False, False)
        # lse is always there: a kernel pair's backward needs it even when the caller does not; without
        # dropout rng_state is AITER's int64 [2], on the device (CK) without a sink ...
        assert out.shape == (3, 10, 4, 16) and lse.shape == (3, 4, 10)
        assert (rng.shape, rng.dtype, rng.device) == ((2,), torch.int64, q.device)
        # ... and on the CPU with one (the Triton sink kernels' [philox_seed, philox_offset])
        rng_sink = OPS.dense_attention(q, k, v, sink, None, None, UNREGISTERED, True, -1, -1, None, 0.0, False,
                                       False)[2]
        assert (rng_sink.shape, rng_sink.dtype, rng_sink.device.type) == ((2,), torch.int64, "cpu")
        grads = OPS.dense_attention_backward(out, q, k, v, out, lse, sink, None, None, rng, UNREGISTERED, True, 3,
                                             0, None, 0.0, False, False)
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape, sink.shape, (0,), (0,)]

        tq, tk, tv = torch.empty(40, 4, 8), torch.empty(40, 2, 8), torch.empty(40, 2, 16)
        shapes = set()
        for documents, longest in ((1, 40), (5, 13), (9, 7)):
            bounds = torch.empty(documents + 1, dtype=torch.int32)
            out, lse, rng = OPS.varlen_attention(tq, tk, tv, bounds, bounds, None, None, UNREGISTERED, longest,
                                                 longest, True, -1, -1, None, 0.0, False, True)
            grads = OPS.varlen_attention_backward(out, tq, tk, tv, out, lse, bounds, bounds, None, None, rng,
                                                  UNREGISTERED, longest, longest, True, -1, -1, None, 0.0, False,
                                                  False)
            shapes.add((out.shape, lse.shape, tuple(g.shape for g in grads)))
        assert shapes == {((40, 4, 16), (4, 40), ((40, 4, 8), (40, 2, 8), (40, 2, 16), (0,), (0,)))}


# -- gradients ----------------------------------------------------------------------
def op_and_eager_grads(handle: int, case: Case, packed: bool, fake) -> tuple:
    """``(out, grads, eager out, eager grads, kernel entries the op step ran)``: one step
    through the ops, then the same call straight on the target with its own autograd."""
    q, k, v = inputs(case, packed, grad=True)
    sink = sink_for(case, grad=True)
    leaves = [t for t in (q, k, v, sink) if t is not None]
    out = forward_op(packed)(*forward_args(case, handle, packed, q, k, v, sink, lse=False))[0]
    grad_out = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(9))
    got = torch.autograd.grad(out, leaves, grad_out)
    kernel = [c.entry for c in fake.calls] if fake is not None else []
    expected_out = target_call(handle, case, packed, q, k, v, sink)
    return out, got, expected_out, torch.autograd.grad(expected_out, leaves, grad_out), kernel


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_op_gradients_equal_the_targets_autograd(layout, backend, case):
    """The registered backward (the backward op) gives the gradients eager autograd gives."""
    packed = layout == "thd"
    with on_backend(backend) as fake:
        out, got, expected_out, expected, _ = op_and_eager_grads(handle_for(backend, case, packed), case, packed,
                                                                 fake)
    torch.testing.assert_close(out, expected_out)
    for name, g, e in zip(("dq", "dk", "dv", "dsink"), got, expected):
        assert g.abs().sum() > 0, f"{name} is zero: the comparison would prove nothing"
        torch.testing.assert_close(g, e, msg=lambda m, name=name: f"{name}: {m}")
    assert_turbo_ran(fake, packed)


@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_op_gradients_equal_finite_differences(layout):
    """An independent check of the backward op: float64 gradcheck through the forward op
    (fast mode: random projections of the Jacobian, a few dozen op calls instead of ~1000)."""
    packed = layout == "thd"
    case = Case("window-sink", torch.float64, sink=True, kv_heads=2, causal=True, window=(3, 0), scale=0.4)
    handle = handle_for("reference", case, packed)
    if packed:
        q, k, v = packed_qkv(BOUNDS[-1], hq=HEADS, hkv=2, d=4, grad=True)
    else:
        q, k, v = qkv(b=1, s=7, hq=HEADS, hkv=2, d=4, grad=True)
    sink = sink_for(case, grad=True, dtype=torch.float64)

    def attention(q, k, v, sink):
        return forward_op(packed)(*forward_args(case, handle, packed, q, k, v, sink, lse=False))[0]

    assert torch.autograd.gradcheck(attention, (q, k, v, sink), eps=1e-6, atol=1e-7, rtol=1e-6,
                                     fast_mode=True)


# -- dropout ------------------------------------------------------------------------
@pytest.mark.parametrize("backend,sink", [("reference", False), ("reference", True), ("turbo", True)],
                         ids=["reference-sdpa", "reference-exact", "turbo"])
@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_backward_op_replays_the_forward_dropout_mask(layout, backend, sink):
    """Seeded identically, the op and a plain autograd run of the target draw the same
    mask in forward; the op's gradients equal that run's, although the generator moved
    on between forward and backward, so the backward op's recompute must have restored
    the state captured by the forward op.  The training RNG stream is left untouched by
    the backward op.  A second seed changes the output, so the mask is really random."""
    packed = layout == "thd"
    p = 0.4
    case = Case("dropout", torch.float64, sink=sink, kv_heads=2, causal=True, window=(-1, -1))
    with on_backend(backend) as fake:
        handle = handle_for(backend, case, packed)
        q, k, v = inputs(case, packed, grad=True)
        s = sink_for(case, grad=True)
        leaves = [t for t in (q, k, v, s) if t is not None]

        torch.manual_seed(1234)
        out, _, rng_state = forward_op(packed)(*forward_args(case, handle, packed, q, k, v, s, dropout_p=p))
        assert rng_state.numel() == torch.get_rng_state().numel()
        torch.rand(1000)  # other random work between forward and backward
        before_backward = torch.get_rng_state()
        grad_out = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(3))
        got = torch.autograd.grad(out, leaves, grad_out)
        assert torch.equal(torch.get_rng_state(), before_backward), "the backward op consumed the global RNG"

        torch.manual_seed(1234)
        manual = target_call(handle, case, packed, q, k, v, s, dropout_p=p)
        expected = torch.autograd.grad(manual, leaves, grad_out)

        torch.manual_seed(4321)
        other_seed = target_call(handle, case, packed, q, k, v, s, dropout_p=p).detach()
        no_dropout = target_call(handle, case, packed, q, k, v, s).detach()
    torch.testing.assert_close(out, manual, rtol=0, atol=1e-12)
    for name, g, e in zip(("dq", "dk", "dv", "dsink"), got, expected):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")
    assert (out - no_dropout).abs().max() > 1e-3, "dropout had no effect"
    assert (out - other_seed).abs().max() > 1e-3, "the dropout mask does not depend on the generator"
    assert_turbo_ran(fake, packed)


# -- AITER's kernel-level pair (gfx942) -------------------------------------------------
AITER_CASES = [
    Case("aiter-window-sink-gqa-bf16", torch.bfloat16, sink=True, kv_heads=2, causal=True, window=(3, 0)),
    Case("aiter-causal-mha-bf16", torch.bfloat16, sink=False, kv_heads=4, causal=True, window=(-1, -1), lse=True),
    Case("aiter-full-mqa-bf16", torch.bfloat16, sink=False, kv_heads=1, causal=False, window=(-1, -1)),
]
AITER_OPS = {"attention_aiter_forward_impl", "attention_aiter_backward_impl",
             "attention_aiter_varlen_forward_impl", "attention_aiter_varlen_backward_impl"}
AITER_LAYOUTS = [(layout, case) for case in AITER_CASES for layout in ("bshd", "thd")
                 if not (layout == "thd" and case.sink)]  # no varlen sink on gfx942 (refused, B33)


def aiter_handle(case: Case, packed: bool) -> int:
    window = case.window[0] if case.causal and case.window[0] > 0 else 0
    keys = dict(turbo_flex_attention_backend="turbo", use_sink_attention=case.sink, sink_sliding_window=window,
                turbo_arch="gfx942")
    run = adapter(settings(**keys), facts(num_kv_heads=case.kv_heads, packed=packed, dtype="bf16"))
    _ALIVE.append(run)
    return run.handle


@pytest.mark.parametrize("layout,case", AITER_LAYOUTS, ids=lambda x: str(x))
def test_opcheck_on_aiters_kernel_pair(layout, case):
    """Both ops pass opcheck where they call AITER's kernel-level ops; the backward op owns
    the dsink buffer the kernel writes without declaring it, so no input is mutated."""
    packed = layout == "thd"
    with fake_primus_turbo(arch="gfx942") as fake:
        handle = aiter_handle(case, packed)
        q, k, v = inputs(case, packed, grad=True)
        sink = sink_for(case, grad=True)
        results = [torch.library.opcheck(forward_op(packed), forward_args(case, handle, packed, q, k, v, sink))]
        q, k, v = (t.detach() for t in (q, k, v))
        grad_out = torch.randn(*q.shape[:-1], v.shape[-1], dtype=case.dtype,
                               generator=torch.Generator().manual_seed(5))
        op = OPS.varlen_attention_backward.default if packed else OPS.dense_attention_backward.default
        plain_sink = None if sink is None else sink.detach()
        results.append(torch.library.opcheck(op, backward_args(case, handle, packed, grad_out, q, k, v, plain_sink)))
    for result in results:
        assert set(result.values()) == {"SUCCESS"}, result
    assert {c.entry for c in fake.calls} <= AITER_OPS and fake.calls, {c.entry for c in fake.calls}


@pytest.mark.parametrize("layout,case", AITER_LAYOUTS, ids=lambda x: str(x))
def test_aiter_pair_gradients_equal_the_public_entrys_autograd(layout, case):
    """Through the ops, the forward runs AITER's kernel-level forward once and the backward its
    kernel-level backward once (no forward again); gradients equal ``flash_attn_func``'s own."""
    packed = layout == "thd"
    with fake_primus_turbo(arch="gfx942") as fake:
        out, got, expected_out, expected, kernel = op_and_eager_grads(aiter_handle(case, packed), case, packed, fake)
    prefix = "attention_aiter_varlen_" if packed else "attention_aiter_"
    assert kernel == [prefix + "forward_impl", prefix + "backward_impl"], kernel
    torch.testing.assert_close(out, expected_out, rtol=2e-2, atol=2e-2)
    for name, g, e in zip(("dq", "dk", "dv", "dsink"), got, expected):
        assert g.abs().sum() > 0, f"{name} is zero: the comparison would prove nothing"
        torch.testing.assert_close(g.float(), e.float(), rtol=2e-2, atol=2e-2,
                                   msg=lambda m, name=name: f"{name}: {m}")
