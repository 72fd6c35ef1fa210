"""Shared-prefix rows on varlen kernels: one prompt, many responses, the prompt computed once.

A row packs documents and *trees*: a tree is a prompt followed by its responses.  Its mask:
a prompt is causal in itself, a response token sees the whole prompt and its own response
causally, never another response, and nothing crosses a document or a tree.  That mask is
the union of two masks that fixed kernels take exactly:

* the *self* call: every prompt, response and document as a causal varlen document;
* the *cross* call: per tree, every response token (as one query segment) against the whole
  prompt (one key segment), non-causal.

Each response query's softmax runs over both key sets, which do not meet, so the two partial
results merge exactly through their log-sum-exps (`merge_partials`).  The backward of the
merge is each kernel's own backward given the merged output and the merged LSE, as ring
attention does: with the global LSE a kernel's backward rebuilds the global probabilities of
its keys, and ``rowsum(dout * out)`` of the merged output is the softmax's own term.  So
nothing of the forward is recomputed, and a sink, given to the self call only, enters each
softmax once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch
from torch import Tensor

from .. import refusals as R
from ..errors import short_repr
from .base import CallArgs, KernelPair
from .check_op import tensor_version

Item = Union[int, tuple]
"""A document (its token count) or a tree (``(prompt, [response, ...])``, token counts)."""


@dataclass(frozen=True)
class SharedPrefixLayout:
    """Where the segments of one packed shared-prefix row lie (made by `SharedPrefixLayout.of`).

    Boundaries are int32 on the row's device; the cross call's tokens are gathered by index (int64)."""

    total: int
    segments: Tensor
    """``cu_seqlens`` of the self call: every non-empty prompt, response and document."""
    max_segment: int
    cross_q: Tensor
    """The response tokens of every tree that has a prompt, tree by tree."""
    cross_kv: Tensor
    """The prompt tokens of those trees."""
    cu_cross_q: Tensor
    cu_cross_kv: Tensor
    max_cross_q: int
    max_cross_kv: int
    items: tuple = ()
    """The row as given: documents and ``(prompt, (responses...))`` trees, in order (() where rebuilt from
    tensors inside a compiled op, which reads none of it)."""
    group: Optional[Tensor] = None
    """int64 ``[T]``: the document or tree each token belongs to, numbered along the row."""
    part: Optional[Tensor] = None
    """int64 ``[T]``: 0 in a document or a prompt, ``i`` in a tree's ``i``-th response (the tree mask of `tree_mod`)."""
    longest_position: int = 0
    """One more than the largest of ``positions`` (the rotary table a row needs), known without a host read."""
    positions: Optional[Tensor] = None
    """int64 ``[T]``: each token's position in the duplicated layout (0.. in a document or prompt, continuing
    from its prompt in a response): what position embeddings must see."""

    @property
    def has_cross(self) -> bool:
        """Whether any response sees a prompt (else the row is ordinary documents)."""
        return self.cross_q.numel() > 0

    @staticmethod
    def of(items: Sequence[Item], device: Any = "cpu") -> "SharedPrefixLayout":
        """The layout of a row of ``items`` (see `Item`); malformed items are refused with our error."""
        row = _items(items)
        starts, cross_q, cross_kv, cu_q, cu_kv, positions, group, part = [0], [], [], [0], [0], [], [], []
        at = 0
        for number, item in enumerate(row):
            if isinstance(item, int):
                lengths = (item,)
                positions.extend(range(item))
            else:
                prompt, responses = item
                lengths = (prompt, *responses)
                positions.extend(range(prompt))
                for length in responses:
                    positions.extend(range(prompt, prompt + length))
                answered = sum(responses)
                if prompt > 0 and answered > 0:
                    cross_kv.extend(range(at, at + prompt))
                    cross_q.extend(range(at + prompt, at + prompt + answered))
                    cu_q.append(cu_q[-1] + answered)
                    cu_kv.append(cu_kv[-1] + prompt)
            for index, length in enumerate(lengths):
                group.extend([number] * length)
                part.extend([index] * length)
                at += length
                if length:
                    starts.append(at)
        cu_q_t = torch.tensor(cu_q, dtype=torch.int32, device=device)
        cu_kv_t = torch.tensor(cu_kv, dtype=torch.int32, device=device)
        # a row of no tokens is one empty segment ([0, 0]): boundaries always hold 0 and the token count
        segments = torch.tensor(starts if len(starts) > 1 else [0, 0], dtype=torch.int32, device=device)
        return SharedPrefixLayout(
            items=row, total=at, segments=segments, max_segment=_longest(starts),
            cross_q=torch.tensor(cross_q, dtype=torch.int64, device=device),
            cross_kv=torch.tensor(cross_kv, dtype=torch.int64, device=device), cu_cross_q=cu_q_t,
            cu_cross_kv=cu_kv_t, max_cross_q=_longest(cu_q), max_cross_kv=_longest(cu_kv),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            group=torch.tensor(group, dtype=torch.int64, device=device),
            part=torch.tensor(part, dtype=torch.int64, device=device),
            longest_position=max(positions, default=-1) + 1)


