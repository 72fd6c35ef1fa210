"""The ``flex`` backend: torch's real flex_attention forward on CPU against the float64 oracle, the
BlockMask cache, and the glue's gradients through a stand-in with flex_attention's call contract.

The oracle (`tests.fuzz.oracle`) shares no code with `primus_ext.backends.flex`; the stand-in
(`tests.flex_standin`) is a third implementation, held to torch's own forward here.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

from primus_ext.attention.pattern import Pattern
from primus_ext.backends.base import KernelCall
from primus_ext.backends.flex import FlexBackend
from primus_ext.backends.flex_cache import BlockMaskCache
from primus_ext.backends.reference import ReferenceBackend
from primus_ext.call import TurboFlexAttention
from primus_ext.errors import UnsupportedInputError
from primus_ext.plan import build_plan

from . import flex_hooks
from .flex_standin import flex_standin
from .fuzz import oracle
from .helpers import facts, packed_qkv, qkv, settings

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
F64 = torch.float64
TOL = oracle.Tolerance(1e-9, 1e-9)
S = 48
HOOKS = "tests.flex_hooks:"


def flex_plan(**keys):
    return build_plan(settings(turbo_flex_attention_backend="flex", **keys), facts(seq_length=S))


def same(got, want, tol=TOL):
    problem = oracle.mismatch(got, want, tol)
    assert problem is None, problem


@pytest.fixture
def cache():
    return BlockMaskCache()


# ------------------------------------------------------------------ forward: real flex_attention vs the oracle
@pytest.mark.parametrize("key, hook", [
    ("turbo_flex_attention_mask_mod", "prefix_lm"),
    ("turbo_flex_attention_mask_mod", "dilated_window"),
    ("turbo_flex_attention_mask_mod", "document_ids"),
    ("turbo_flex_attention_score_mod", "softcap"),
])
def test_admitted_hooks_through_real_flex_attention_equal_the_oracle(key, hook):
    plan = flex_plan(use_sink_attention=True, **{key: HOOKS + hook})
    assert plan.backend == "flex"
    q, k, v = qkv(s=S)  # GQA: 4 query heads, 2 key/value heads
    sink = torch.randn(4).to(F64)  # fp32 values, as the layer's sink
    fn = getattr(flex_hooks, hook)
    with torch.no_grad():
        out = TurboFlexAttention(plan)(q, k, v, sink=sink)
    allowed = oracle.hook_mask(fn, 2, 4, S, S) if key.endswith("mask_mod") else (
        oracle.flash_mask(S, S, causal=True, window=(-1, -1)))
    want, _ = oracle.attention(q, k, v, allowed, sink=sink, score_fn=fn if key.endswith("score_mod") else None)
    same(out, want)


def test_library_prefix_lm_with_sinks_and_lse():
    plan = flex_plan(turbo_flex_attention_mask_mod="primus_ext.attention.masks:prefix_lm",
                     turbo_flex_attention_mask_mod_kwargs={"prefix_length": 5}, use_sink_attention=True)
    q, k, v = qkv(s=S)
    sink = torch.randn(4).to(F64)
    with torch.no_grad():
        out, lse = TurboFlexAttention(plan)(q, k, v, sink=sink, return_lse=True)
    allowed = oracle.flash_mask(S, S, causal=True, window=(-1, -1)) | (torch.arange(S) < 5).view(1, -1)
    want, want_lse = oracle.attention(q, k, v, allowed, sink=sink)
    same(out, want)
    same(lse, want_lse)


def test_captured_document_ids_rebuild_exactly_when_updated_in_place(cache):
    backend = FlexBackend(block_masks=cache)
    plan = flex_plan(turbo_flex_attention_mask_mod=HOOKS + "document_ids")
    run = TurboFlexAttention(plan, backend)
    q, k, v = qkv(s=S)
    saved = flex_hooks.DOC_IDS.clone()
    try:
        with torch.no_grad():
            for step in range(3):
                if step == 2:
                    flex_hooks.DOC_IDS[:20] = torch.arange(20) // 4  # new documents, same tensor
                out = run(q, k, v)
                want, _ = oracle.attention(q, k, v, oracle.hook_mask(flex_hooks.document_ids, 2, 4, S, S))
                same(out, want)
                assert (cache.builds, cache.hits) == ((1, 0), (1, 1), (2, 1))[step]
    finally:
        flex_hooks.DOC_IDS.copy_(saved)


def test_what_a_hook_captures_counts_in_the_cache_bytes(cache):
    """The cached BlockMask keeps its mask_mod alive, and with it the hook's captured tensors: counted."""
    q, k, v = qkv(s=S)
    with torch.no_grad():
        TurboFlexAttention(flex_plan(turbo_flex_attention_mask_mod=HOOKS + "prefix_lm"), FlexBackend(block_masks=cache))(
            q, k, v)
        plain = cache.nbytes
        cache.clear()
        TurboFlexAttention(flex_plan(turbo_flex_attention_mask_mod=HOOKS + "document_ids"),
                           FlexBackend(block_masks=cache))(q, k, v)
    ids = flex_hooks.DOC_IDS
    # both BlockMasks have the same shape; the ids count twice: the tensor and the entry's value snapshot of it
    assert cache.nbytes - plain == 2 * ids.numel() * ids.element_size()


