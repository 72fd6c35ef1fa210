"""Shared-prefix rows (one prompt, many responses): the self and cross varlen calls merged through their
LSEs equal the tree mask's float64 oracle, forward and backward, on `reference` and on the fake's kernels at
both arches; what cannot be merged exactly is refused with our error."""

from __future__ import annotations

import math

import pytest
import torch

from primus_ext.backends.shared_prefix import SharedPrefixLayout, merge_partials
from primus_ext.call.adapter import TurboFlexAttention
from primus_ext.call.shared_prefix import shared_prefix_attention
from primus_ext.errors import UnsupportedInputError
from primus_ext.plan import build_plan
from primus_ext.testing import fake_primus_turbo

from .fuzz import oracle
from .helpers import facts, settings

ROWS = [
    [(8, [4, 3, 5])],                       # one prompt, three responses
    [5, (6, [2, 0, 4]), 3, (4, [3])],       # documents and trees mixed, an empty response
    [(0, [3, 2]), (5, []), 4],              # a tree without a prompt, a prompt without responses
    [(7, [1, 1, 1, 1])],                    # one-token responses
]


def tree_mask(items) -> torch.Tensor:
    """``[T, T]`` bool, written from the mask's definition token by token (not from the layout)."""
    owner = []  # per token: (group, part, position in part); part 0 is a prompt or a document
    for group, item in enumerate(items):
        parts = [item] if isinstance(item, int) else [item[0], *item[1]]
        for part, length in enumerate(parts):
            owner.extend((group, part, at) for at in range(length))
    allowed = torch.zeros(len(owner), len(owner), dtype=torch.bool)
    for i, (gi, pi, ai) in enumerate(owner):
        for j, (gj, pj, aj) in enumerate(owner):
            if gi != gj:
                continue
            allowed[i, j] = (pi == pj and aj <= ai) or (pj == 0 and pi > 0)
    return allowed


def _adapter(backend="reference", arch=None, sink=False, heads=(4, 2), d=16, dtype=None, dropout=0.0, **keys):
    extra = dict(turbo_arch=arch) if arch else {}
    layer = facts(num_heads=heads[0], num_kv_heads=heads[1], head_dim=d, seq_length=64, packed=True,
                  attention_dropout=dropout, **(dict(dtype=dtype) if dtype else {}))
    keys.setdefault("packed_shared_prefix", True)
    return TurboFlexAttention(build_plan(settings(turbo_flex_attention_backend=backend, use_sink_attention=sink,
                                                  **extra, **keys), layer))


def _inputs(total, hq, hkv, d, dtype, sink):
    gen = torch.Generator().manual_seed(total)
    q = torch.randn(total, hq, d, generator=gen)
    k, v = (torch.randn(total, hkv, d, generator=gen) for _ in range(2))
    leaves = [t.to(dtype).requires_grad_(True) for t in (q, k, v)]
    if sink:
        leaves.append(torch.randn(hq, generator=gen).requires_grad_(True))
    return leaves


def _check(run, items, dtype, sink=False, heads=(4, 2), d=16):
    layout = SharedPrefixLayout.of(items)
    leaves = _inputs(layout.total, heads[0], heads[1], d, dtype, sink)
    out = run(*leaves[:3], layout, sink=leaves[3] if sink else None)
    grad = grad_out_for(out)
    assert_oracle(items, leaves, out, grad, torch.autograd.grad(out, leaves, grad))


def grad_out_for(out: torch.Tensor) -> torch.Tensor:
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)


def assert_oracle(items, leaves, out, grad, got) -> None:
    """``out`` and the gradients ``got`` of ``leaves`` (q, k, v[, sink]) given ``grad`` equal the tree mask's float64
    oracle within the tolerances of ``out``'s dtype."""
    dtype, sink = out.dtype, len(leaves) == 4
    exact = [t.detach().double().requires_grad_(True) for t in leaves]
    want, _ = oracle.packed_attention(*exact[:3], tree_mask(items), sink=exact[3] if sink else None)
    assert oracle.mismatch(out, want, oracle.OUTPUT_TOL[dtype]) is None
    wants = torch.autograd.grad(want, exact, grad.double())
    for name, g, w in zip(("dq", "dk", "dv", "dsink"), got, wants):
        # the kernels take the sink in fp32 (B12), whatever q's dtype
        tol = oracle.GRAD_TOL[torch.promote_types(dtype, torch.float32) if name != "dsink" else torch.float32]
        assert oracle.mismatch(g, w, tol if dtype != torch.bfloat16 else oracle.GRAD_TOL[dtype]) is None, name


