"""Regressions of shared-prefix rows (B37) found by review (each test's docstring says what was wrong), and a
property test drawing whole rows: `reference` in float64 and the fake's kernels at gfx942 and gfx950 in bf16 equal
the float64 tree-mask oracle, forward and backward."""

from __future__ import annotations

import pytest
import torch

from primus_ext.backends.shared_prefix import SharedPrefixLayout
from primus_ext.call.shared_prefix import shared_prefix_attention
from primus_ext.call.adapter import TurboFlexAttention
from primus_ext.errors import UnsupportedConfigError, UnsupportedInputError
from primus_ext.megatron.shared_prefix import SharedPrefixSeqParams
from primus_ext.plan import build_plan
from primus_ext.testing import fake_primus_turbo
from tests.megatron.conftest import megatron_world  # noqa: F401 - the gloo world Megatron's modules need

from .fuzz import oracle
from .helpers import facts
from .helpers import settings as turbo_settings
from .test_call_refusals import megatron
from .test_shared_prefix import _adapter, _inputs, assert_oracle, grad_out_for, tree_mask

ITEMS = [(5, [3, 4]), 3, (4, [2])]
PATHS = [("direct", "gfx942", torch.bfloat16), ("direct", "gfx950", torch.bfloat16),
         ("flex-reference", None, torch.float64)]


def _layer_call(path, arch, dtype, make_params):
    """A Megatron core-attention layer planned for shared-prefix rows, called on ``ITEMS`` with the params
    ``make_params(layout)`` (marked as a prepared model marks them); returns the output ``[T, 4, 16]``."""
    keys = dict(packed_sequences=True, packed_shared_prefix=True, **({"turbo_arch": arch} if arch else {}))
    cfg = dict(bf16=True, params_dtype=dtype) if dtype == torch.bfloat16 else {}
    layer = megatron(path, keys=keys, **cfg)
    layout = SharedPrefixLayout.of(ITEMS)
    q, k, v = (t.to(dtype).unsqueeze(1) for t in _inputs(layout.total, 4, 2, 16, torch.float32, False))
    params = make_params(layout)
    params.positions_given = layer.core.shared_prefix_mark = 1  # as `prepare_shared_prefix` marks both
    return layer(q, k, v, None, packed_seq_params=params).reshape(layout.total, 4, 16), (q, k, v)


def _params(layout, bounds, longest):
    return SharedPrefixSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=longest,
                                 max_seqlen_kv=longest, layout=layout)


def _on(arch):
    return fake_primus_turbo(arch=arch) if arch else torch.autograd.set_grad_enabled(True)


@pytest.mark.parametrize("path,arch,dtype", PATHS)
def test_params_whose_boundaries_are_not_the_layouts_are_refused(path, arch, dtype):
    """FINDING: a `SharedPrefixSeqParams` built by hand with ``cu_seqlens`` other than its layout's segments ran:
    the direct path took the params' boundaries for the packed call (the whole row one causal document, merged
    with the cross call: responses saw each other and their prompt twice), the flex path the layout's, and
    megatron-core's RoPE reads the params'; no two readers agreed and nothing was refused."""
    one_document = lambda layout: _params(layout, torch.tensor([0, layout.total], dtype=torch.int32),  # noqa: E731
                                          layout.total)
    with _on(arch), pytest.raises(UnsupportedInputError) as err:
        _layer_call(path, arch, dtype, one_document)
    assert "shared-prefix.boundaries" in err.value.codes and "cu_seqlens_q" in err.value.settings


@pytest.mark.parametrize("path,arch,dtype", PATHS)
def test_params_with_the_layouts_boundaries_in_another_tensor_are_refused_not_read(path, arch, dtype):
    """The boundaries of a shared-prefix row are its layout's own tensor, which a prepared model's forward hands
    over: another tensor is refused whatever it holds, so no call reads (and syncs on) it to compare."""
    with _on(arch), pytest.raises(UnsupportedInputError) as err:
        _layer_call(path, arch, dtype, lambda layout: _params(layout, layout.segments.clone(), layout.max_segment))
    assert "shared-prefix.boundaries" in err.value.codes


@pytest.mark.parametrize("items", [[], [0, (0, [0, 0]), (0, [])]])
@pytest.mark.parametrize("arch", [None, "gfx942", "gfx950"])
def test_a_row_without_tokens_is_an_empty_result(items, arch):
    """FINDING: a row of no tokens (no groups, or only empty ones) was refused as a malformed ``cu_seqlens_q``
    (its segments were ``[0]``), an argument the caller never passed; an empty row is an empty result."""
    with _on(arch):
        adapter = _adapter("turbo", arch, dtype="bf16") if arch else _adapter()
        dtype = torch.bfloat16 if arch else torch.float64
        layout = SharedPrefixLayout.of(items)
        q, k, v = (t.to(dtype).detach().requires_grad_(True) for t in _inputs(0, 4, 2, 16, torch.float32, False))
        out = shared_prefix_attention(adapter, q, k, v, layout)
        assert out.shape == (0, 4, 16) and out.dtype == dtype
        dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True, materialize_grads=True)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_a_layout_changed_in_place_before_the_backward_is_refused():
    """FINDING: the eager merge kept the layout's boundary tensors for its backward without their versions: a
    layout changed in place between forward and backward (a reused, refilled buffer) gave gradients of another
    tree, silently."""
    layout = SharedPrefixLayout.of(ITEMS)
    q, k, v = _inputs(layout.total, 4, 2, 16, torch.float64, False)
    out = shared_prefix_attention(_adapter(), q, k, v, layout)
    layout.cu_cross_kv[1] = 3
    with pytest.raises(UnsupportedInputError) as err:
        torch.autograd.grad(out.sum(), (q, k, v))
    assert "shared-prefix.changed" in err.value.codes


