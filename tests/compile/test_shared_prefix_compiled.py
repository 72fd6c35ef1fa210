"""A compiled training step of a shared-prefix layer (B37) on turbo, over the fake at gfx942 and gfx950.

``torch.compile(fullgraph=True)`` of the row's attention and a loss: one graph (fullgraph passing, and one
frame compiled), the forward op running the packed call's and the cross call's kernel-level forwards and the
merge once, the backward op their two kernel-level backwards and no forward again: counted on the fake's call
log, not inferred.  Output and q/k/v gradients equal the eager call's exactly (the same kernels from the same
saved output and LSE) and the tree mask's float64 oracle.  A second layout, other prompt and response lengths
and counts, recompiles once with the row's sizes dynamic; a third runs on that graph.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import pytest
import torch

import primus_ext.backends.shared_prefix as shared_prefix_backend
from primus_ext.backends.shared_prefix import SharedPrefixLayout
from primus_ext.call.shared_prefix import shared_prefix_attention
from primus_ext.testing import fake_primus_turbo

from ..test_shared_prefix import _adapter, _inputs, assert_oracle, grad_out_for
from .test_compiled_layer import AotEager

HEADS, HEAD_DIM = (4, 2), 64
FORWARD, BACKWARD = "attention_aiter_varlen_forward_impl", "attention_aiter_varlen_backward_impl"
OP, OP_BW = "primus_ext.shared_prefix_attention.default", "primus_ext.shared_prefix_attention_backward.default"
LAYOUTS = [
    [5, (6, [2, 0, 4]), 3, (4, [3])],   # documents and trees, an empty response
    [(7, [1, 1, 1, 1]), 3],             # other lengths, segment and tree counts: the one recompile
    [(9, [2, 5]), 4, (3, [6]), 2],      # and again: the dynamic graph, no recompile
]
DOCUMENTS_ONLY = [[5, (0, [3, 2]), (4, [])], [7, 2, (6, [])]]  # no response sees a prompt: has_cross False


@pytest.fixture
def merges(monkeypatch):
    """How many times the LSE merge ran (`merged_forward` reads `merge_partials` from its module when called)."""
    count = Counter()
    merge = shared_prefix_backend.merge_partials

    def counted(*args):
        count["merge"] += 1
        return merge(*args)

    monkeypatch.setattr(shared_prefix_backend, "merge_partials", counted)
    return count


def step(adapter):
    """The compiled function: the row's attention and a loss whose gradient at ``out`` is ``grad``."""
    def run(q, k, v, layout, grad):
        out = shared_prefix_attention(adapter, q, k, v, layout, sink=None)
        return out, (out.float() * grad.float()).sum()
    return run


class Step(NamedTuple):
    out: torch.Tensor
    grads: list
    forwards: Counter
    """The fake's kernel calls during the forward, by entry."""
    backwards: Counter
    """... and during the backward."""
    merges: int
    leaves: list
    grad: torch.Tensor


def one_step(fn, fake, merges, items) -> Step:
    """One forward + backward of ``fn`` (`step`) on the row ``items``, its kernel calls and merges counted."""
    layout = SharedPrefixLayout.of(items)
    leaves = _inputs(layout.total, *HEADS, HEAD_DIM, torch.bfloat16, False)
    grad = grad_out_for(torch.empty(layout.total, HEADS[0], HEAD_DIM, dtype=torch.bfloat16))
    fake.reset()
    merges.clear()
    out, loss = fn(*leaves, layout, grad)
    forwards = Counter(c.entry for c in fake.calls)
    fake.reset()
    loss.backward()
    return Step(out.detach(), [t.grad for t in leaves], forwards, Counter(c.entry for c in fake.calls),
                merges["merge"], leaves, grad)


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_a_compiled_step_runs_each_kernel_once_and_recomputes_nothing(arch, merges):
    backend = AotEager()
    with fake_primus_turbo(arch=arch) as fake:
        adapter = _adapter("turbo", arch, heads=HEADS, d=HEAD_DIM, dtype="bf16")
        compiled = torch.compile(step(adapter), fullgraph=True, backend=backend)
        frames = []
        for i, items in enumerate(LAYOUTS):
            backend.dispatches.clear()
            got = one_step(compiled, fake, merges, items)
            frames.append(backend.frame_count)
            # the self and the cross call, each once forward and once backward, at the kernel level; no public
            # entry (what the ops' recompute would call) and no forward kernel during the backward
            assert got.forwards == {FORWARD: 2} and got.backwards == {BACKWARD: 2}, (i, got.forwards, got.backwards)
            assert got.merges == 1
            assert backend.dispatches == {OP: 1, OP_BW: 1}, backend.dispatches
            assert backend.ops_in("forward") == {OP: 1} and backend.ops_in("backward") == {OP_BW: 1}

            eager = one_step(step(adapter), fake, merges, items)
            assert (eager.forwards, eager.backwards, eager.merges) == (got.forwards, got.backwards, 1)
            torch.testing.assert_close(got.out, eager.out, rtol=0, atol=0)
            for name, g, e in zip("qkv", got.grads, eager.grads):
                torch.testing.assert_close(g, e, rtol=0, atol=0, msg=lambda m, n=name: f"d{n}, row {i}: {m}")
            assert_oracle(items, got.leaves, got.out, got.grad, got.grads)
    # one frame for the first row; the second row's other sizes recompile it once with them dynamic, and the
    # third row runs on that graph
    assert frames == [1, 2, 2], frames


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_a_row_of_documents_only_runs_one_kernel_pair_and_no_merge(arch, merges):
    backend = AotEager()
    with fake_primus_turbo(arch=arch) as fake:
        adapter = _adapter("turbo", arch, heads=HEADS, d=HEAD_DIM, dtype="bf16")
        compiled = torch.compile(step(adapter), fullgraph=True, backend=backend)
        for items in DOCUMENTS_ONLY:
            backend.dispatches.clear()
            got = one_step(compiled, fake, merges, items)
            assert got.forwards == {FORWARD: 1} and got.backwards == {BACKWARD: 1}, (got.forwards, got.backwards)
            assert got.merges == 0 and backend.dispatches == {OP: 1, OP_BW: 1}, backend.dispatches
            assert_oracle(items, got.leaves, got.out, got.grad, got.grads)
    assert backend.frame_count == 2, backend.frame_count  # the second row's other sizes: one recompile


