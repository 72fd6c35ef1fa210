"""The CPU fake of Primus-Turbo keeps the real contract: signatures, checks, numbers."""

from __future__ import annotations

import inspect
import sys
import types

import pytest
from types import SimpleNamespace

import torch
from torch.nn.attention.flex_attention import create_block_mask

from primus_ext.attention.pattern import Pattern
from primus_ext.backends import exact
from primus_ext.testing import fake_primus_turbo

# Parameter names in order, transcribed from the reference contract (not from the fake).
FLASH = ["q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size", "bias",
         "alibi_slopes", "deterministic", "return_lse", "return_attn_probs"]
VARLEN = FLASH[:3] + ["cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"] + FLASH[3:]
FLEX = ["query", "key", "value", "score_mod", "block_mask", "scale", "enable_gqa", "return_lse",
        "kernel_options", "alibi_slopes", "softcap", "dropout_p", "sink", "bias"]
FLEX_VARLEN = ["query", "key", "value", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
               "max_seqlen_k", "causal", "window_size", "scale", "alibi_slopes", "dropout_p",
               "sink", "softcap", "return_lse"]
BLOCK_MASK = ["mask_mod", "B", "H", "Q_LEN", "KV_LEN", "device", "BLOCK_SIZE", "_compile"]
GROUPS = ["ulysses_group", "ring_group"]


def expected_signatures(flex_bshd: bool, flex_deterministic: bool, varlen_sink: bool,
                        flex: bool) -> dict[str, list[str]]:
    det = ["deterministic"] if flex_deterministic else []
    out = {
        "flash_attn_func": FLASH + ["sink"],
        "flash_attn_varlen_func": VARLEN + (["sink"] if varlen_sink else []),
        "flash_attn_fp8_func": FLASH + ["fp8_config"],
        "flash_attn_usp_func": FLASH + GROUPS + ["qkv_format"],
        "flash_attn_varlen_usp_func": VARLEN + GROUPS,
        "flash_attn_fp8_usp_func": FLASH + ["fp8_config"] + GROUPS,
    }
    if flex:
        out["flex_attention"] = FLEX + det
        if flex_bshd:
            out["flex_attention_bshd"] = FLEX + det
        out["flex_attention_varlen"] = FLEX_VARLEN + det
        out["create_block_mask"] = BLOCK_MASK
    return out


KNOBS = [dict(flex_bshd=a, flex_deterministic=b, varlen_sink=c, flex=d)
         for a in (True, False) for b in (True, False) for c in (True, False) for d in (True, False)]


@pytest.mark.parametrize("knobs", KNOBS, ids=lambda k: "-".join(f"{n}={int(v)}" for n, v in k.items()))
def test_signatures_match_reference(knobs: dict[str, bool]) -> None:
    expected = expected_signatures(**knobs)
    every = expected_signatures(True, True, True, True)
    with fake_primus_turbo(**knobs) as fake:
        import primus_turbo.pytorch.ops as ops
        import primus_turbo.pytorch.ops.attention as attention

        assert fake.module is attention
        for name in every:
            assert hasattr(attention, name) == (name in expected), name
            assert hasattr(ops, name) == (name in expected), name
        for name, params in expected.items():
            sig = inspect.signature(getattr(ops, name))
            assert list(sig.parameters) == params, name
            kinds = {p.kind for p in sig.parameters.values()}
            assert inspect.Parameter.VAR_KEYWORD not in kinds, name
        if knobs["flex"]:
            varlen_kw = [n for n, p in inspect.signature(attention.flex_attention_varlen).parameters.items()
                         if p.kind is inspect.Parameter.KEYWORD_ONLY]
            assert varlen_kw[0] == "causal"