def _head_helper(h, q):
    return (h % 2 == 0) | (q > 3)


def _reads_head_through_a_helper(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & _head_helper(h, q_idx)


def _reads_batch_in_a_closure(b, h, q_idx, kv_idx):
    def inner():
        return b == 0
    return (kv_idx <= q_idx) | inner()


def test_reads_argument_is_sound_on_what_a_hook_passes_on_or_closes_over():
    from primus_ext.backends.flex_masks import reads_argument

    assert [reads_argument(flex_hooks.prefix_lm, i) for i in (0, 1, 2, 3)] == [False, False, True, True]
    assert reads_argument(_reads_head_through_a_helper, 1) and not reads_argument(_reads_head_through_a_helper, 0)
    assert reads_argument(_reads_batch_in_a_closure, 0) and not reads_argument(_reads_batch_in_a_closure, 1)
    assert reads_argument(lambda *args: args[0], 0)  # what it cannot see, it assumes read


def test_a_mask_that_reads_neither_batch_nor_head_is_one_broadcast_block_mask(cache):
    """B x H times fewer bytes; a head-reading hook keeps one mask per head (broadcast over the batch); both
    equal the oracle."""
    q, k, v = qkv(s=S)
    sizes = {}
    for name in ("prefix_lm", "per_head"):
        cache.clear()
        with torch.no_grad():
            out = TurboFlexAttention(flex_plan(turbo_flex_attention_mask_mod=HOOKS + name),
                                     FlexBackend(block_masks=cache))(q, k, v)
        (entry,) = cache._entries.values()
        sizes[name] = tuple(entry.mask.kv_num_blocks.shape[:2])
        same(out, oracle.attention(q, k, v, oracle.hook_mask(getattr(flex_hooks, name), 2, 4, S, S))[0])
    assert sizes == {"prefix_lm": (1, 1), "per_head": (1, 4)}, sizes  # per head, not per batch row


def test_a_rebound_global_rebuilds(cache, monkeypatch):
    backend = FlexBackend(block_masks=cache)
    run = TurboFlexAttention(flex_plan(turbo_flex_attention_mask_mod=HOOKS + "prefix_lm"), backend)
    q, k, v = qkv(s=S)
    with torch.no_grad():
        run(q, k, v)
        monkeypatch.setattr(flex_hooks, "PREFIX", 20)
        out = run(q, k, v)
    assert cache.builds == 2
    same(out, oracle.attention(q, k, v, oracle.hook_mask(flex_hooks.prefix_lm, 2, 4, S, S))[0])


def test_layers_share_one_block_mask_per_step(cache):
    backend = FlexBackend(block_masks=cache)
    layers = [TurboFlexAttention(flex_plan(turbo_flex_attention_mask_mod=HOOKS + "prefix_lm"), backend)
              for _ in range(24)]
    q, k, v = qkv(b=1, s=S)
    with torch.no_grad():
        for layer in layers:
            layer(q, k, v)
    assert (cache.builds, cache.hits) == (1, 23)
    assert 0 < cache.nbytes < 1 << 20


def test_cache_is_bounded_in_bytes():
    cache = BlockMaskCache(limit_bytes=1)
    backend = FlexBackend(block_masks=cache)
    q, k, v = qkv(b=1, s=S)
    for window in (3, 4, 5):
        backend.dense(q, k, v, KernelCall(pattern=Pattern(window, 0)))
    assert len(cache) == 1 and cache.evictions == 2


def test_gqa_sinks_and_top_left_alignment(cache):
    backend = FlexBackend(block_masks=cache)
    q, k, v = qkv(s=12, skv=20)
    sink = torch.randn(4, dtype=F64)
    for window in ((-1, 0), (3, 0), (2, 5)):
        out, lse = backend.dense(q, k, v, KernelCall(pattern=Pattern(*window), sink=sink, return_lse=True))
        want, want_lse = oracle.attention(q, k, v, oracle.flash_mask(12, 20, causal=False, window=window), sink=sink)
        same(out, want)
        same(lse, want_lse)


def test_alibi_slopes_and_an_alibi_hook(cache):
    backend = FlexBackend(block_masks=cache)
    q, k, v = qkv(s=S)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=F64)
    out = backend.dense(q, k, v, KernelCall(pattern=Pattern(-1, 0), alibi_slopes=slopes))
    causal = oracle.flash_mask(S, S, causal=True, window=(-1, -1))
    same(out, oracle.attention(q, k, v, causal, alibi=slopes)[0])
    plan = flex_plan(turbo_flex_attention_score_mod="tests.hook_examples:alibi")
    with torch.no_grad():
        out = TurboFlexAttention(plan, backend)(q, k, v)
    same(out, oracle.attention(q, k, v, causal, alibi=slopes)[0])