@pytest.mark.parametrize("items", ROWS)
@pytest.mark.parametrize("sink", [False, True])
def test_the_merged_calls_equal_the_tree_mask_on_reference(items, sink):
    adapter = _adapter(sink=sink)
    _check(lambda q, k, v, layout, sink: shared_prefix_attention(adapter, q, k, v, layout, sink=sink),
           items, torch.float64, sink=sink)


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
@pytest.mark.parametrize("items", ROWS[:2])
def test_the_merged_calls_equal_the_tree_mask_on_the_fakes_kernels(arch, items):
    with fake_primus_turbo(arch=arch) as fake:
        adapter = _adapter("turbo", arch, dtype="bf16")
        _check(lambda q, k, v, layout, sink: shared_prefix_attention(adapter, q, k, v, layout, sink=sink),
               items, torch.bfloat16)
    entries = [c.entry for c in fake.calls]
    assert entries and all("varlen" in e for e in entries), entries


def test_the_merge_keeps_a_row_without_keys_empty_and_weighs_by_the_lse():
    out_a, out_b = torch.ones(3, 1, 2), torch.full((3, 1, 2), 3.0)
    lse_a = torch.tensor([[0.0, -math.inf, -math.inf]])
    lse_b = torch.tensor([[0.0, 1.0, -math.inf]])
    out, lse = merge_partials(out_a, lse_a, out_b, lse_b)
    assert torch.equal(out[0], torch.full((1, 2), 2.0)) and torch.equal(out[1], out_b[1])
    assert torch.equal(out[2], torch.zeros(1, 2)) and torch.isneginf(lse[0, 2])
    assert torch.allclose(lse[0, :2], torch.tensor([math.log(2.0), 1.0]))
    assert not torch.isnan(out).any()


def test_the_layout_puts_every_response_after_its_prompt():
    layout = SharedPrefixLayout.of([3, (2, [1, 0, 2])])
    assert layout.total == 8 and layout.segments.tolist() == [0, 3, 5, 6, 8]
    assert layout.cross_q.tolist() == [5, 6, 7] and layout.cross_kv.tolist() == [3, 4]
    assert layout.cu_cross_q.tolist() == [0, 3] and layout.cu_cross_kv.tolist() == [0, 2]


@pytest.mark.parametrize("items", ["8,4", [(-1, [2])], [(4, 2)], [2.0], [(4, [2], 1)], None])
def test_a_malformed_row_is_refused_by_us(items):
    with pytest.raises(UnsupportedInputError) as err:
        SharedPrefixLayout.of(items)
    assert "shared-prefix.layout" in err.value.codes and "(prompt, [response, ...])" in str(err.value)


def test_a_layer_not_planned_for_shared_prefix_rows_refuses_one():
    layout = SharedPrefixLayout.of(ROWS[0])
    q, k, v = _inputs(layout.total, 4, 2, 16, torch.float64, False)
    with pytest.raises(UnsupportedInputError) as err:
        shared_prefix_attention(_adapter(packed_shared_prefix=False), q, k, v, layout)
    assert "shared-prefix.call" in err.value.codes and "packed_shared_prefix" in err.value.settings


def test_tokens_that_are_not_the_layouts_are_refused():
    layout = SharedPrefixLayout.of(ROWS[0])
    q, k, v = _inputs(layout.total + 1, 4, 2, 16, torch.float64, False)
    with pytest.raises(UnsupportedInputError) as err:
        shared_prefix_attention(_adapter(), q, k, v, layout)
    assert "shared-prefix.tokens" in err.value.codes


@pytest.mark.parametrize("items", ROWS)
@pytest.mark.parametrize("sink", [False, True])
def test_the_flex_backend_computes_the_tree_mask_in_one_call(items, sink):
    """torch's FlexAttention on the row's tree mask (forward: its CPU kernel has no backward; the device check
    runs the backward)."""
    adapter = _adapter("flex", sink=sink)
    layout = SharedPrefixLayout.of(items)
    leaves = _inputs(layout.total, 4, 2, 16, torch.float64, sink)
    with torch.no_grad():
        out = shared_prefix_attention(adapter, *leaves[:3], layout, sink=leaves[3] if sink else None)
    want, _ = oracle.packed_attention(*leaves[:3], tree_mask(items), sink=leaves[3] if sink else None)
    assert oracle.mismatch(out, want, oracle.OUTPUT_TOL[torch.float64]) is None