def qkv(b: int = 1, s: int = 8, hq: int = 2, hkv: int = 2, d: int = 8, skv: int | None = None,
        dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    skv = s if skv is None else skv
    return (torch.randn(b, s, hq, d, generator=gen, dtype=torch.float32).to(dtype),
            torch.randn(b, skv, hkv, d, generator=gen, dtype=torch.float32).to(dtype),
            torch.randn(b, skv, hkv, d, generator=gen, dtype=torch.float32).to(dtype))


def test_unknown_keywords_are_type_errors() -> None:
    q, k, v = qkv()
    with fake_primus_turbo(varlen_sink=False, flex_deterministic=False) as fake:
        ops = fake.module
        for name in ("flash_attn_fp8_func", "flash_attn_usp_func", "flash_attn_fp8_usp_func"):
            with pytest.raises(TypeError, match="sink"):
                getattr(ops, name)(q, k, v, sink=None)
        cu = torch.tensor([0, 8], dtype=torch.int32)
        with pytest.raises(TypeError, match="sink"):
            ops.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 8, 8, sink=None)
        with pytest.raises(TypeError, match="deterministic"):
            ops.flex_attention_bshd(q, k, v, deterministic=True)
        with pytest.raises(TypeError):
            ops.flex_attention_varlen(q[0], k[0], v[0], cu, cu, 8, 8, True)  # causal is keyword-only
    with fake_primus_turbo() as fake:
        fake.module.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 8, 8, sink=None)


def test_calls_are_recorded_with_defaults_and_reset() -> None:
    q, k, v = qkv(d=32)  # the fp8 kernel's backward asserts head dims >= 32
    with fake_primus_turbo() as fake:
        fake.module.flash_attn_func(q, k, v, causal=True)
        fake.module.flash_attn_fp8_func(q, k, v)
        (call,) = fake.calls_to("flash_attn_func")
        assert call.args["q"] is q and call.args["causal"] is True
        assert call.args["window_size"] == (-1, -1) and call.args["sink"] is None
        assert [c.entry for c in fake.calls] == ["flash_attn_func", "flash_attn_fp8_func"]
        fake.reset()
        assert fake.calls == [] and fake.probe_count == 0


def test_dense_causal_output_and_grad_equal_exact() -> None:
    q, k, v = qkv(b=2, s=8, hq=4, hkv=2)
    q.requires_grad_(True)
    allowed = torch.ones(8, 8, dtype=torch.bool).tril()
    want, want_lse = exact.attention(q, k, v, allowed=allowed, return_lse=True)
    with fake_primus_turbo() as fake:
        out, lse = fake.module.flash_attn_func(q, k, v, causal=True, return_lse=True)
        alone = SimpleNamespace(size=lambda: 1, rank=lambda: 0)  # a one-rank group, as the entry reads it
        usp = fake.module.flash_attn_usp_func(q, k, v, causal=True, ulysses_group=alone, ring_group=alone)
        bm = fake.module.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 8, 8)
        flex = fake.module.flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          block_mask=bm, enable_gqa=True)
        assert fake.calls_to("flash_attn_usp_func")[0].args["ring_group"] is alone
    # The fake's math (blockwise online softmax) shares no code with exact's (one softmax
    # per row), so float32 rounding differs: torch's float32 tolerances, not bit equality.
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)
    # Entries of the fake share its math: those stay bit-equal.
    torch.testing.assert_close(usp, out, rtol=0, atol=0)
    torch.testing.assert_close(flex.transpose(1, 2), out, rtol=0, atol=0)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_dense_uses_bottom_right_alignment_when_lengths_differ() -> None:
    q, k, v = qkv(s=3, skv=6)
    with fake_primus_turbo() as fake:
        out = fake.module.flash_attn_func(q, k, v, causal=True)
    allowed = torch.arange(6).view(1, 6) <= torch.arange(3).view(3, 1) + 3
    torch.testing.assert_close(out, exact.attention(q, k, v, allowed=allowed))


def test_dense_argument_checks() -> None:
    q, k, v = qkv()
    with fake_primus_turbo() as fake:
        ops = fake.module
        with pytest.raises(AssertionError, match="window_size_left and window_size_right must be -1"):
            ops.flash_attn_fp8_func(q, k, v, window_size=(4, 0))
        with pytest.raises(RuntimeError, match="bias"):
            ops.flash_attn_func(q, k, v, bias=torch.zeros(1, 2, 8, 8))
        with pytest.raises(RuntimeError, match="bias"):
            ops.flash_attn_func(q.bfloat16(), k.bfloat16(), v.bfloat16(), bias=torch.zeros(8, 8))
        with pytest.raises(NotImplementedError):
            ops.flash_attn_func(q, k, v, return_attn_probs=True)
        with pytest.raises(ValueError, match="dropout"):
            ops.flash_attn_func(q, k, v, dropout_p=1.0)
        with pytest.raises(ValueError, match="4-D"):
            ops.flash_attn_func(q[0], k[0], v[0])
        with pytest.raises(ValueError, match="multiple"):
            ops.flash_attn_func(*qkv(hq=3, hkv=2))
        bias = torch.randn(8, 8)
        torch.testing.assert_close(ops.flash_attn_func(q, k, v, bias=bias),
                                   exact.attention(q, k, v, bias=bias))


