"""The turbo route in bf16 on each arch, forward and backward, against the float64 oracle.

Real Primus-Turbo takes bf16/fp16 only, and picks FlyDSL, AITER or HipKittens per call
(docs/capabilities.md, B33).  Here every layer shape of the table is planned for
``turbo_arch`` gfx942 and gfx950 and then run through the adapter on the fake with that
arch, in bf16, with Megatron's sbhd storage: a layer the plan approves must run on the
kernel backend the fake picks and match the oracle; one the fake would refuse or compute
wrongly must have been refused by the plan (B33).

Tolerances (``tests/fuzz/oracle.py``): the oracle gets the bf16 inputs exactly (as
float64), so the only error is the kernel's float32 arithmetic and its one rounding of
the output to bf16, 8 significant bits, i.e. relative 2**-8 ~ 4e-3 of |out| <~ 3
(OUTPUT_TOL 2e-2 is that with margin).  Gradients take one more bf16 rounding and a sum
over up to S keys, so GRAD_TOL is wider (6e-2 absolute, 3e-2 relative).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from primus_ext.call.adapter import TurboFlexAttention
from primus_ext.errors import UnsupportedConfigError
from primus_ext.plan import build_plan
from primus_ext.testing import fake_primus_turbo

from .fuzz import oracle
from .helpers import facts, settings

BF16 = torch.bfloat16
S, B, D = 128, 2, 64
MASKS = "primus_ext.attention.masks:"
EQUAL, UNEQUAL = [0, 64, 128], [0, 40, 128]
GROUPS = {"group8": (8, 1), "group2": (4, 2)}

CASES: dict[str, dict[str, Any]] = {
    # name: settings keys, layer facts, and how the call is made
    "causal": dict(keys={}, call=dict(causal=True)),
    "window64": dict(keys={"sink_sliding_window": 64}, call=dict(causal=True, window_size=(64, 0))),
    "window8": dict(keys={"sink_sliding_window": 8}, call=dict(causal=True, window_size=(8, 0))),
    "band-hook": dict(keys={"turbo_flex_attention_mask_mod": MASKS + "sliding_window",
                            "turbo_flex_attention_mask_mod_kwargs": {"left": 4, "right": 4}}, call={}),
    "chunk-hook": dict(keys={"turbo_flex_attention_mask_mod": MASKS + "chunked",
                             "turbo_flex_attention_mask_mod_kwargs": {"chunk_size": 64}}, call={}),
    "sink": dict(keys={"use_sink_attention": True}, call=dict(causal=True)),
    "sink-band-hook": dict(keys={"use_sink_attention": True, "turbo_flex_attention_mask_mod": MASKS + "sliding_window",
                                 "turbo_flex_attention_mask_mod_kwargs": {"left": 4, "right": 4}}, call={}),
    "packed-equal": dict(keys={}, packed=EQUAL, call=dict(causal=True)),
    "packed-unequal": dict(keys={}, packed=UNEQUAL, call=dict(causal=True)),
    "packed-sink": dict(keys={"use_sink_attention": True}, packed=EQUAL, call=dict(causal=True)),
}
ROWS = list(itertools.product(("gfx942", "gfx950"), sorted(CASES), sorted(GROUPS)))


def _leaf(*shape: int, seed: int, dtype=BF16) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _inputs(hq: int, hkv: int, packed: bool, arch: str):
    """sbhd memory seen as bshd (Megatron's layout), bf16 leaves with gradients; copied to contiguous
    bshd on gfx942, as the modules do there (`kernel_views`)."""
    batch = 1 if packed else B
    leaves = [_leaf(S, batch, h, D, seed=i).requires_grad_(True) for i, h in enumerate((hq, hkv, hkv))]
    views = [t.transpose(0, 1).contiguous() if arch == "gfx942" else t.transpose(0, 1) for t in leaves]
    return leaves, (views if not packed else [t[0] for t in views])


def _allowed(case: dict[str, Any], plan) -> torch.Tensor:
    """The case's mask as a [Sq, Skv] boolean matrix, written from the case, not from the plan."""
    i = torch.arange(S).view(-1, 1)
    j = torch.arange(S).view(1, -1)
    keys, call = case["keys"], case["call"]
    if "turbo_flex_attention_mask_mod" in keys:
        kw = keys["turbo_flex_attention_mask_mod_kwargs"]
        if "chunk_size" in kw:
            return (i // kw["chunk_size"] == j // kw["chunk_size"]) & (j <= i)
        return (i - j <= kw["left"]) & (j - i <= kw["right"])
    left = call.get("window_size", (-1, 0))[0]
    allowed = (j <= i) & ((i - j <= left) if left >= 0 else torch.ones_like(j <= i))
    if "packed" in case:
        doc = oracle.document_of(case["packed"], S)
        allowed = allowed & (doc.view(-1, 1) == doc.view(1, -1))
    return allowed


@pytest.mark.parametrize("arch, name, group", ROWS, ids=["-".join(r) for r in ROWS])
def test_turbo_route_in_bf16_runs_exactly_or_was_refused(arch, name, group):
    case, (hq, hkv) = CASES[name], GROUPS[group]
    packed = "packed" in case
    layer = facts(num_heads=hq, num_kv_heads=hkv, head_dim=D, seq_length=S, dtype="bf16", packed=packed)
    with fake_primus_turbo(arch=arch) as fake:
        try:
            plan = build_plan(settings(turbo_flex_attention_backend="turbo", turbo_arch=arch, **case["keys"]), layer)
        except UnsupportedConfigError as refusal:
            assert refusal.codes == ("B33",), refusal
            _assert_the_fake_would_fail_or_be_wrong(arch, case, hq, hkv)
            return
        leaves, (q, k, v) = _inputs(hq, hkv, packed, arch)
        sink = _leaf(hq, seed=7, dtype=torch.float32).requires_grad_(True) if plan.sink else None
        call: dict[str, Any] = dict(case["call"], sink=sink)
        if packed:
            cu = torch.tensor(case["packed"], dtype=torch.int32)
            longest = max(b - a for a, b in zip(case["packed"], case["packed"][1:]))
            call.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)
        layer = TurboFlexAttention(plan)
        out = (layer.varlen if packed else layer)(q, k, v, **call)
        assert out.dtype == BF16 and fake.calls[-1].backend is not None
        grad = _leaf(*out.shape, seed=11)
        got = torch.autograd.grad(out, leaves + ([sink] if sink is not None else []), grad)

    exact = [t.detach().double().requires_grad_(True) for t in leaves]
    eq, ek, ev = (t.transpose(0, 1) for t in exact)
    sink64 = sink.detach().double().requires_grad_(True) if sink is not None else None
    want, _ = oracle.attention(eq, ek, ev, _allowed(case, plan), sink=sink64)
    want = want[0] if packed else want
    problem = oracle.mismatch(out, want, oracle.OUTPUT_TOL[BF16])
    assert problem is None, problem
    wants = torch.autograd.grad(want, exact + ([sink64] if sink64 is not None else []), grad.double())
    for what, g, w in zip(("dq", "dk", "dv", "dsink"), got, wants):
        problem = oracle.mismatch(g, w, oracle.GRAD_TOL[BF16])
        assert problem is None, f"{what}: {problem}"


def _assert_the_fake_would_fail_or_be_wrong(arch, case, hq, hkv) -> None:
    """A B33 refusal stands for a call real Primus-Turbo refuses or computes wrongly (the fake does too).

    Packed calls are planned without knowing whether documents will be equal in length, so
    they are tried with unequal documents, the case the plan answers for.  A dense call the
    fake runs must then be wrong: its gradients must miss the oracle.
    """
    import primus_turbo.pytorch.ops as ops

    packed = "packed" in case
    leaves, (q, k, v) = _inputs(hq, hkv, packed, arch)
    keys, call = case["keys"], dict(case["call"])
    if "turbo_flex_attention_mask_mod" in keys:
        kw = keys["turbo_flex_attention_mask_mod_kwargs"]
        call = dict(causal=False, window_size=(kw["left"], kw["right"]))
    sink = torch.zeros(hq) if keys.get("use_sink_attention") else None
    try:
        if packed:
            cu = torch.tensor(UNEQUAL, dtype=torch.int32)
            ops.flash_attn_varlen_func(q, k, v, cu, cu, 88, 88, sink=sink, **call)
            raise AssertionError(f"refused on {arch}, but the fake runs the packed call")
        out = ops.flash_attn_func(q, k, v, sink=sink, **call)
    except (ValueError, AssertionError) as err:
        assert "fake runs" not in str(err), err
        return
    exact = [t.detach().double().requires_grad_(True) for t in leaves]
    eq, ek, ev = (t.transpose(0, 1) for t in exact)
    i, j = torch.arange(S).view(-1, 1), torch.arange(S).view(1, -1)
    left, right = call.get("window_size", (-1, -1))
    allowed = ((i - j <= left) | (left < 0)) & ((j - i <= right) | (right < 0)) & ((j <= i) | (not call.get("causal")))
    want, _ = oracle.attention(eq, ek, ev, allowed, sink=sink.double() if sink is not None else None)
    grad = _leaf(*out.shape, seed=11)
    got = torch.autograd.grad(out, leaves, grad)
    wants = torch.autograd.grad(want, exact, grad.double())
    assert any(oracle.mismatch(g, w, oracle.GRAD_TOL[BF16]) for g, w in zip(got, wants)), \
        f"refused on {arch} although the fake computes it exactly"
