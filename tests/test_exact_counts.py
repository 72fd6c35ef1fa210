"""Exact copies and host syncs per attention call (counts, not timings).

Counted with `primus_ext.testing.counting`.  "Ours" is everything primus_ext runs
around the kernel; the kernel's own ops are counted apart: the Primus-Turbo entries
(the CPU fake, whose varlen checks read the boundaries on the host exactly like the
real flex layer does), or the reference backend as a whole, which is the kernel on
CPU.  The kernel's own output is the kernel's business too: a Megatron reshape of it
to ``[S, B, H*D]`` is a view when the output is dense in (H, D), as the kernels below
return it, and a copy of that output otherwise (see docs/performance.md).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import pytest
import torch

from primus_ext.testing import fake_primus_turbo
from primus_ext.testing.counting import (CopySyncCounter, as_kernel, count_copies_and_syncs,
                                         kernels_attributed)

from .helpers import adapter, facts, qkv, settings

WINDOW = (4, 0)
BOUNDS = [0, 5, 16, 32]


def turbo(**keys: Any):
    return settings(turbo_flex_attention_backend="turbo", **keys)


def counted(fn) -> CopySyncCounter:
    """Counts of one call of ``fn`` after a warm-up call (BlockMask cached, shapes verified)."""
    fn()
    with count_copies_and_syncs() as counts:
        fn()
    return counts


def reference_is_kernel(run: Any) -> Any:
    """On CPU the reference backend is the kernel: its ops are counted as the kernel's."""
    run.backend.dense = as_kernel(run.backend.dense)
    run.backend.packed = as_kernel(run.backend.packed)
    return run


def contiguous_output(entry: Any) -> Any:
    """The fake entry, returning its output dense in bshd / thd, as a GPU kernel allocates it."""

    @functools.wraps(entry)
    def kernel(*args: Any, **kwargs: Any) -> Any:
        out = entry(*args, **kwargs)
        return tuple(t.contiguous() for t in out) if isinstance(out, tuple) else out.contiguous()

    return kernel


@pytest.fixture
def fake_kernels():
    """The CPU fake of Primus-Turbo with its entries counted as kernels."""
    with fake_primus_turbo() as fake:
        with kernels_attributed(sys.modules["primus_turbo.pytorch.ops"], fake.module):
            yield fake


@pytest.fixture
def dense_kernels():
    """Like `fake_kernels`, with outputs laid out densely (the kernels' own copy, if any)."""
    with fake_primus_turbo() as fake:
        ops = sys.modules["primus_turbo.pytorch.ops"]
        for name in fake.signatures:
            setattr(ops, name, contiguous_output(getattr(ops, name)))
        with kernels_attributed(ops):
            yield fake


def packed_inputs(dtype=torch.float32):
    q, k, v = qkv(1, BOUNDS[-1], dtype=dtype)
    cu = torch.tensor(BOUNDS, dtype=torch.int32)
    longest = max(b - a for a, b in zip(BOUNDS, BOUNDS[1:]))
    return (q[0], k[0], v[0]), dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)


# -- the counter itself -------------------------------------------------------------------
def test_counter_sees_contiguous_copies_and_host_reads():
    x = torch.randn(4, 6).t()
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    with count_copies_and_syncs() as counts:
        x.contiguous()        # aten.clone
        x.float()             # already float32: no copy
        x.double()            # aten._to_copy
        x.reshape(-1)         # not viewable: aten.clone
        x.t().reshape(-1)     # viewable: nothing
        cu[-1].item()         # aten._local_scalar_dense
        cu.tolist()           # no dispatch on CPU; caught as a host read
        torch.equal(cu, cu)   # aten.equal
    assert counts.copies == 3 and counts.syncs == 3, counts.summary()
    assert counts.by_op("copy") == {"aten.clone.default": 2, "aten._to_copy.default": 1}
    assert counts.by_op("sync") == {"aten._local_scalar_dense.default": 1, "Tensor.tolist": 1,
                                    "aten.equal.default": 1}


def test_kernel_ops_are_counted_apart_and_wrappers_keep_signatures():
    import inspect

    def kernel(q, k, *, scale=None):
        return (q @ k.t()).t().contiguous(), q.tolist()

    wrapped = as_kernel(kernel)
    assert inspect.signature(wrapped) == inspect.signature(kernel)
    q = torch.randn(2, 2)
    with count_copies_and_syncs() as counts:
        out, _ = wrapped(q, q)
        out.t().contiguous()
    assert (counts.copies, counts.syncs, counts.kernel_copies, counts.kernel_syncs) == (1, 0, 1, 1)