def test_packed_documents_from_device_boundaries(cache):
    backend = FlexBackend(block_masks=cache)
    q, k, v = packed_qkv(40)
    sink = torch.randn(4, dtype=F64)
    cu = torch.tensor([0, 7, 7, 25, 40], dtype=torch.int32)
    for window in ((-1, 0), (4, 0), (-1, -1)):
        out, lse = backend.packed(q, k, v, cu, cu, 18, 18, KernelCall(pattern=Pattern(*window), sink=sink,
                                                                       return_lse=True))
        allowed = oracle.packed_mask(cu.tolist(), cu.tolist(), causal=False, window=window)
        want, want_lse = oracle.packed_attention(q, k, v, allowed, sink=sink)
        same(out, want)
        same(lse, want_lse)
    backend.packed(q, k, v, cu, cu, 18, 18, KernelCall(pattern=Pattern(-1, 0)))
    assert (cache.builds, cache.hits) == (3, 1)
    backend.packed(q, k, v, cu.clone(), cu.clone(), 18, 18, KernelCall(pattern=Pattern(-1, 0)))
    assert cache.builds == 4  # other boundary tensors: built again


def test_the_cache_keeps_no_input_alive(cache):
    import gc
    import weakref

    backend = FlexBackend(block_masks=cache)
    q, k, v = packed_qkv(40)
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    backend.packed(q, k, v, cu, cu, 25, 25, KernelCall(pattern=Pattern(-1, 0)))
    refs = [weakref.ref(t) for t in (q, k, v, cu)]
    del q, k, v, cu
    gc.collect()
    assert all(r() is None for r in refs) and len(cache) == 1


# ------------------------------------------------------------------ the stand-in is torch's forward
def test_standin_forward_equals_real_flex_attention():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 40, 8, generator=gen, dtype=F64)
    k, v = (torch.randn(2, 2, 40, 8, generator=gen, dtype=F64) for _ in range(2))
    for mask, score in ((flex_hooks.prefix_lm, None), (flex_hooks.dilated_window, flex_hooks.softcap),
                        (flex_hooks.document_ids, None)):
        block = create_block_mask(mask, 2, 4, 40, 40, device="cpu", BLOCK_SIZE=16)
        args = dict(score_mod=score, block_mask=block, scale=0.3, enable_gqa=True, return_aux=AuxRequest(lse=True))
        real, real_aux = flex_attention(q, k, v, **args)
        got, got_aux = flex_standin(q, k, v, **args)
        same(got, real)
        same(got_aux.lse, real_aux.lse)