def _longest(bounds: Sequence[int]) -> int:
    return max((b - a for a, b in zip(bounds, bounds[1:])), default=0)


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _items(items: Any) -> tuple:
    """``items`` as a tuple of ints and ``(prompt, (responses...))``, or our refusal naming what is wrong."""
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise R.refuse(R.PREFIX_LAYOUT, got=short_repr(items))
    row = []
    for item in items:
        if _count(item):
            row.append(item)
            continue
        if (isinstance(item, (tuple, list)) and len(item) == 2 and _count(item[0])
                and isinstance(item[1], (tuple, list)) and all(_count(r) for r in item[1])):
            row.append((item[0], tuple(item[1])))
            continue
        raise R.refuse(R.PREFIX_LAYOUT, got=f"the item {short_repr(item)}")
    return tuple(row)


def tree_mod(group: Tensor, part: Tensor) -> Any:
    """The tree mask of a row as a FlexAttention ``mask_mod``: within one document or tree, a token sees its own
    part causally (a document, a prompt, one response) and a response token sees the whole prompt (part 0)."""

    def shared_prefix(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        same_tree = group[q_idx] == group[kv_idx]
        own = (part[q_idx] == part[kv_idx]) & (q_idx >= kv_idx)
        prompt = (part[kv_idx] == 0) & (part[q_idx] > 0)
        return same_tree & (own | prompt)

    return shared_prefix


def merge_partials(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Two softmax-attention results over disjoint key sets, as one: ``out`` ``[T, H, D]`` (in ``out_a``'s
    dtype, weighed in fp32 at least), ``lse`` ``[H, T]`` (fp32 at least, as the kernels give it).  A row
    that saw no key in either (both LSEs -inf) stays the empty result: output 0, LSE -inf."""
    work = torch.promote_types(torch.promote_types(lse_a.dtype, lse_b.dtype), torch.float32)
    lse_a, lse_b = lse_a.to(work), lse_b.to(work)
    lse = torch.logaddexp(lse_a, lse_b)
    # exp(-inf - -inf) is nan: against a finite stand-in, an empty row weighs both partials 0
    finite = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    weight_a = torch.exp(lse_a - finite).transpose(0, 1).unsqueeze(-1)
    weight_b = torch.exp(lse_b - finite).transpose(0, 1).unsqueeze(-1)
    dtype = torch.promote_types(out_a.dtype, work)
    out = out_a.to(dtype) * weight_a.to(dtype) + out_b.to(dtype) * weight_b.to(dtype)
    return out.to(out_a.dtype), lse


def merged_forward(a: CallArgs, layout: "SharedPrefixLayout", self_pair: KernelPair,
                   cross_pair: Optional[KernelPair]) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """``(out, lse, rng_self, rng_cross)`` of the self call ``a`` merged with its cross call (none without one)."""
    out, lse, rng_self = self_pair.forward(a)
    rng_cross = None
    if cross_pair is not None:
        out_c, lse_c, rng_cross = cross_pair.forward(cross_args(a, layout))
        index = layout.cross_q
        merged, merged_lse = merge_partials(out.index_select(0, index), lse.index_select(1, index), out_c, lse_c)
        out = out.index_copy(0, index, merged.to(out.dtype))
        lse = lse.to(merged_lse.dtype).index_copy(1, index, merged_lse)
    return out, lse, rng_self, rng_cross


def merged_backward(a: CallArgs, layout: "SharedPrefixLayout", self_pair: KernelPair, cross_pair: Optional[KernelPair],
                    grad_out: Tensor, out: Tensor, lse: Tensor, rng_self: Tensor,
                    rng_cross: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """``(dq, dk, dv, dsink)``: each kernel's backward given the merged ``out`` and ``lse`` (the module doc)."""
    grad_out = grad_out.contiguous()
    dq, dk, dv, dsink = self_pair.backward(a, grad_out, out, lse, rng_self)[:4]
    if cross_pair is not None:
        index = layout.cross_q
        dq_c, dk_c, dv_c = cross_pair.backward(
            cross_args(a, layout), grad_out.index_select(0, index), out.index_select(0, index),
            lse.index_select(1, index).contiguous(), rng_cross)[:3]
        dq = dq.index_add(0, index, dq_c.to(dq.dtype))
        dk = dk.index_add(0, layout.cross_kv, dk_c.to(dk.dtype))
        dv = dv.index_add(0, layout.cross_kv, dv_c.to(dv.dtype))
    if a.sink is not None and dsink is not None:
        dsink = dsink.to(a.sink.dtype)
    return dq, dk, dv, dsink if a.sink is not None else None


class SharedPrefixAttention(torch.autograd.Function):
    """The merged self and cross calls of a shared-prefix row in eager mode (`merged_forward`,
    `merged_backward`).  ``self_args`` is the checked self call; the cross call is made of it."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor], layout: "SharedPrefixLayout",
                self_args: CallArgs, self_pair: KernelPair, cross_pair: Optional[KernelPair]) -> Tensor:
        a = self_args._replace(q=q, k=k, v=v, sink=sink)
        out, lse, rng_self, rng_cross = merged_forward(a, layout, self_pair, cross_pair)
        ctx.save_for_backward(q, k, v, sink, out, lse, rng_self, rng_cross)
        ctx.layout, ctx.self_args, ctx.pairs = layout, self_args, (self_pair, cross_pair)
        ctx.versions = _versions(layout)  # the layout is no saved tensor: torch would not see it refilled
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple:
        q, k, v, sink, out, lse, rng_self, rng_cross = ctx.saved_tensors
        if _versions(ctx.layout) != ctx.versions:
            raise R.refuse(R.PREFIX_CHANGED)
        a = ctx.self_args._replace(q=q, k=k, v=v, sink=sink)
        dq, dk, dv, dsink = merged_backward(a, ctx.layout, *ctx.pairs, grad_out, out, lse, rng_self, rng_cross)
        return dq, dk, dv, dsink, None, None, None, None


def _versions(layout: SharedPrefixLayout) -> tuple:
    return tuple(tensor_version(t) for t in (layout.segments, layout.cross_q, layout.cross_kv, layout.cu_cross_q,
                                             layout.cu_cross_kv))


def cross_args(a_self: CallArgs, layout: SharedPrefixLayout) -> CallArgs:
    """The cross call of a self call: every tree's responses against its prompt, non-causal, no sink."""
    kv = layout.cross_kv
    return a_self._replace(q=a_self.q.index_select(0, layout.cross_q), k=a_self.k.index_select(0, kv),
                           v=a_self.v.index_select(0, kv), cu_q=layout.cu_cross_q, cu_kv=layout.cu_cross_kv,
                           max_q=layout.max_cross_q, max_kv=layout.max_cross_kv, sink=None, causal=False,
                           window=(-1, -1), return_lse=True)


__all__ = ["Item", "SharedPrefixAttention", "SharedPrefixLayout", "cross_args", "merge_partials", "merged_backward", "tree_mod",
           "merged_forward"]