def test_kernels_attributed_puts_the_originals_back():
    with fake_primus_turbo() as fake:
        ops = sys.modules["primus_turbo.pytorch.ops"]
        before = ops.flash_attn_func
        with kernels_attributed(ops, names=("flash_attn_func",)):
            assert ops.flash_attn_func is not before
            assert ops.flash_attn_func.__wrapped__ is before
        assert ops.flash_attn_func is before and fake.module.flash_attn_func is before


# -- flex adapter, dense bshd -------------------------------------------------------------
@pytest.mark.parametrize("window", [(-1, -1), WINDOW], ids=["causal", "window"])
def test_reference_dense_call_copies_and_syncs_nothing_of_its_own(window):
    q, k, v = qkv(dtype=torch.float32)
    run = reference_is_kernel(adapter(settings(sink_sliding_window=max(window[0], 0))))  # the plan's window
    counts = counted(lambda: run(q, k, v, causal=True, window_size=window))
    assert (counts.copies, counts.syncs) == (0, 0), counts.summary()
    assert counts.kernel_syncs == 0, "the reference math never reads device data on the host"


def test_reference_causal_sdpa_route_has_no_copies_at_all():
    """Plain causal on the reference backend is SDPA on the strided bhsd views: nothing is copied."""
    q, k, v = qkv(dtype=torch.float32)
    run = adapter(settings())
    counts = counted(lambda: run(q, k, v, causal=True))
    assert (counts.copies, counts.syncs) == (0, 0), counts.summary()


@pytest.mark.parametrize("window, entry", [((-1, -1), "flash_attn_func"), (WINDOW, "flash_attn_func")],
                         ids=["causal", "window"])
def test_turbo_dense_call_adds_no_copy_and_no_sync(fake_kernels, window, entry):
    q, k, v = qkv(dtype=torch.float32)
    run = adapter(turbo(sink_sliding_window=max(window[0], 0)))  # the plan's window
    counts = counted(lambda: run(q, k, v, causal=True, window_size=window))
    assert fake_kernels.calls[-1].entry == entry
    assert (counts.copies, counts.syncs) == (0, 0), counts.summary()
    assert counts.kernel_syncs == 0


def test_bf16_sink_costs_exactly_its_fp32_cast(fake_kernels):
    """B12: the one copy on the dense path is the sink's differentiable cast to fp32 (Hq values)."""
    q, k, v = qkv(dtype=torch.float32)
    sink = torch.zeros(4, dtype=torch.bfloat16)
    run = adapter(turbo(use_sink_attention=True))
    counts = counted(lambda: run(q, k, v, causal=True, sink=sink))
    assert counts.by_op("copy") == {"aten._to_copy.default": 1} and counts.syncs == 0, counts.summary()
    fp32 = torch.zeros(4)
    counts = counted(lambda: run(q, k, v, causal=True, sink=fp32))
    assert (counts.copies, counts.syncs) == (0, 0), counts.summary()


# -- flex adapter, packed thd -------------------------------------------------------------
def test_reference_packed_call_off_cpu_has_no_host_sync_anywhere():
    """Off the CPU the reference tells documents apart on the device (the band layout)."""
    (q, k, v), bounds = packed_inputs()
    run = reference_is_kernel(adapter(settings(), facts(packed=True)))
    run.backend.read_boundaries = False  # what a non-CPU device gets
    counts = counted(lambda: run.varlen(q, k, v, causal=True, **bounds))
    assert counts.syncs == 0 and counts.kernel_syncs == 0, counts.summary()
    assert counts.copies == 0, counts.summary()


def test_reference_packed_call_on_cpu_reads_only_host_memory():
    """On the CPU the boundaries are host memory: the reference reads them once per vector
    (no device to sync with) to visit each document's own tiles, and the caller nothing."""
    (q, k, v), bounds = packed_inputs()
    run = reference_is_kernel(adapter(settings(), facts(packed=True)))
    counts = counted(lambda: run.varlen(q, k, v, causal=True, **bounds))
    assert counts.syncs == 0 and counts.copies == 0, counts.summary()
    assert counts.by_op("sync", kernel=True) == {"Tensor.tolist": 2}, counts.summary()


