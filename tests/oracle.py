"""An independent float64 attention oracle, written from the definitions.

It does not import primus_ext's math: masks are Python predicates evaluated cell by
cell, softmax is written out per row, GQA maps query head h to kv head
h // (Hq // Hkv).  Slow on purpose; only for small shapes.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch

Allowed = Callable[[int, int, int, int], bool]  # (b, h, i, j) -> allowed


def window(left: int, right: int) -> Allowed:
    return lambda b, h, i, j: (left < 0 or i - j <= left) and (right < 0 or j - i <= right)


def hook(mask_mod: Callable[..., torch.Tensor]) -> Allowed:
    """A mask_mod evaluated cell by cell on 0-d index tensors, as written."""
    return lambda b, h, i, j: bool(mask_mod(*map(torch.tensor, (b, h, i, j))))


def causal() -> Allowed:
    return window(-1, 0)


def prefix_lm(prefix: int) -> Allowed:
    return lambda b, h, i, j: j < prefix or j <= i


def documents(bounds: Sequence[int], left: int = -1, right: int = 0) -> Allowed:
    def doc(x: int) -> int:
        return max(n for n, start in enumerate(bounds[:-1]) if start <= x)

    inner = window(left, right)
    return lambda b, h, i, j: doc(i) == doc(j) and inner(b, h, i, j)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: Optional[Allowed] = None,
    *,
    scale: Optional[float] = None,
    sink: Optional[Sequence[float]] = None,
    alibi: Optional[Sequence[float]] = None,
    score_mod: Optional[Callable[..., torch.Tensor]] = None,
) -> torch.Tensor:
    """bshd in, bshd out, float64.  ``alibi[h] * (j - i)`` is added to each score;
    ``score_mod`` is called cell by cell on 0-d tensors, exactly as the hook is written."""
    q, k, v = (t.detach().double() for t in (q, k, v))
    batch, sq, hq, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(batch, sq, hq, v.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for h in range(hq):
            g = h // (hq // hkv)
            for i in range(sq):
                logits, values = [], []
                for j in range(skv):
                    if allowed is not None and not allowed(b, h, i, j):
                        continue
                    s = float(q[b, i, h] @ k[b, j, g]) * scale
                    if alibi is not None:
                        s += alibi[h] * (j - i)
                    if score_mod is not None:
                        s = float(score_mod(torch.tensor(s, dtype=torch.float64), *map(torch.tensor, (b, h, i, j))))
                    logits.append(s)
                    values.append(v[b, j, g])
                extra = [float(sink[h])] if sink is not None else []
                if not logits:
                    continue
                top = max(logits + extra)
                weights = [math.exp(s - top) for s in logits]
                denom = sum(weights) + sum(math.exp(s - top) for s in extra)
                out[b, i, h] = sum(w * val for w, val in zip(weights, values)) / denom
    return out


def packed_attention(q, k, v, bounds: Sequence[int], left: int = -1, right: int = 0, **kw) -> torch.Tensor:
    """thd in, thd out: each document attended on its own."""
    outs = []
    for start, end in zip(bounds, bounds[1:]):
        sl = slice(start, end)
        outs.append(attention(q[sl][None], k[sl][None], v[sl][None], window(left, right), **kw)[0])
    return torch.cat(outs)
