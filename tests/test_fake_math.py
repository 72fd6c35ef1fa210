"""The fake Primus-Turbo's own math (`primus_ext.testing._fake_math`) against independent oracles.

The fake must not share numerics with the reference backend (``primus_ext.backends.exact``),
or every "flex through the fake equals the reference" parity test would compare our math
with itself.  So here the blockwise online softmax and its hand-written backward are held
to: the per-cell float64 oracle of ``tests/oracle.py`` (outputs), the vectorised oracle of
``tests/fuzz/oracle.py`` (lse, packed documents), finite differences (``gradcheck``) and a
dense float64 autograd re-implementation written below, which treats the sink as one more
logit column (the module under test starts each row from it instead).
"""

from __future__ import annotations

import ast
import inspect
import math
from typing import Optional

import pytest
import torch

import primus_ext.testing._fake_entries as fake_entries
import primus_ext.testing._fake_math as fm
from primus_ext.attention.pattern import Pattern
from primus_ext.backends import exact
from primus_ext.testing import fake_primus_turbo
from primus_ext.testing.counting import count_copies_and_syncs

from . import oracle
from .fuzz import oracle as fuzz_oracle

F64 = torch.float64
FAULT = fm.SINK_BACKWARD_IGNORES_RIGHT_WINDOW
OUT_TOL = dict(rtol=1e-10, atol=1e-10)   # two float64 implementations, a few roundings apart
GRAD_TOL = dict(rtol=1e-9, atol=1e-9)    # one more reduction over keys


def tensors(*shapes: tuple[int, ...], seed: int = 0, dtype: torch.dtype = F64, grad: bool = True):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen, dtype=dtype).requires_grad_(grad) for s in shapes]


def window_mask(q_len: int, kv_len: int, left: int, right: int, shift: int) -> torch.Tensor:
    """``[Sq, Skv]`` bool, written out cell by cell: query i sits at key i + shift."""
    cells = [(left < 0 or (i + shift) - j <= left) and (right < 0 or j - (i + shift) <= right)
             for i in range(q_len) for j in range(kv_len)]
    return torch.tensor(cells, dtype=torch.bool).view(q_len, kv_len)


def ck_alibi(i: int, j: int, sq: int, skv: int, left: int, right: int, triton: bool = False) -> int:
    """The kernels' ALiBi coefficient of one cell: CK fmha's (ROCm/composable_kernel
    block_position_encoding.hpp), ``VERTICAL`` (+j) for a plain causal mask, else
    ``FROM_BOTTOM_RIGHT``, symmetric; with a sink (``triton``) aiter's Triton kernels'
    ``-|i + Skv - Sq - j|`` whatever the mask."""
    if triton:
        return -abs(i + skv - sq - j)
    if left < 0 and right == 0:
        return j
    return -abs(i + max(skv - sq, 0) - j - max(sq - skv, 0))


def ck_alibi_grid(sq: int, skv: int, left: int, right: int, triton: bool = False) -> torch.Tensor:
    """`ck_alibi` of every cell, ``[Sq, Skv]`` float64, written out cell by cell."""
    cells = [ck_alibi(i, j, sq, skv, left, right, triton) for i in range(sq) for j in range(skv)]
    return torch.tensor(cells, dtype=F64).view(sq, skv)