def test_turbo_packed_call_syncs_only_inside_turbo(fake_kernels):
    """Turbo's varlen checks copy both boundary vectors to the host (its cost, one sync per
    vector here); primus_ext passes them through and reads nothing itself, not even to
    fill a missing max_seqlen."""
    (q, k, v), bounds = packed_inputs()
    run = adapter(turbo(), facts(packed=True))
    counts = counted(lambda: run.varlen(q, k, v, causal=True, **bounds))
    assert fake_kernels.calls[-1].entry == "flash_attn_varlen_func"
    assert (counts.copies, counts.syncs) == (0, 0), counts.summary()
    assert counts.by_op("sync", kernel=True) == {"Tensor.tolist": 2}
    bounds.update(max_seqlen_q=None, max_seqlen_k=None)
    counts = counted(lambda: run.varlen(q, k, v, causal=True, **bounds))
    assert (counts.copies, counts.syncs) == (0, 0), counts.summary()


# -- Megatron core attention --------------------------------------------------------------
S, B, HQ, HKV, D = 16, 2, 4, 2, 8


def core(flex: bool, backend: str = "turbo", contiguous: bool = False):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from primus_ext.megatron.core import TurboAttentionCore

    config = TransformerConfig(num_layers=1, hidden_size=HQ * D, num_attention_heads=HQ, num_query_groups=HKV,
                               use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0)
    keys = {"turbo_flex_attention_backend": backend} if flex else {"use_turbo_flex_attention": False}
    module = TurboAttentionCore(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                attention_dropout=None, softmax_scale=None, k_channels=None, v_channels=None,
                                cp_comm_type=None, pg_collection=None, settings=settings(**keys))
    module.storage = "contiguous-bshd" if contiguous else "as-given"  # what the plan decides on a gfx942
    if module.adapter is not None and backend == "reference":
        reference_is_kernel(module.adapter)
    return module


def sbhd():
    q, k, v = qkv(B, S, HQ, HKV, D, dtype=torch.float32)
    return tuple(t.transpose(0, 1).contiguous() for t in (q, k, v))


@pytest.mark.parametrize("flex", [True, False], ids=["flex", "direct"])
def test_megatron_sbhd_forward_copies_nothing_where_the_device_takes_strided_input(dense_kernels, flex):
    q, k, v = sbhd()
    module = core(flex)
    counts = counted(lambda: module.forward(q, k, v, None))
    assert (counts.copies, counts.syncs) == (0, 0), counts.summary()
    assert not dense_kernels.calls[-1].args["q"].is_contiguous(), "the kernel got the strided bshd view"


def test_megatron_sbhd_forward_on_the_reference_backend_copies_nothing():
    q, k, v = sbhd()
    module = core(True, backend="reference")
    counts = counted(lambda: module.forward(q, k, v, None))
    assert (counts.copies, counts.syncs, counts.kernel_syncs) == (0, 0, 0), counts.summary()


def test_megatron_reshape_copies_a_kernel_output_that_is_not_dense(fake_kernels):
    """The CPU fake returns a bhsd-strided output; reshaping it to [S, B, H*D] copies it, once."""
    q, k, v = sbhd()
    module = core(True)
    counts = counted(lambda: module.forward(q, k, v, None))
    assert counts.by_op("copy") == {"aten.clone.default": 1} and counts.syncs == 0, counts.summary()


@pytest.mark.parametrize("flex, backend", [(True, "turbo"), (False, "turbo"), (True, "reference")],
                         ids=["flex-turbo", "direct", "flex-reference"])
def test_gfx942_mode_copies_exactly_q_k_and_v(dense_kernels, flex, backend):
    q, k, v = sbhd()
    module = core(flex, backend=backend, contiguous=True)
    counts = counted(lambda: module.forward(q, k, v, None))
    assert counts.by_op("copy") == {"aten.clone.default": 3} and counts.syncs == 0, counts.summary()
    if backend == "turbo":
        assert dense_kernels.calls[-1].args["q"].is_contiguous()