def test_a_model_not_prepared_refuses_a_row_that_a_prepared_model_ran(monkeypatch):
    """FINDING: a prepared model marked the row's params as positioned and never took the mark back, so the same
    batch then given to an unprepared model (GRPO's reference model scores the policy's batch) ran with every
    response's RoPE counted from 0, unrefused."""
    from primus_ext.megatron import pack_shared_prefix, prepare_shared_prefix
    from tests.megatron.test_gpt_shared_prefix import _groups, _model

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # as that module's `rope_on_cpu`
    keys = dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="reference")
    policy, reference = prepare_shared_prefix(_model(keys, "rope", torch.float64)), _model(keys, "rope", torch.float64)
    batch = pack_shared_prefix(_groups())
    policy(batch.tokens, batch.position_ids, None, packed_seq_params=batch.packed_seq_params)
    with pytest.raises(UnsupportedInputError) as err:
        reference(batch.tokens, batch.position_ids, None, packed_seq_params=batch.packed_seq_params)
    assert "shared-prefix.positions" in err.value.codes



@pytest.mark.xfail(raises=RuntimeError, strict=True, reason=(
    "the compiled op saves the layout's tensors for its backward, so torch's autograd refuses a refilled layout with "
    "its own RuntimeError (never silently) before the op's backward could raise ours"))
def test_a_layout_changed_in_place_before_a_compiled_backward_is_refused_by_us():
    """FINDING: under torch.compile a layout refilled between forward and backward is refused by torch's in-place
    check (RuntimeError), not with shared-prefix.changed: held, but not with the project's error."""
    from tests.compile.test_compiled_layer import AotEager

    with fake_primus_turbo(arch="gfx942"):
        adapter = _adapter("turbo", "gfx942", dtype="bf16")
        run = torch.compile(lambda q, k, v, layout: shared_prefix_attention(adapter, q, k, v, layout),
                            backend=AotEager(), fullgraph=True)
        layout = SharedPrefixLayout.of(ITEMS)
        q, k, v = (t.bfloat16().detach().requires_grad_(True)
                   for t in _inputs(layout.total, 4, 2, 16, torch.float32, False))
        out = run(q, k, v, layout)
        layout.cu_cross_kv[1] = 3
        with pytest.raises(UnsupportedInputError) as err:
            out.float().sum().backward()
        assert "shared-prefix.changed" in err.value.codes


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_a_layer_flydsl_could_take_with_equal_segments_runs_on_aiters_pair(arch):
    """FINDING: GQA 8/1, head dim 128, bf16 on gfx950 built, but every call was refused: FlyDSL takes the packed
    call exactly when its segments are equal, which the pair choice cannot know without a host read.  The merge
    runs its pairs itself, eager and compiled alike, so it takes AITER's, which computes any segments."""
    with fake_primus_turbo(arch=arch):
        plan = build_plan(turbo_settings(packed_shared_prefix=True, turbo_flex_attention_backend="turbo", turbo_arch=arch),
                          facts(num_heads=8, num_kv_heads=1, head_dim=128, packed=True, dtype="bf16"))
        items = [(8, [4, 3]), 5, (4, [4, 4])]
        layout = SharedPrefixLayout.of(items)
        gen = torch.Generator().manual_seed(3)
        q = torch.randn(layout.total, 8, 128, generator=gen).bfloat16().requires_grad_(True)
        k, v = (torch.randn(layout.total, 1, 128, generator=gen).bfloat16().requires_grad_(True) for _ in range(2))
        out = shared_prefix_attention(TurboFlexAttention(plan), q, k, v, layout)
    want, _ = oracle.packed_attention(*(t.detach().double() for t in (q, k, v)), tree_mask(items))
    assert oracle.mismatch(out, want, oracle.OUTPUT_TOL[torch.bfloat16]) is None


def test_autotune_is_refused_at_build():
    with fake_primus_turbo(arch="gfx950"), pytest.raises(UnsupportedConfigError) as err:
        build_plan(turbo_settings(packed_shared_prefix=True, turbo_flex_attention_backend="turbo", turbo_arch="gfx950",
                            use_turbo_autotune=True), facts(packed=True, dtype="bf16", head_dim=64))
    assert "B37-autotune" in err.value.codes