def dense_reference(q, k, v, allowed, *, scale=None, sink=None, slopes=None, bias=None, window=(-1, -1)):
    """float64 attention by autograd: the sink is an extra logit column whose probability is dropped;
    ALiBi is the kernels' for the mask ``window`` (`ck_alibi`; Triton's with a sink)."""
    batch, q_len, hq, d = q.shape
    kv_len, hkv = k.shape[1], k.shape[2]
    head_of = torch.tensor([h * hkv // hq for h in range(hq)])
    kk, vv = k.index_select(2, head_of), v.index_select(2, head_of)
    s = torch.einsum("bihd,bjhd->bhij", q, kk) * (d ** -0.5 if scale is None else scale)
    if slopes is not None:
        s = s + slopes.view(1, -1, 1, 1) * ck_alibi_grid(q_len, kv_len, *window, triton=sink is not None)
    if bias is not None:
        s = s + bias
    s = s.masked_fill(~allowed, -math.inf)
    if sink is not None:
        s = torch.cat([s, sink.to(F64).view(1, -1, 1, 1).expand(batch, hq, q_len, 1)], dim=-1)
    top = s.amax(-1, keepdim=True).detach() if s.shape[-1] else s.new_full((batch, hq, q_len, 1), -math.inf)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = torch.exp(s - top)
    z = e.sum(-1, keepdim=True)
    p = (e / torch.where(z > 0, z, torch.ones_like(z)))[..., :kv_len]
    return torch.einsum("bhij,bjhd->bihd", p, vv), (torch.log(z) + top).squeeze(-1)


def grads(out: torch.Tensor, leaves, seed: int = 7):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    live = [t for t in leaves if t is not None]
    return torch.autograd.grad(out, live, g)


# (name, Sq, Skv, Hq, Hkv, (left, right), sink, alibi, bias, scale)
DENSE = [
    ("causal", 9, 9, 4, 2, (-1, 0), False, False, False, None),
    ("window", 9, 9, 2, 2, (2, 1), False, False, False, None),
    ("sink-right-window", 10, 10, 4, 2, (1, 3), True, False, False, None),
    ("full-all-extras", 7, 7, 2, 1, (-1, -1), True, True, True, 0.3),
    ("sq<skv-bottom-right", 5, 11, 2, 2, (-1, 0), True, True, False, None),
    ("sq>skv-empty-rows", 9, 4, 2, 2, (-1, 0), False, False, True, None),
    ("sq>skv-empty-rows-sink", 9, 4, 2, 1, (1, 0), True, False, False, None),
    ("mqa-window-alibi", 12, 12, 4, 1, (3, 0), False, True, False, None),
]


def dense_case(case, seed=0):
    _, sq, skv, hq, hkv, (left, right), with_sink, with_alibi, with_bias, scale = case
    q, k, v = tensors((2, sq, hq, 8), (2, skv, hkv, 8), (2, skv, hkv, 8), seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    sink = torch.randn(hq, generator=gen, dtype=F64).requires_grad_(True) if with_sink else None
    slopes = torch.rand(hq, generator=gen, dtype=F64) if with_alibi else None
    bias = torch.randn(sq, skv, generator=gen, dtype=F64).requires_grad_(True) if with_bias else None
    return q, k, v, Pattern(left, right), dict(sink=sink, alibi_slopes=slopes, bias=bias, scale=scale)


@pytest.mark.parametrize("case", DENSE, ids=[c[0] for c in DENSE])
def test_dense_forward_matches_the_per_cell_oracle(case):
    q, k, v, window, kw = dense_case(case)
    sq, skv = q.shape[1], k.shape[1]
    out, lse = fm.attention(q, k, v, window=window, return_lse=True, block=4, **kw)
    shift = skv - sq
    inner = oracle.window(window.left, window.right)
    bias, slopes = kw["bias"], kw["alibi_slopes"]

    def extras(s, b, h, i, j):
        s = s + (bias.detach()[i, j] if bias is not None else 0.0)
        if slopes is not None:
            s = s + float(slopes[h]) * ck_alibi(int(i), int(j), sq, skv, window.left, window.right,
                                                 kw["sink"] is not None)
        return s

    want = oracle.attention(
        q, k, v, lambda b, h, i, j: inner(b, h, i + shift, j), scale=kw["scale"],
        sink=None if kw["sink"] is None else kw["sink"].tolist(),
        score_mod=extras if bias is not None or slopes is not None else None)
    torch.testing.assert_close(out, want, **OUT_TOL)
    mask = fuzz_oracle.flash_mask(sq, skv, causal=False, window=window.window, align="bottom_right")
    ck = None if slopes is None else slopes.view(1, -1, 1, 1) * ck_alibi_grid(sq, skv, window.left, window.right,
                                                                              triton=kw["sink"] is not None)
    total = None if bias is None and ck is None else (bias if ck is None else ck if bias is None else bias + ck)
    _, want_lse = fuzz_oracle.attention(q, k, v, mask, scale=kw["scale"], sink=kw["sink"], bias=total)
    assert lse.dtype == torch.float32 and lse.shape == (2, q.shape[2], sq)
    torch.testing.assert_close(lse, want_lse.float())  # fp32 lse of float64 math


@pytest.mark.parametrize("block", [1, 3, 16, 64])
@pytest.mark.parametrize("case", DENSE, ids=[c[0] for c in DENSE])
def test_dense_gradients_match_float64_autograd(case, block):
    q, k, v, window, kw = dense_case(case, seed=3)
    out = fm.attention(q, k, v, window=window, block=block, **kw)
    allowed = window_mask(q.shape[1], k.shape[1], window.left, window.right, k.shape[1] - q.shape[1])
    want, _ = dense_reference(q, k, v, allowed, scale=kw["scale"], sink=kw["sink"],
                              slopes=kw["alibi_slopes"], bias=kw["bias"], window=window.window)
    torch.testing.assert_close(out, want, **OUT_TOL)
    leaves = (q, k, v, kw["sink"], kw["bias"])
    for got, expected in zip(grads(out, leaves), grads(want, leaves)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, **GRAD_TOL)


def test_gradcheck_of_the_hand_written_backward():
    """Finite differences for every input the kernels differentiate at once: q, k, v, sink, bias
    (with ALiBi slopes in the scores, as constants)."""
    q, k, v = tensors((1, 4, 2, 4), (1, 6, 1, 4), (1, 6, 1, 4), seed=5)
    sink, slopes, bias = tensors((2,), (2,), (4, 6), seed=6)
    for window in (Pattern(1, 2), Pattern(-1, 0), Pattern(-1, -1)):
        def f(q, k, v, sink, bias, window=window):
            return fm.attention(q, k, v, window=window, sink=sink, alibi_slopes=slopes.detach(), bias=bias, block=2)
        assert torch.autograd.gradcheck(f, (q, k, v, sink, bias))


def test_alibi_slopes_get_no_gradient_as_on_aiter():
    """AITER's backward returns no ALiBi gradient (flash_attn_interface.py l.58-60 at a6a16cd): neither does the fake."""
    q, k, v = tensors((1, 4, 2, 4), (1, 6, 1, 4), (1, 6, 1, 4), seed=5)
    (slopes,) = tensors((2,), seed=6)
    out = fm.attention(q, k, v, window=Pattern(-1, 0), alibi_slopes=slopes, block=2)
    (grad,) = torch.autograd.grad(out.sum(), [slopes], allow_unused=True)
    assert grad is None


# (name, q lengths, kv lengths, (left, right), sink, alibi)
PACKED = [
    ("causal-docs", [3, 5, 4], [3, 5, 4], (-1, 0), False, False),
    ("window-docs-sink-alibi", [4, 6], [4, 6], (2, 0), True, True),
    ("right-window", [5, 4], [5, 4], (1, 2), True, False),
    ("different-bounds", [2, 4, 3], [5, 4, 1], (-1, 0), True, True),
    ("empty-docs", [3, 0, 2, 4], [2, 3, 0, 4], (-1, 0), False, True),
    ("full-gqa", [4, 3], [2, 5], (-1, -1), True, False),
]


def packed_case(case, seed=0):
    _, len_q, len_k, (left, right), with_sink, with_alibi = case
    bq = [0] + torch.tensor(len_q).cumsum(0).tolist()
    bk = [0] + torch.tensor(len_k).cumsum(0).tolist()
    q, k, v = tensors((bq[-1], 4, 8), (bk[-1], 2, 8), (bk[-1], 2, 8), seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    sink = torch.randn(4, generator=gen, dtype=F64).requires_grad_(True) if with_sink else None
    slopes = torch.rand(4, generator=gen, dtype=F64) if with_alibi else None
    return q, k, v, bq, bk, Pattern(left, right), dict(sink=sink, alibi_slopes=slopes)


@pytest.mark.parametrize("case", PACKED, ids=[c[0] for c in PACKED])
def test_packed_documents_match_the_oracles(case):
    q, k, v, bq, bk, window, kw = packed_case(case)
    out, lse = fm.varlen_attention(q, k, v, bq, bk, window=window, return_lse=True, block=3, **kw)
    assert out.shape == (bq[-1], 4, 8) and lse.shape == (4, bq[-1]) and lse.dtype == torch.float32
    if kw["alibi_slopes"] is None:  # CK's ALiBi positions are each document's own: checked per piece below
        mask = fuzz_oracle.packed_mask(bq, bk, causal=False, window=window.window, align="bottom_right")
        want, want_lse = fuzz_oracle.packed_attention(q, k, v, mask, sink=kw["sink"])
        torch.testing.assert_close(out, want, **OUT_TOL)
        torch.testing.assert_close(lse, want_lse.float())  # fp32 lse of float64 math
    if bq == bk and kw["alibi_slopes"] is None:  # the per-cell oracle attends each document alone
        sink = None if kw["sink"] is None else kw["sink"].tolist()
        torch.testing.assert_close(
            out, oracle.packed_attention(q, k, v, bq, window.left, window.right, sink=sink), **OUT_TOL)
    # gradients: each document pair on its own, in the dense float64 reference
    pieces, piece_lses = [], []
    for q0, q1, k0, k1 in zip(bq, bq[1:], bk, bk[1:]):
        allowed = window_mask(q1 - q0, k1 - k0, window.left, window.right, (k1 - k0) - (q1 - q0))
        piece, piece_lse = dense_reference(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], allowed, sink=kw["sink"],
                                           slopes=kw["alibi_slopes"], window=window.window)
        pieces.append(piece[0])
        piece_lses.append(piece_lse[0])
    ref = torch.cat(pieces)
    torch.testing.assert_close(out, ref, **OUT_TOL)
    ref_lse = torch.cat(piece_lses, dim=1)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite].float())
    leaves = (q, k, v, kw["sink"])
    for got, expected in zip(grads(out, leaves), grads(ref, leaves)):
        torch.testing.assert_close(got, expected, **GRAD_TOL)


def test_rows_with_nothing_allowed_are_zero_with_finite_gradients():
    q, k, v = tensors((1, 6, 2, 4), (1, 3, 2, 4), (1, 3, 2, 4))
    sink = torch.zeros(2, dtype=F64, requires_grad=True)
    out, lse = fm.attention(q, k, v, window=Pattern(-1, 0), return_lse=True)
    assert (out[:, :3] == 0).all() and torch.isneginf(lse[..., :3]).all() and torch.isfinite(lse[..., 3:]).all()
    out_s, lse_s = fm.attention(q, k, v, window=Pattern(-1, 0), sink=sink, return_lse=True)
    assert (out_s[:, :3] == 0).all() and (lse_s[..., :3] == 0).all()
    for g in grads(out, (q, k, v)) + grads(out_s, (q, k, v, sink)):
        assert torch.isfinite(g).all()


def test_outward_layout_dtypes_and_precision():
    q, k, v = (t.detach().bfloat16() for t in tensors((2, 8, 4, 8), (2, 8, 2, 8), (2, 8, 2, 8)))
    out, lse = fm.attention(q, k, v, window=Pattern(-1, 0), return_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert out.transpose(1, 2).is_contiguous(), "bshd view of a bhsd-dense output, as the fake returns it"
    want, _ = dense_reference(*(t.double() for t in (q, k, v)), window_mask(8, 8, -1, 0, 0))
    torch.testing.assert_close(out.double(), want, rtol=1e-2, atol=1e-2)
    packed = fm.varlen_attention(q[0], k[0], v[0], [0, 3, 8], [0, 3, 8], window=Pattern(-1, 0))
    assert packed.shape == (8, 4, 8) and packed.transpose(0, 1).is_contiguous()
    q32, k32, v32 = tensors((1, 8, 4, 8), (1, 8, 2, 8), (1, 8, 2, 8), dtype=torch.float32)
    out32 = fm.attention(q32, k32, v32, window=Pattern(2, 0), sink=torch.zeros(4))
    assert all(g.dtype == torch.float32 for g in grads(out32, (q32, k32, v32)))


def test_the_math_reads_nothing_on_the_host():
    """No host sync (its copies, e.g. inside batched matmuls, are the kernel's own business)."""
    q, k, v = tensors((1, 16, 4, 8), (1, 16, 2, 8), (1, 16, 2, 8), dtype=torch.float32, grad=False)
    with count_copies_and_syncs() as counts:
        fm.attention(q, k, v, window=Pattern(3, 0), sink=torch.zeros(4), alibi_slopes=torch.ones(4))
        fm.varlen_attention(q[0], k[0], v[0], [0, 5, 16], [0, 5, 16], window=Pattern(-1, 0))
    assert counts.syncs == 0, counts.summary()


def test_dropout_takes_the_torch_dropout_path():
    q, k, v = tensors((1, 8, 2, 8), (1, 8, 2, 8), (1, 8, 2, 8))
    torch.manual_seed(0)
    a = fm.attention(q, k, v, window=Pattern(-1, 0), dropout_p=0.5)
    torch.manual_seed(0)
    b = fm.attention(q, k, v, window=Pattern(-1, 0), dropout_p=0.5)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert (a - fm.attention(q, k, v, window=Pattern(-1, 0))).abs().max() > 1e-3
    assert all(torch.isfinite(g).all() for g in grads(a, (q, k, v)))


# -- independence from the reference backend's math ---------------------------------------
def test_the_fake_math_shares_no_code_with_exact():
    tree = ast.parse(inspect.getsource(fm))
    modules = [("." * n.level) + (n.module or "") for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in modules if "backends" in m or "exact" in m], modules
    for module in (fm, fake_entries):
        assert "exact" not in vars(module)
        owners = {getattr(value, "__module__", None) for value in vars(module).values()}
        assert not [o for o in owners if o and o.startswith("primus_ext.backends")], owners


def test_the_fake_entries_never_call_exact(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the fake must not compute with primus_ext.backends.exact")

    for name in exact.__all__:
        monkeypatch.setattr(exact, name, refuse)
    q, k, v = tensors((1, 8, 2, 8), (1, 8, 2, 8), (1, 8, 2, 8))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with fake_primus_turbo() as fake:
        ops = fake.module
        ops.flash_attn_func(q, k, v, causal=True, sink=torch.zeros(2), return_lse=True)
        ops.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 5, 5, causal=True)
        ops.flex_attention_varlen(q[0], k[0], v[0], cu, cu, 5, 5, causal=True)
        bm = ops.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 8, 8)
        ops.flex_attention_bshd(q, k, v, block_mask=bm).sum().backward()


# -- the opt-in fault ------------------------------------------------------------------------
def _sink_grads(faults, window, sink_on=True, seed=11):
    q, k, v = tensors((1, 10, 2, 8), (1, 10, 2, 8), (1, 10, 2, 8), seed=seed)
    sink = torch.randn(2, generator=torch.Generator().manual_seed(seed)).requires_grad_(True) if sink_on else None
    out = fm.attention(q, k, v, window=window, sink=sink, faults=faults, block=4)
    return out.detach(), grads(out, (q, k, v, sink)), (q, k, v, sink)


@pytest.mark.parametrize("window, sink_on, broken", [
    (Pattern(2, 3), True, True), (Pattern(-1, 1), True, True),
    (Pattern(2, 0), True, False), (Pattern(-1, -1), True, False), (Pattern(2, 3), False, False),
], ids=["sink+window(2,3)", "sink+window(-1,1)", "sink+causal-window", "sink+full", "no-sink+window(2,3)"])
def test_fault_changes_gradients_only_for_a_sink_with_a_right_bound(window, sink_on, broken):
    """dQ, dK, dV go wrong; dSink = -sum(exp(sink - lse) * rowsum(dO * out)) needs only the
    forward's out and lse, which stay right, so it stays right too."""
    out, good, _ = _sink_grads((), window, sink_on)
    out_f, bad, _ = _sink_grads((FAULT,), window, sink_on)
    torch.testing.assert_close(out_f, out, rtol=0, atol=0)  # the forward stays right
    differs = [not torch.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(bad, good)]
    assert differs[:3] == [broken] * 3 and not any(differs[3:]), differs


def test_fault_gradients_are_those_of_an_unbounded_right_edge():
    """dV under the fault is P^T dO with P = exp(S - lse) over the window (left, -1), lse the true one."""
    window = Pattern(2, 3)
    _, bad, (q, k, v, sink) = _sink_grads((FAULT,), window)
    _, lse = dense_reference(q, k, v, window_mask(10, 10, 2, 3, 0), sink=sink)
    wide = window_mask(10, 10, 2, -1, 0)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * 8 ** -0.5
    p = torch.exp(s.masked_fill(~wide, -math.inf) - lse.unsqueeze(-1))
    d_out = torch.randn((1, 10, 2, 8), generator=torch.Generator().manual_seed(7), dtype=F64)
    torch.testing.assert_close(bad[2], torch.einsum("bhij,bihd->bjhd", p, d_out), **GRAD_TOL)


def test_fault_knob_reaches_every_sink_entry_and_is_off_by_default():
    q, k, v = tensors((1, 8, 2, 8), (1, 8, 2, 8), (1, 8, 2, 8), seed=2)
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)  # equal documents: the flex layer's sink needs them

    def run(faults: Optional[tuple], entry: str):
        sink = torch.zeros(2, requires_grad=True)
        kw = {} if faults is None else dict(faults=faults)
        with fake_primus_turbo(**kw) as fake:
            ops = fake.module
            if entry == "dense":
                out = ops.flash_attn_func(q, k, v, window_size=(2, 3), sink=sink)
            else:
                out = getattr(ops, entry)(q[0], k[0], v[0], cu, cu, 4, 4, window_size=(1, 2), sink=sink)
        return grads(out, (q, k, v, sink))

    for entry in ("dense", "flash_attn_varlen_func", "flex_attention_varlen"):
        default, off, on = run(None, entry), run((), entry), run((FAULT,), entry)
        assert all(torch.equal(a, b) for a, b in zip(default, off)), entry
        assert not any(torch.allclose(a, b) for a, b in zip(on[:3], off[:3])), entry  # q, k, v
    with pytest.raises(ValueError, match="unknown"):
        with fake_primus_turbo(faults=("no_such_fault",)):
            pass