# ------------------------------------------------------------------ gradients of the glue (stand-in kernel)
def _grads(backend, q, k, v, sink, call_for, packed=None):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, sink)]
    call = call_for(leaves[3])
    if packed is None:
        out, lse = backend.dense(*leaves[:3], call)
    else:
        out, lse = backend.packed(*leaves[:3], packed, packed, 20, 20, call)
    gen = torch.Generator().manual_seed(7)
    loss = (out * torch.randn(out.shape, generator=gen, dtype=out.dtype)).sum()  # the lse is not differentiable
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("case", ["dense window", "dense hook", "packed"])
def test_glue_gradients_equal_the_reference(case, cache):
    flex = FlexBackend(kernel=flex_standin, block_masks=cache)
    sink = torch.randn(4, dtype=F64)
    if case == "packed":
        q, k, v = packed_qkv(40)
        bounds = torch.tensor([0, 15, 40], dtype=torch.int32)
        call_for = lambda s: KernelCall(pattern=Pattern(6, 0), sink=s, return_lse=True)  # noqa: E731
    else:
        q, k, v = qkv(s=S)
        bounds = None
        mask = flex_hooks.prefix_lm if case == "dense hook" else None
        pattern = None if mask else Pattern(9, 0)
        call_for = lambda s: KernelCall(pattern=pattern, mask_mod=mask, sink=s, return_lse=True)  # noqa: E731
    got = _grads(flex, q, k, v, sink, call_for, bounds)
    want = _grads(ReferenceBackend(), q, k, v, sink, call_for, bounds)
    for name, g, w in zip(("dq", "dk", "dv", "dsink"), got, want):
        assert oracle.mismatch(g, w, oracle.Tolerance(1e-9, 1e-9)) is None, (name, oracle.mismatch(g, w, TOL))


# ------------------------------------------------------------------ refusals at the call
def test_cpu_backward_is_refused_with_our_error():
    plan = flex_plan(turbo_flex_attention_mask_mod=HOOKS + "prefix_lm")
    q, k, v = qkv(s=S, grad=True)
    with pytest.raises(UnsupportedInputError) as err:
        TurboFlexAttention(plan)(q, k, v)
    assert "B34.flex-cpu-grad" in err.value.codes and "turbo_flex_attention_backend" in str(err.value)


def test_dropout_is_refused_with_our_error():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q, k, v = qkv(s=S)
        with pytest.raises(UnsupportedInputError) as err:
            FlexBackend().dense(q, k, v, KernelCall(pattern=Pattern(-1, 0), dropout_p=0.1))
    assert "B34.flex" in err.value.codes and "reference" in str(err.value)


# ------------------------------------------------------------------ regression: a score hook of another dtype
def bf16_rounding(score, b, h, q_idx, kv_idx):
    return score.to(torch.bfloat16)


def test_a_score_hook_returning_another_dtype_rounds_only_the_score(cache):
    """Found by the differential fuzzer: torch's eager flex_attention computed the whole softmax in the dtype a
    score hook returns (bf16 here), 4e-3 off the oracle with float64 inputs; the backend casts the hook's
    result back to the score's dtype, as the reference rounds only the score."""
    backend = FlexBackend(block_masks=cache)
    q, k, v = qkv(s=S)
    out = backend.dense(q, k, v, KernelCall(pattern=Pattern(-1, 0), score_mod=bf16_rounding))
    causal = oracle.flash_mask(S, S, causal=True, window=(-1, -1))
    same(out, oracle.attention(q, k, v, causal, score_fn=bf16_rounding)[0])


def test_half_inputs_on_cpu_accumulate_in_float32_as_the_other_backends_do():
    """torch's eager CPU flex_attention computes in the inputs' dtype; the backend upcasts there, so a
    bf16 call with large scores (and its lse) is as close to float64 as the reference backend's."""
    from primus_ext.attention.pattern import Pattern
    from primus_ext.backends.base import KernelCall
    from primus_ext.backends.flex import FlexBackend

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 8, 2, 8) * s for s in (16.0, 1.0, 1.0))
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    call = KernelCall(pattern=Pattern(-1, 0), return_lse=True)
    out, lse = FlexBackend().dense(q, k, v, call)
    q64, k64, v64 = (t.double().transpose(1, 2) for t in (q, k, v))
    scores = (q64 @ k64.transpose(-1, -2)) / 8 ** 0.5
    scores = scores.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    want_lse = torch.logsumexp(scores, -1)
    want = (torch.softmax(scores, -1) @ v64).transpose(1, 2)
    assert lse.dtype == torch.float32 and out.dtype == torch.bfloat16
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-4, rtol=0)
    torch.testing.assert_close(out.double(), want, atol=1e-2, rtol=0)