def test_sink_checks() -> None:
    q, k, v = qkv(hq=2)
    with fake_primus_turbo() as fake:
        ops = fake.module
        with pytest.raises(ValueError, match="fp32"):
            ops.flash_attn_func(q, k, v, sink=torch.zeros(2, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="fp32"):
            ops.flex_attention_bshd(q, k, v, sink=torch.zeros(2, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="shape"):
            ops.flash_attn_func(q, k, v, sink=torch.zeros(3))
        with pytest.raises(ValueError, match="power-of-two"):
            ops.flash_attn_func(*qkv(d=12), sink=torch.zeros(2))
        sink = torch.zeros(2, requires_grad=True)
        out = ops.flash_attn_func(q, k, v, causal=True, sink=sink)
    want = exact.attention(q, k, v, allowed=torch.ones(8, 8, dtype=torch.bool).tril(), sink=sink)
    torch.testing.assert_close(out, want)
    out.sum().backward()
    assert sink.grad is not None


def test_flex_layout_check_catches_missing_transpose() -> None:
    q, k, v = qkv(b=1, s=8, hq=2)  # bshd
    with fake_primus_turbo() as fake:
        bm = fake.module.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 8, 8)
        with pytest.raises(ValueError, match="layout"):
            fake.module.flex_attention(q, k, v, block_mask=bm)  # bhsd entry given bshd
        out = fake.module.flex_attention_bshd(q, k, v, block_mask=bm)
        assert out.shape == q.shape


def _window(w: int):
    return lambda b, h, qi, ki: (qi >= ki) & (qi - ki <= w)


@pytest.mark.parametrize("mask_mod, pattern", [
    (lambda b, h, qi, ki: qi >= 0, Pattern(-1, -1)),
    (lambda b, h, qi, ki: qi >= ki, Pattern(-1, 0)),
    (_window(3), Pattern(3, 0)),
], ids=["full", "causal", "sliding"])
def test_flex_classifies_and_matches_exact(mask_mod, pattern: Pattern) -> None:
    q, k, v = qkv(b=2, s=16, hq=4, hkv=2)
    with fake_primus_turbo() as fake:
        bm = fake.module.create_block_mask(mask_mod, None, None, 16, 16)
        out = fake.module.flex_attention_bshd(q, k, v, block_mask=bm, enable_gqa=True)
    allowed = pattern.allows(torch.arange(16).view(-1, 1), torch.arange(16).view(1, -1))
    # Independent float32 implementations: torch's float32 tolerances (see above).
    torch.testing.assert_close(out, exact.attention(q, k, v, allowed=allowed))


@pytest.mark.parametrize("mask_mod, length, why", [
    (lambda b, h, qi, ki: (qi - ki).abs() <= 2, 16, "later key"),     # non-causal window
    (lambda b, h, qi, ki: (qi >= ki) | (h == 1), 16, "head-depend"),  # head-dependent
    (lambda b, h, qi, ki: (qi >= ki) | (b == 1), 16, "batch"),        # batch-dependent
    (lambda b, h, qi, ki: (ki <= qi) & (ki % 2 == 0), 16, "neither"), # arbitrary
    (_window(600), 1024, "probe grid"),                               # edge past the grid
], ids=["bidirectional", "head", "batch", "arbitrary", "wide-window"])
def test_flex_refuses_unrecognised_masks(mask_mod, length: int, why: str) -> None:
    q, k, v = qkv(b=2, s=length, hq=2, d=4)
    with fake_primus_turbo() as fake:
        bm = fake.module.create_block_mask(mask_mod, None, None, length, length)
        with pytest.raises(NotImplementedError, match=why):
            fake.module.flex_attention_bshd(q, k, v, block_mask=bm)


def test_flex_window_inside_grid_on_long_sequence() -> None:
    q, k, v = qkv(s=1024, hq=1, hkv=1, d=4)
    with fake_primus_turbo() as fake:
        bm = fake.module.create_block_mask(_window(100), None, None, 1024, 1024)
        out = fake.module.flex_attention_bshd(q, k, v, block_mask=bm)
    allowed = Pattern(100, 0).allows(torch.arange(1024).view(-1, 1), torch.arange(1024).view(1, -1))
    torch.testing.assert_close(out, exact.attention(q, k, v, allowed=allowed))


def test_flex_probe_is_memoised_per_block_mask_object() -> None:
    q, k, v = qkv(s=16)
    with fake_primus_turbo() as fake:
        bm = fake.module.create_block_mask(_window(3), None, None, 16, 16)
        fake.module.flex_attention_bshd(q, k, v, block_mask=bm)
        assert fake.probe_count == 1
        fake.module.flex_attention_bshd(q, k, v, block_mask=bm)
        fake.module.flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm)
        assert fake.probe_count == 1
        same_mask_new_object = fake.module.create_block_mask(_window(3), None, None, 16, 16)
        fake.module.flex_attention_bshd(q, k, v, block_mask=same_mask_new_object)
        assert fake.probe_count == 2


