"""Hostile review of the prepared-call cache (`primus_ext.call.prepared`).

The rule under test: a call served from an adapter's cache is computed exactly as the full path
would compute it, or refused with `UnsupportedInputError`.  The oracle for "the full path" is a
FRESH adapter (empty cache) built from the same plan and given the second call's arguments.

Findings (tests that failed on the code as reviewed, regression tests since) and tests marked
"held" (attacks the cache withstood).  Most findings were in a packed shortcut that trusted the
boundaries it saw last by "same object, same ``_version``", while ``t.data = other`` (and writes
through numpy / ``.data``) change a tensor's shape, dtype or values without bumping ``_version``:
the shortcut was removed and the shared facts compare storage and metadata too.  Writes behind the
version counter stay unseen (a documented limit, held as a strict expected failure).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from primus_ext.call.adapter import TurboFlexAttention
from primus_ext.call.facts import FACTS
from primus_ext.call.prepared import LIMIT
from primus_ext.errors import UnsupportedInputError
from primus_ext.plan import build_plan
from primus_ext.testing import fake_primus_turbo

from .helpers import adapter, facts, packed_qkv, qkv, settings

BACKENDS = ["reference", "turbo"]


def _cu(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _attempt(fn):
    """``("ok", output)`` or ``("refused", codes)``; any other exception is a ``("foreign", repr)``."""
    try:
        return "ok", fn()
    except UnsupportedInputError as err:
        return "refused", tuple(err.codes)
    except Exception as err:  # noqa: BLE001 - a foreign exception is itself a verdict here
        return "foreign", repr(err)


def _assert_same(cached, fresh) -> None:
    """The cached adapter's verdict is the fresh one's: same numbers, or the same refusal."""
    assert cached[0] == fresh[0], f"cached adapter: {cached[0]} {cached[1] if cached[0] != 'ok' else ''}; " \
                                  f"fresh adapter: {fresh[0]} {fresh[1] if fresh[0] != 'ok' else ''}"
    if cached[0] == "ok":
        got = cached[1] if isinstance(cached[1], tuple) else (cached[1],)
        want = fresh[1] if isinstance(fresh[1], tuple) else (fresh[1],)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    else:
        assert cached[1] == fresh[1]


def _warm_packed(run, q, k, v, cu_q, cu_kv, max_q, max_kv, **kw) -> None:
    """Three equal calls: a miss, a checked hit (which records ``seen``), and a ``seen`` hit."""
    for _ in range(3):
        run.varlen(q, k, v, cu_q, cu_kv, max_q, max_kv, **kw)
    assert (run.calls.misses, run.calls.hits) == (1, 2)


# ------------------------------------------------------------------------------------------------
# Findings (fail today)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_boundaries_swapped_by_data_assignment_to_another_document_count(backend):
    """FINDING.  q and kv boundaries are two tensors; after the warm-up, ``cu_kv.data = ...`` gives
    cu_kv four entries (three documents) while cu_q keeps three (two documents), with no version
    bump.  The fresh adapter refuses it (B34.document-count).  The cached adapter takes the
    ``seen`` route (same objects, same versions, same token counts) and skips every metadata check:
    the reference backend computes it, turbo refuses with another code (document-alignment), or,
    for a non-causal layer, Primus-Turbo's own ValueError escapes."""
    layer = facts(packed=True)
    with fake_primus_turbo():
        s = settings(turbo_flex_attention_backend=backend)
        run = adapter(s, layer)
        q, k, v = packed_qkv(11)
        cu_q, cu_kv = _cu(0, 4, 11), _cu(0, 4, 11)
        _warm_packed(run, q, k, v, cu_q, cu_kv, 7, 7)
        cu_kv.data = _cu(0, 2, 5, 11)
        cached = _attempt(lambda: run.varlen(q, k, v, cu_q, cu_kv, 7, 7))
        fresh = _attempt(lambda: adapter(s, layer).varlen(q, k, v, cu_q, cu_kv, 7, 7))
    assert fresh == ("refused", ("B34.document-count",))
    _assert_same(cached, fresh)


