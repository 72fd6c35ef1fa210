"""The self-test of a shared-prefix layer (B37): one tree row through the layer's merge, against exact math.

A layer planned with ``packed_shared_prefix`` runs a row as its packed call and its cross call merged through
their LSEs, on kernel pairs its plain packed route never reaches (the cross call is non-causal, with unequal
query and key segments).  So besides its packed routes (`primus_ext.call.selftest`) it runs one row of two
trees and a document, with an empty and a one-token response, forward and backward, on the device and in the
model's dtype, through the layer's own adapter; the reference is the tree mask written out as a dense boolean
mask, computed in float32 by torch's own attention (no code of the merge or the kernels).  The flex backend,
which runs the tree mask as one call, is tested the same way (forward only on the CPU, which has no flex
backward).
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.nn.functional as F

from ..backends.shared_prefix import SharedPrefixLayout
from ..plan.plan import AttentionPlan
from . import selftest_flex as flex_test
from .adapter import TurboFlexAttention
from .selftest_result import TOLERANCE, RouteResult
from .shared_prefix import shared_prefix_attention

ROW = [(12, [6, 0, 1]), 5, (7, [9, 4])]
"""Two trees (one with an empty and a one-token response) and a document between them."""


def _tree_mask(layout: SharedPrefixLayout) -> torch.Tensor:
    """``[T, T]`` bool, from each token's tree and part (0: document or prompt; i: the i-th response).  Written
    here, not `tree_mod` evaluated densely: the flex backend runs `tree_mod`, and its self-test must not compare
    that mask with itself."""
    group, part = layout.group, layout.part
    at = torch.arange(layout.total, device=group.device)
    same = group[:, None] == group[None, :]
    own = (part[:, None] == part[None, :]) & (at[:, None] >= at[None, :])
    prompt = (part[None, :] == 0) & (part[:, None] > 0)
    return same & (own | prompt)


def _exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: Optional[torch.Tensor],
           layout: SharedPrefixLayout, scale: Optional[float]) -> torch.Tensor:
    """Dense attention on the tree mask in float32, the sink as one more key of value 0."""
    heads = q.shape[1]
    q, k, v = (t.float().transpose(0, 1) for t in (q, k, v))  # [H, T, D]
    k, v = (t.repeat_interleave(heads // t.shape[0], dim=0) for t in (k, v))
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    scores = (q @ k.transpose(1, 2)) * scale
    scores = scores.masked_fill(~_tree_mask(layout), float("-inf"))
    if sink is not None:
        scores = torch.cat([scores, sink.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)], dim=-1)
        v = torch.cat([v, v.new_zeros(v.shape[0], 1, v.shape[-1])], dim=1)
    weights = torch.nan_to_num(F.softmax(scores, dim=-1))
    return (weights @ v).transpose(0, 1)


def shared_prefix_route(plan: AttentionPlan, device: torch.device, dtype: torch.dtype) -> Optional[RouteResult]:
    """The row of `ROW` on ``plan``'s layer against `_exact`; None for a plan without shared-prefix rows."""
    if not (plan.shared_prefix and plan.flex):
        return None
    route, kernels = f"shared-prefix row {ROW}, {dtype}, heads {plan.num_heads}/{plan.num_kv_heads}", \
        "; ".join(plan.kernels) or "-"
    backward = not (flex_test.on_flex(plan) and device.type == "cpu")
    start = time.perf_counter()
    layout = SharedPrefixLayout.of(ROW, device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype).requires_grad_(backward)  # noqa: E731
    q = rand(layout.total, plan.num_heads, plan.head_dim)
    k, v = rand(layout.total, plan.num_kv_heads, plan.head_dim), rand(layout.total, plan.num_kv_heads, plan.head_dim_v)
    sink = torch.randn(plan.num_heads, generator=gen).to(device).requires_grad_(backward) if plan.sink else None
    leaves = [t for t in (q, k, v, sink) if t is not None]
    try:
        with torch.set_grad_enabled(backward):
            out = shared_prefix_attention(TurboFlexAttention(plan), q, k, v, layout, sink=sink)
            want = _exact(q, k, v, sink, layout, plan.scale)
            scale = want.abs().max().clamp_min(1e-6)
            fwd = ((out.float() - want).abs().max() / scale).item()
            bwd = float("nan")
            if backward:
                grad = torch.randn(out.shape, generator=gen).to(device, dtype)
                got = torch.autograd.grad(out, leaves, grad)
                wants = torch.autograd.grad(want, leaves, grad.float())
                bwd = max(((g.float() - w).abs().max() / w.abs().max().clamp_min(1e-6)).item()
                          for g, w in zip(got, wants))
    except Exception as exc:  # noqa: BLE001 - whatever the kernels raise is the finding
        return RouteResult(route, kernels, float("nan"), float("nan"), 1e3 * (time.perf_counter() - start),
                           f"{type(exc).__name__}: {exc}")
    tol = TOLERANCE.get(dtype, 1e-3)
    bad = [name for name, err in (("forward", fwd), ("backward", bwd)) if (name == "forward" or backward)
           and not err <= tol]
    return RouteResult(route, kernels, fwd, bwd, 1e3 * (time.perf_counter() - start),
                       f"{' and '.join(bad)} differ from exact math by more than {tol:g}" if bad else "",
                       unchecked="" if backward else flex_test.FORWARD_ONLY)


__all__ = ["ROW", "shared_prefix_route"]