def test_a_compiled_sink_trains_through_the_merge_on_reference():
    """Packed turbo calls take no sink at either arch (the plan refuses it, B33), so the sink's way through the
    compiled ops (saved, handed to the self call's backward, its gradient returned) is held on reference."""
    adapter = _adapter(sink=True)
    layout = SharedPrefixLayout.of(LAYOUTS[0])
    leaves = _inputs(layout.total, *HEADS, 16, torch.float64, True)
    grad = grad_out_for(torch.empty(layout.total, HEADS[0], 16, dtype=torch.float64))

    def run(q, k, v, sink, layout):
        out = shared_prefix_attention(adapter, q, k, v, layout, sink=sink)
        return out, (out * grad).sum()

    backend = AotEager()
    out, loss = torch.compile(run, fullgraph=True, backend=backend)(*leaves, layout)
    got = torch.autograd.grad(loss, leaves)
    assert backend.frame_count == 1 and backend.dispatches == {OP: 1, OP_BW: 1}, backend.dispatches
    eager_out, eager_loss = run(*leaves, layout)
    torch.testing.assert_close(out, eager_out, rtol=0, atol=0)
    for name, g, e in zip(("dq", "dk", "dv", "dsink"), got, torch.autograd.grad(eager_loss, leaves)):
        assert g.abs().sum() > 0, name
        torch.testing.assert_close(g, e, msg=lambda m, n=name: f"{n}: {m}")
    assert_oracle(LAYOUTS[0], leaves, out.detach(), grad, got)


@pytest.mark.parametrize("sink", [False, True])
def test_opcheck_the_shared_prefix_ops(sink):
    """The fake implementations agree with the ops' real outputs (shapes, dtypes, devices, with and without a
    sink), and the forward op's registered backward traces under AOT dispatch with dynamic shapes."""
    with fake_primus_turbo(arch="gfx942"):
        adapter = _adapter(sink=sink) if sink else _adapter("turbo", "gfx942", d=HEAD_DIM, dtype="bf16")
        dtype, d = (torch.float64, 16) if sink else (torch.bfloat16, HEAD_DIM)
        layout = SharedPrefixLayout.of(LAYOUTS[0])
        leaves = _inputs(layout.total, *HEADS, d, dtype, sink)
        tail = (layout.segments, layout.cross_q, layout.cross_kv, layout.cu_cross_q, layout.cu_cross_kv,
                adapter.handle, layout.max_segment, layout.max_cross_q, layout.max_cross_kv, True, -1, 0, None, False)
        sink_t = leaves[3] if sink else None
        forward = torch.library.opcheck(torch.ops.primus_ext.shared_prefix_attention.default,
                                        (*leaves[:3], sink_t, *tail))
        out, lse, rng_self, rng_cross = (t.detach() for t in torch.ops.primus_ext.shared_prefix_attention(
            *leaves[:3], sink_t, *tail))
        plain = [t.detach() for t in leaves] + [None]
        backward = torch.library.opcheck(torch.ops.primus_ext.shared_prefix_attention_backward.default,
                                         (grad_out_for(out), *plain[:4], out, lse, rng_self, rng_cross, *tail))
    assert set(forward.values()) == {"SUCCESS"} and set(backward.values()) == {"SUCCESS"}, (forward, backward)