def test_boundaries_swapped_to_another_document_count_on_a_full_mask_layer_escape_as_a_kernel_error():
    """FINDING (turbo, non-causal layer: the runner's same-boundaries check is off).  Same attack as
    above: the cached adapter hands Primus-Turbo boundaries of two document counts and its
    ``ValueError`` escapes; the fresh adapter refuses with B34.document-count."""
    layer = facts(packed=True, causal=False, attn_mask_type="no_mask")
    with fake_primus_turbo():
        s = settings(turbo_flex_attention_backend="turbo")
        run = adapter(s, layer)
        q, k, v = packed_qkv(11)
        cu_q, cu_kv = _cu(0, 4, 11), _cu(0, 4, 11)
        _warm_packed(run, q, k, v, cu_q, cu_kv, 7, 7)
        cu_kv.data = _cu(0, 2, 5, 11)
        cached = _attempt(lambda: run.varlen(q, k, v, cu_q, cu_kv, 7, 7))
        fresh = _attempt(lambda: adapter(s, layer).varlen(q, k, v, cu_q, cu_kv, 7, 7))
    _assert_same(cached, fresh)


@pytest.mark.parametrize("backend", BACKENDS)
def test_boundaries_turned_int64_by_data_assignment_are_passed_to_the_kernel_uncast(backend):
    """FINDING.  One boundary tensor for q and kv; after the warm-up ``cu.data = cu.data.long()``
    (no version bump).  The fresh adapter casts int64 boundaries to int32 and runs.  The cached
    adapter's ``seen`` route hands the int64 tensor straight to the kernel: Primus-Turbo's
    ``flash_attn_varlen_func`` raises ``ValueError: cu_seqlens_q must be a 1-D int32 tensor``
    (the real kernel would read the int64 words as int32 pairs)."""
    layer = facts(packed=True)
    with fake_primus_turbo() as fake:
        s = settings(turbo_flex_attention_backend=backend)
        run = adapter(s, layer)
        q, k, v = packed_qkv(11)
        cu = _cu(0, 4, 11)
        _warm_packed(run, q, k, v, cu, cu, 7, 7)
        cu.data = cu.data.long()
        before = len(fake.calls)
        cached = _attempt(lambda: run.varlen(q, k, v, cu, cu, 7, 7))
        fresh = _attempt(lambda: adapter(s, layer).varlen(q, k, v, cu, cu, 7, 7))
        dtypes = [c.args["cu_seqlens_q"].dtype for c in fake.calls[before:]]
    _assert_same(cached, fresh)
    assert all(d == torch.int32 for d in dtypes), dtypes


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_numpy_write_to_boundaries_runs_on_the_cached_route_after_the_shared_facts_forgot_them(backend):
    """FINDING.  Boundaries in a reused host buffer (``torch.from_numpy``, as a data loader fills
    one) are rewritten through numpy: no version bump.  Other call sites prove 8 other boundary
    tensors, so the shared `FACTS` (8 entries) forgets this one and a fresh adapter checks the
    values again and refuses (a document of 9 tokens, max_seqlen 7: B34.boundaries).  The cached
    adapter's ``seen`` (never evicted, kept per entry) still vouches for the tensor: the
    reference backend runs it, turbo's kernel raises its own ValueError."""
    layer = facts(packed=True)
    with fake_primus_turbo():
        s = settings(turbo_flex_attention_backend=backend)
        run = adapter(s, layer)
        q, k, v = packed_qkv(11)
        buffer = np.array([0, 4, 11], dtype=np.int32)
        cu = torch.from_numpy(buffer)
        _warm_packed(run, q, k, v, cu, cu, 7, 7)
        other = adapter(s, layer)  # another layer proving its own boundaries
        for _ in range(8):
            fresh_cu = _cu(0, 4, 11)
            other.varlen(q, k, v, fresh_cu, fresh_cu, 7, 7)
        buffer[:] = [0, 9, 11]
        cached = _attempt(lambda: run.varlen(q, k, v, cu, cu, 7, 7))
        fresh = _attempt(lambda: adapter(s, layer).varlen(q, k, v, cu, cu, 7, 7))
    assert fresh == ("refused", ("B34.boundaries",))
    _assert_same(cached, fresh)