def test_flex_score_mod_and_other_checks() -> None:
    q, k, v = qkv(s=8, hq=4, hkv=2)
    slopes = torch.ones(4)
    with fake_primus_turbo() as fake:
        ops = fake.module
        ops.flex_attention_bshd(q, k, v, score_mod=lambda s, b, h, qi, ki: s, enable_gqa=True)
        with pytest.raises(NotImplementedError):
            ops.flex_attention_bshd(q, k, v, score_mod=lambda s, b, h, qi, ki: s * 2, enable_gqa=True)
        with pytest.raises(ValueError, match="alibi"):
            ops.flex_attention_bshd(q, k, v, score_mod=lambda s, b, h, qi, ki: s + 1,
                                    alibi_slopes=slopes, enable_gqa=True)
        with pytest.raises(ValueError, match="enable_gqa"):
            ops.flex_attention_bshd(q, k, v)
        with pytest.raises(ValueError, match="softcap"):
            ops.flex_attention_bshd(q, k, v, softcap=30.0, enable_gqa=True)
        out = ops.flex_attention_bshd(q, k, v, alibi_slopes=slopes, enable_gqa=True)
    # full attention reaches AITER's CK kernels, whose ALiBi is symmetric off the causal case (docs/fidelity.md,
    # fact `ck-alibi`)
    distance = (torch.arange(8).view(1, 8) - torch.arange(8).view(8, 1)).abs().to(q.dtype)
    torch.testing.assert_close(out, exact.attention(q, k, v, bias=-slopes.view(1, -1, 1, 1).to(q.dtype) * distance))


def _packed(lengths: list[int], h: int = 2, d: int = 8) -> tuple[torch.Tensor, ...]:
    total = sum(lengths)
    q, k, v = (t[0] for t in qkv(s=total, hq=h, hkv=h, d=d))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return q, k, v, cu


def test_varlen_validation_errors() -> None:
    q, k, v, cu = _packed([3, 5])
    with fake_primus_turbo() as fake:
        f = fake.module.flex_attention_varlen
        with pytest.raises(ValueError, match="int32"):
            f(q, k, v, cu.long(), cu, 5, 5)
        with pytest.raises(ValueError, match="tokens"):
            f(q, k, v, torch.tensor([0, 3, 7], dtype=torch.int32), cu, 5, 5)
        with pytest.raises(ValueError, match="max_seqlen_q"):
            f(q, k, v, cu, cu, 4, 5)
        with pytest.raises(ValueError, match="not decrease"):
            f(q, k, v, torch.tensor([0, 6, 3, 8], dtype=torch.int32),
              torch.tensor([0, 1, 2, 8], dtype=torch.int32), 6, 6)
        other = torch.tensor([0, 4, 8], dtype=torch.int32)
        with pytest.raises(ValueError, match="identical"):
            f(q, k, v, cu, other, 5, 5, causal=True)
        f(q, k, v, cu, other, 5, 5, causal=False)  # allowed without causal
        with pytest.raises(ValueError, match="softcap"):
            f(q, k, v, cu, cu, 5, 5, softcap=5.0)
        with pytest.raises(ValueError, match="int32"):
            fake.module.flash_attn_varlen_func(q, k, v, cu.long(), cu, 5, 5)