@pytest.mark.parametrize("flex", [True, False], ids=["flex", "direct"])
def test_megatron_thd_forward_syncs_nothing_of_its_own(dense_kernels, flex):
    from megatron.core.packed_seq_params import PackedSeqParams

    (q, k, v), bounds = packed_inputs()
    cu = bounds["cu_seqlens_q"]
    module = core(flex)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)  # no max_seqlen: no read
    counts = counted(lambda: module.forward(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), None,
                                            packed_seq_params=params))
    assert (counts.copies, counts.syncs) == (0, 0), counts.summary()
    assert counts.kernel_syncs == 2, "Turbo's own boundary checks"


def test_distinct_padded_boundaries_cost_one_host_comparison(dense_kernels):
    """B19: padded boundaries given as a separate tensor are compared on the host, once per call."""
    from megatron.core.packed_seq_params import PackedSeqParams

    (q, k, v), bounds = packed_inputs()
    cu = bounds["cu_seqlens_q"]
    module = core(True)
    same = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                           cu_seqlens_kv_padded=cu)
    copy = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu.clone(),
                           cu_seqlens_kv_padded=cu)
    args = (q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), None)
    assert counted(lambda: module.forward(*args, packed_seq_params=same)).syncs == 0
    counts = counted(lambda: module.forward(*args, packed_seq_params=copy))
    assert counts.by_op("sync") == {"aten.equal.default": 1}, counts.summary()


def test_dropped_adapters_and_their_op_targets_are_released():
    """100 adapters built and dropped leave nothing behind in the op-target registry."""
    import gc
    import weakref

    from primus_ext.call import ops

    gc.collect()
    before = len(ops._TARGETS)
    refs = []
    for _ in range(100):
        run = adapter(settings())
        refs.append(weakref.ref(run))
        del run
    gc.collect()
    assert sum(r() is not None for r in refs) == 0
    assert len(ops._TARGETS) == before


def test_no_route_builds_a_block_mask_and_a_shape_sweep_keeps_no_tensor():
    """24 drop-in adapters (reference and turbo, dense and packed, causal, window, sink, hook)
    over 100 shapes: no BlockMask is ever built (no route reads one), and once the inputs
    are dropped nothing of them stays alive in a cache; the per-call memos stay bounded."""
    import gc
    import weakref

    from torch.nn.attention import flex_attention as flex

    from primus_ext.call.prepared import LIMIT as PREPARED_LIMIT

    built = []
    original = flex.BlockMask.__init__

    def counting(self, *args, **kwargs):
        built.append(1)
        original(self, *args, **kwargs)

    keys = [dict(), dict(use_sink_attention=True, sink_sliding_window=3),
            dict(turbo_flex_attention_mask_mod="tests.proof_hooks:gym_window")]
    refs = []
    with fake_primus_turbo(arch="gfx942") as fake:
        runs = []
        for backend in ("reference", "turbo"):
            for extra in keys:
                for packed in (False, True):
                    if packed and ("use_sink_attention" in extra or "turbo_flex_attention_mask_mod" in extra):
                        continue
                    s = settings(turbo_flex_attention_backend=backend, turbo_arch="gfx942", **extra)
                    runs += [adapter(s, facts(dtype="bf16", packed=packed)) for _ in range(3)]
        flex.BlockMask.__init__ = counting
        try:
            for shape in range(100):
                seq = 8 + shape
                run = runs[shape % len(runs)]
                sink = torch.zeros(4) if run.plan.sink else None
                if run.plan.packed:
                    q, k, v = (t[0] for t in qkv(1, seq, dtype=torch.bfloat16))
                    cu = torch.tensor([0, seq // 2, seq], dtype=torch.int32)
                    run.varlen(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=seq - seq // 2,
                        max_seqlen_k=seq - seq // 2)
                    refs += [weakref.ref(t) for t in (q, k, v, cu)]
                    del cu
                else:
                    q, k, v = qkv(s=seq, dtype=torch.bfloat16)
                    hook = run.plan.mask_mod is not None
                    run(q, k, v, causal=not hook, sink=sink)
                    refs += [weakref.ref(t) for t in (q, k, v)]
                del q, k, v
        finally:
            flex.BlockMask.__init__ = original
        fake.reset()  # the fake's call log holds the very tensors passed (by design)
        gc.collect()
        assert not built, f"{len(built)} BlockMasks built"
        assert sum(r() is not None for r in refs) == 0, "a cache keeps inputs alive"
        assert len(runs) == 24
        for run in runs:
            assert len(run.calls) <= PREPARED_LIMIT