def test_equal_documents_broken_by_data_assignment_reach_flydsl():
    """FINDING (B36 on gfx950).  A ``packed_equal_documents`` layer; after the warm-up with four
    documents of 16, ``cu.data = ...`` makes eight documents of 8 (max_seqlen still 16): the full
    path refuses it (8 documents * 16 != 64 tokens, B36), the cached adapter's ``seen`` route
    sends it to the varlen kernel."""
    layer = facts(num_heads=8, num_kv_heads=1, head_dim=64, seq_length=64, dtype="bf16", packed=True)
    keys = dict(turbo_flex_attention_backend="turbo", turbo_arch="gfx950", use_sink_attention=True,
                packed_equal_documents=True)
    q, k, v = (t.to(torch.bfloat16) for t in packed_qkv(64, 8, 1, 64))
    sink = torch.zeros(8)
    with fake_primus_turbo(arch="gfx950") as fake:
        plan = build_plan(settings(**keys), layer)
        run = TurboFlexAttention(plan)
        cu = _cu(0, 16, 32, 48, 64)
        _warm_packed(run, q, k, v, cu, cu, 16, 16, causal=True, sink=sink)
        cu.data = _cu(*range(0, 65, 8))
        before = len(fake.calls)
        cached = _attempt(lambda: run.varlen(q, k, v, cu, cu, 16, 16, causal=True, sink=sink))
        reached = len(fake.calls) - before
        fresh = _attempt(lambda: TurboFlexAttention(plan).varlen(q, k, v, cu, cu, 16, 16, causal=True, sink=sink))
    assert fresh[0] == "refused" and any(code.startswith("B36") for code in fresh[1]), fresh
    _assert_same(cached, fresh)
    assert reached == 0, "the kernel was called with boundaries the full path refuses"


@pytest.mark.xfail(strict=True, reason="a limit, documented (primus_ext.call.facts, docs/performance.md#8-caches): "
                   "values written behind the version counter are not seen, as autograd does not see them; "
                   "reading them back would be a host sync per call")
def test_the_shared_facts_trust_a_numpy_write_to_boundaries():
    """FINDING (in `primus_ext.call.facts`, shared by the full path too, so a fresh adapter is
    fooled as well): the fact "these boundaries were checked" is keyed by object and ``_version``,
    and a write through numpy (a reused host buffer) bumps neither.  A fresh adapter then runs a
    document of 9 tokens under max_seqlen 7; with the facts forgotten it refuses (B34.boundaries).
    `primus_ext.hooks.trace._tensor_check` guards a hook's captured tensors against exactly
    this with a snapshot; the boundaries get no such guard."""
    layer = facts(packed=True)
    s = settings(turbo_flex_attention_backend="reference")
    q, k, v = packed_qkv(11)
    buffer = np.array([0, 4, 11], dtype=np.int32)
    cu = torch.from_numpy(buffer)
    adapter(s, layer).varlen(q, k, v, cu, cu, 7, 7)  # proves the boundaries, into FACTS
    buffer[:] = [0, 9, 11]
    fooled = _attempt(lambda: adapter(s, layer).varlen(q, k, v, cu, cu, 7, 7))
    FACTS.forget()
    checked = _attempt(lambda: adapter(s, layer).varlen(q, k, v, cu, cu, 7, 7))
    assert checked == ("refused", ("B34.boundaries",))
    _assert_same(fooled, checked)


# ------------------------------------------------------------------------------------------------
# Attacks that held (pass today)
# ------------------------------------------------------------------------------------------------

def _dense_pair(backend, first, second, layer=None, **adapter_kw):
    """Run ``first`` then ``second`` on one adapter, ``second`` on a fresh one; return
    (cached verdict, fresh verdict, whether ``second`` was a hit)."""
    layer = layer or facts(packed=False)
    with fake_primus_turbo():
        s = settings(turbo_flex_attention_backend=backend)
        run = adapter(s, layer, **adapter_kw)
        first(run)
        hits = run.calls.hits
        cached = _attempt(lambda: second(run))
        hit = run.calls.hits > hits
        fresh = _attempt(lambda: second(adapter(s, layer, **adapter_kw)))
    return cached, fresh, hit