def test_varlen_output_matches_per_document_exact() -> None:
    q, k, v, cu = _packed([3, 5])
    with fake_primus_turbo() as fake:
        out, lse = fake.module.flex_attention_varlen(q, k, v, cu, cu, 5, 5, causal=True, return_lse=True)
        direct = fake.module.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True)
    assert out.shape == q.shape and lse.shape == (2, 8)
    for lo, hi in ((0, 3), (3, 8)):
        n = hi - lo
        want = exact.attention(q[None, lo:hi], k[None, lo:hi], v[None, lo:hi],
                               allowed=torch.ones(n, n, dtype=torch.bool).tril())
        torch.testing.assert_close(out[lo:hi], want[0])
        torch.testing.assert_close(direct[lo:hi], want[0])


def test_sys_modules_restored_also_after_exception() -> None:
    sentinel = types.ModuleType("primus_turbo")
    before = {k: sys.modules[k] for k in list(sys.modules) if k.startswith("primus_turbo")}
    with fake_primus_turbo():
        assert "primus_turbo.pytorch.ops.attention" in sys.modules
    assert {k: v for k, v in sys.modules.items() if k.startswith("primus_turbo")} == before
    sys.modules["primus_turbo"] = sentinel
    try:
        with pytest.raises(RuntimeError, match="boom"):
            with fake_primus_turbo(flex=False):
                import primus_turbo.pytorch.ops as ops

                assert not hasattr(ops, "flex_attention")
                sys.modules["primus_turbo.extra"] = types.ModuleType("primus_turbo.extra")
                raise RuntimeError("boom")
        assert sys.modules["primus_turbo"] is sentinel
        assert "primus_turbo.pytorch" not in sys.modules
        assert "primus_turbo.extra" not in sys.modules
    finally:
        del sys.modules["primus_turbo"]
        sys.modules.update(before)


@pytest.mark.parametrize("build, entries", [
    ("main", {"flash_attn_func", "flash_attn_varlen_func"}),
    ("old", {"flash_attn_func", "flash_attn_varlen_func"}),
    ("flex", {"flex_attention", "flex_attention_varlen", "create_block_mask"}),
    ("newest", {"flex_attention", "flex_attention_bshd", "flex_attention_varlen", "create_block_mask"}),
])
def test_named_builds_have_the_entries_and_parameters_of_the_builds_users_have(build, entries):
    with fake_primus_turbo(build=build) as fake:
        assert entries <= set(fake.signatures)
        varlen = fake.signatures["flash_attn_varlen_func"].parameters
        assert ("sink" in varlen) is (build != "old")
        flexes = {"flex_attention", "flex_attention_bshd", "flex_attention_varlen", "create_block_mask"}
        if build in ("main", "old"):
            assert not flexes & set(fake.signatures)
        if build == "flex":
            assert "deterministic" not in fake.signatures["flex_attention"].parameters
    with pytest.raises(ValueError, match="build"):
        with fake_primus_turbo(build="v9"):
            pass


def test_the_call_log_is_bounded_and_counts_every_call():
    """A long CPU run on the fake keeps only the recent calls (and so their tensors) alive."""
    import gc
    import weakref

    with fake_primus_turbo(arch="gfx942", log_size=8) as fake:
        first = torch.randn(1, 4, 2, 8, dtype=torch.bfloat16)
        alive = weakref.ref(first)
        fake.module.flash_attn_func(first, first, first, causal=True)
        del first
        for _ in range(3000):
            q = torch.randn(1, 4, 2, 8, dtype=torch.bfloat16)
            fake.module.flash_attn_func(q, q, q, causal=True)
        gc.collect()
        assert alive() is None, "the first call's tensors are still held by the log"
        assert len(fake.calls) == 8 and fake.calls.total == 3001
        assert fake.count("flash_attn_func") == 3001 and fake.count("flash_attn_func", "AITER") == 3001
        fake.reset()
        assert fake.calls == [] and fake.count("flash_attn_func") == 0