Q, K, V = qkv(dtype=torch.float32)
NAN = float("nan")
HELD_DENSE = {
    # held: a zero or NaN scale is refused (B34.scale), after a valid call as on a fresh adapter
    "scale -0.0 after 0.5": (lambda r: r(Q, K, V, softmax_scale=0.5), lambda r: r(Q, K, V, softmax_scale=-0.0)),
    "scale nan after 0.5": (lambda r: r(Q, K, V, softmax_scale=0.5), lambda r: r(Q, K, V, softmax_scale=NAN)),
    # held: a numpy float scale is not a plain float: full path
    "numpy scale after float": (lambda r: r(Q, K, V, softmax_scale=0.5),
                                lambda r: r(Q, K, V, softmax_scale=np.float64(0.5))),
    # held: causal=1 is not a bool: full path
    "causal=1 after True": (lambda r: r(Q, K, V, causal=True), lambda r: r(Q, K, V, causal=1)),
    # held: dropout 0 / 0.0 / -0.0 share a key and all mean no dropout
    "dropout -0.0 after 0": (lambda r: r(Q, K, V, dropout_p=0), lambda r: r(Q, K, V, dropout_p=-0.0)),
    "deterministic after not": (lambda r: r(Q, K, V), lambda r: r(Q, K, V, deterministic=True)),
    "return_lse after not": (lambda r: r(Q, K, V), lambda r: r(Q, K, V, return_lse=True)),
    "return_attn_probs after not": (lambda r: r(Q, K, V), lambda r: r(Q, K, V, return_attn_probs=True)),
    "k float64 after float32": (lambda r: r(Q, K, V), lambda r: r(Q, K.double(), V)),
    "k on meta": (lambda r: r(Q, K, V), lambda r: r(Q, K.to("meta"), V)),
    # held: strides are in the key (turbo refuses the layout, reference computes it)
    "q of other strides": (lambda r: r(Q, K, V), lambda r: r(Q.transpose(0, 1).contiguous().transpose(0, 1), K, V)),
    # held: a storage offset changes nothing the full path reads
    "q with a storage offset": (lambda r: r(Q, K, V), lambda r: r(torch.cat([Q, Q])[2:], K, V)),
    "q a Parameter": (lambda r: r(Q, K, V), lambda r: r(torch.nn.Parameter(Q.clone()), K, V)),
    "bias on the second call": (lambda r: r(Q, K, V), lambda r: r(Q, K, V, bias=torch.zeros(3, 16, 16))),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(HELD_DENSE))
def test_held_dense_scalars_and_metadata(name, backend):
    """held: each second call is served as the full path would serve it."""
    cached, fresh, _ = _dense_pair(backend, *HELD_DENSE[name])
    _assert_same(cached, fresh)


@pytest.mark.parametrize("backend", BACKENDS)
def test_held_drop_in_flags_call_after_call(backend):
    """held: a drop-in adapter's own causal / window per call, each one hit or not, as fresh."""
    layer = facts(packed=False)
    s = settings(turbo_flex_attention_backend=backend, sink_sliding_window=4)
    calls = [dict(causal=True, window_size=(4, 0)), dict(causal=True), dict(causal=False),
             dict(causal=False, window_size=(2, 2))] * 2
    with fake_primus_turbo():
        run = TurboFlexAttention(build_plan(s, layer), drop_in=True)
        for kw in calls:
            cached = _attempt(lambda: run(Q, K, V, **kw))
            fresh = _attempt(lambda: TurboFlexAttention(build_plan(s, layer), drop_in=True)(Q, K, V, **kw))
            _assert_same(cached, fresh)
        assert run.calls.hits >= 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_held_in_place_writes_to_boundaries_are_checked(backend):
    """held: an in-place write (``cu[1] = 9``, ``unsqueeze_``) bumps the version: refused on a hit."""
    layer = facts(packed=True)
    with fake_primus_turbo():
        s = settings(turbo_flex_attention_backend=backend)
        run = adapter(s, layer)
        q, k, v = packed_qkv(11)
        cu = _cu(0, 4, 11)
        _warm_packed(run, q, k, v, cu, cu, 7, 7)
        cu[1] = 9
        _assert_same(_attempt(lambda: run.varlen(q, k, v, cu, cu, 7, 7)),
                     _attempt(lambda: adapter(s, layer).varlen(q, k, v, cu, cu, 7, 7)))
        other = _cu(0, 4, 11)
        _warm_packed(adapter(s, layer), q, k, v, other, other, 7, 7)
        other.unsqueeze_(0)
        _assert_same(_attempt(lambda: run.varlen(q, k, v, other, other, 7, 7)),
                     _attempt(lambda: adapter(s, layer).varlen(q, k, v, other, other, 7, 7)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_held_max_seqlen_forms_between_calls(backend):
    """held: max_seqlen None / int / too small / bool / tensor / numpy int after a prepared call."""
    layer = facts(packed=True)
    with fake_primus_turbo():
        s = settings(turbo_flex_attention_backend=backend)
        run = adapter(s, layer)
        q, k, v = packed_qkv(11)
        cu = _cu(0, 4, 11)
        for m in (None, None, 7, None, 3, True, torch.tensor(7), np.int64(7), 7, 3):
            _assert_same(_attempt(lambda: run.varlen(q, k, v, cu, cu, m, m)),
                         _attempt(lambda: adapter(s, layer).varlen(q, k, v, cu, cu, m, m)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_held_eviction_beyond_the_limit(backend):
    """held: LIMIT + 3 keys in turn, then again: every call as the first time (FIFO thrashes, but
    nothing stale is served)."""
    with fake_primus_turbo():
        run = adapter(settings(turbo_flex_attention_backend=backend), facts(packed=False))
        first = [run(Q, K, V, softmax_scale=0.1 + i) for i in range(LIMIT + 3)]
        again = [run(Q, K, V, softmax_scale=0.1 + i) for i in range(LIMIT + 3)]
        assert len(run.calls) == LIMIT
    for a, b in zip(first, again):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_held_gradients_and_no_grad_on_a_hit(backend):
    """held: a hit's output and gradients equal a fresh adapter's; under no_grad nothing is tracked."""
    q, k, v = qkv(dtype=torch.float32, grad=True)
    with fake_primus_turbo():
        s = settings(turbo_flex_attention_backend=backend)
        run = adapter(s, facts(packed=False))
        run(q, k, v)
        out = run(q, k, v)
        assert run.calls.hits == 1
        got = torch.autograd.grad(out.sum(), (q, k, v))
        ref = adapter(s, facts(packed=False))(q, k, v)
        want = torch.autograd.grad(ref.sum(), (q, k, v))
        with torch.no_grad():
            quiet = run(q, k, v)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not quiet.requires_grad and torch.equal(quiet, ref.detach())


def test_held_a_freed_boundary_tensor_at_a_reused_address():
    """held: ``seen`` and the facts hold weak references, so a new tensor at a freed one's address
    is checked again."""
    layer = facts(packed=True)
    s = settings()
    run = adapter(s, layer)
    q, k, v = packed_qkv(11)
    cu = _cu(0, 4, 11)
    _warm_packed(run, q, k, v, cu, cu, 7, 7)
    del cu
    bad = _cu(0, 9, 11)
    _assert_same(_attempt(lambda: run.varlen(q, k, v, bad, bad, 7, 7)),
                 _attempt(lambda: adapter(s, layer).varlen(q, k, v, bad, bad, 7, 7)))


# ------------------------------------------------------------------------------------------------
# One boundary check for the hit and the full path (`check_packed`, no shortcut copy)
# ------------------------------------------------------------------------------------------------

_MALFORMED = {
    "float boundaries": lambda cu: cu.float(),
    "two-dimensional": lambda cu: cu.reshape(1, -1),
    "one entry": lambda cu: cu[:1],
    "not starting at 0": lambda cu: cu + 1,
    "past the tokens": lambda cu: torch.cat([cu[:-1], cu[-1:] + 5]),
    "decreasing": lambda cu: cu.flip(0),
    "a list": lambda cu: cu.tolist(),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("change", sorted(_MALFORMED))
def test_a_prepared_packed_call_refuses_what_the_full_path_refuses(backend, change):
    """After a warm hit, boundaries changed in every way the full path refuses give the same verdict from the
    cached adapter as from a fresh one (the hit runs the full path's `check_packed`)."""
    layer = facts(packed=True)
    with fake_primus_turbo():
        plan = build_plan(settings(turbo_flex_attention_backend=backend), layer)
        q, k, v = packed_qkv(12)
        cu = _cu(0, 5, 12)
        cached = TurboFlexAttention(plan)
        _warm_packed(cached, q, k, v, cu, cu, None, None)
        bad = _MALFORMED[change](cu.clone())
        got = _attempt(lambda: cached.varlen(q, k, v, bad, bad, None, None))
        want = _attempt(lambda: TurboFlexAttention(plan).varlen(q, k, v, bad, bad, None, None))
    assert got[0] == "refused"
    _assert_same(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_int64_boundaries_are_served_from_the_cache(backend):
    """torch's default integer boundaries are cast for the kernels on the hit path too (the full path's check),
    so a loader that makes them int64 no longer takes the full path at every call."""
    layer = facts(packed=True)
    with fake_primus_turbo():
        run = adapter(settings(turbo_flex_attention_backend=backend), layer)
        q, k, v = packed_qkv(12)
        cu = torch.tensor([0, 5, 12], dtype=torch.int64)
        outs = [run.varlen(q, k, v, cu, cu, None, None) for _ in range(3)]
    assert (run.calls.misses, run.calls.hits) == (1, 2)
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=0, atol=0)
