"""Ulysses context parallelism on torch.distributed, for both attention paths.

Megatron gives each context-parallel (CP) rank a load-balanced part of every sequence
(``megatron.core.utils.get_batch_on_this_cp_rank``): the sequence is cut into ``2 * CP``
equal chunks and rank ``r`` holds chunks ``r`` and ``2 * CP - 1 - r``, in that order, so
causal work is spread evenly.  Primus-Turbo's own context-parallel entries join the
shards in rank order, which is another token order (docs/fidelity.md, fact `cp-shard-order`), so they are
not used.  `Ulysses` instead does, per layer call:

1. `Ulysses.scatter_heads`: one all-to-all over the CP group per tensor turns this rank's
   part of the sequence with all heads into the whole sequence with ``1 / CP`` of the
   heads (rank ``r`` gets heads ``r * H / CP`` to ``(r + 1) * H / CP - 1``).  The chunks
   arrive in rank order, ``[0, 2CP-1, 1, 2CP-2, ...]``; they are put back in natural
   order, so the kernel sees positions ``0 .. S-1`` exactly as at CP 1.
2. The layer's ordinary attention on that: any mask, window, sink, hook, on any backend.
3. `Ulysses.gather_heads`: the inverse.  Each output chunk goes back to the rank that
   holds its tokens and the heads are joined again.

Both steps are differentiable.  The backward of an all-to-all with equal splits is the
same all-to-all of the gradients, and the backward of the reordering is the inverse
reordering.  So every rank's q, k and v gradients are exactly its rows of the CP-1
gradients.  The collectives are ``torch.distributed._functional_collectives``, which
``torch.compile`` traces into the graph (no graph break).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from ..refusals import CP_LENGTH, refuse

CP_COMM_TYPES = (None, "a2a", "p2p", "a2a+p2p", "all_gather")
"""Megatron's ``cp_comm_type`` values.  Every one runs as Ulysses here: the numbers are the
same, only how the sequence travels differs from what TransformerEngine would do."""


def describe_comm(cp_size: int, cp_comm_type: Optional[str]) -> str:
    """What a layer at ``context_parallel_size=cp_size`` with ``cp_comm_type`` runs, for ``check``."""
    asked = f"cp_comm_type={cp_comm_type}" if cp_comm_type else "cp_comm_type unset"
    same = "" if cp_comm_type in (None, "a2a") else ", the same numbers as a2a (not TransformerEngine's " \
        f"{cp_comm_type} exchange)"
    return (f"context_parallel_size={cp_size}, {asked} runs as Ulysses: an all-to-all over the context-parallel "
            f"group (this rank's sequence chunks in, 1/{cp_size} of the heads of the whole sequence out, "
            f"Megatron's load-balanced chunks put in sequence order){same}; packed (THD) batches are refused "
            "(cp-packed)")


def _exchange(x: Tensor, group: Any) -> Tensor:
    """All-to-all along dim 0, one slice to each rank of ``group``, in group-rank order."""
    n = x.shape[0]
    out = funcol.all_to_all_single(x.contiguous(), [1] * n, [1] * n, group)
    return funcol.wait_tensor(out)


class _AllToAll(torch.autograd.Function):
    """`_exchange` with its backward, which is the same exchange of the gradients."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _exchange(grad, ctx.group), None


def chunk_owner(chunk: int, size: int) -> tuple[int, int]:
    """``(rank, half)`` that holds natural chunk ``chunk`` of ``2 * size`` in Megatron's split."""
    return (chunk, 0) if chunk < size else (2 * size - 1 - chunk, 1)


@dataclass(frozen=True)
class Ulysses:
    """The all-to-all of one CP group: ``size`` ranks, this one being ``rank`` in the group."""

    group: Any
    size: int
    rank: int

    @classmethod
    def over(cls, group: Any) -> "Ulysses":
        """The exchange over ``group`` (a ``torch.distributed`` process group)."""
        return cls(group, dist.get_world_size(group), dist.get_rank(group))

    def local_heads(self, heads: int) -> int:
        return heads // self.size

    def head_offset(self, heads: int) -> int:
        """Index, among ``heads``, of this rank's first head after `scatter_heads`."""
        return self.rank * self.local_heads(heads)

    def head_slice(self, per_head: Any) -> Any:
        """This rank's entries of a per-head tensor (a sink: a differentiable slice) or tuple (ALiBi slopes)."""
        n = self.local_heads(len(per_head))
        return per_head[self.rank * n:(self.rank + 1) * n]

    def positions(self, local_len: int, device: Any = None) -> Tensor:
        """Sequence positions of this rank's ``local_len`` rows in Megatron's split."""
        c = local_len // 2
        first, second = self.rank * c, (2 * self.size - 1 - self.rank) * c
        return torch.cat([torch.arange(first, first + c, device=device),
                          torch.arange(second, second + c, device=device)])

    def check_length(self, local_len: int, what: str) -> None:
        """Megatron's split gives every rank two equal chunks: an odd length is no such part."""
        if local_len % 2:
            raise refuse(CP_LENGTH, "context-parallel attention", what=what, tokens=local_len, cp=self.size,
                         chunks=2 * self.size)

    def scatter_heads(self, x: Tensor) -> Tensor:
        """sbhd ``[S/CP, B, H, D]`` (this rank's chunks) -> ``[S, B, H/CP, D]`` in sequence order."""
        s_local, _, heads, _ = x.shape
        n = self.size
        send = x.unflatten(2, (n, heads // n)).permute(2, 0, 1, 3, 4)  # [to rank, S/CP, B, H/CP, D]
        got = _AllToAll.apply(send, self.group).unflatten(1, (2, s_local // 2))  # [from rank, half, c, ...]
        return torch.cat([got[rank, half] for rank, half in (chunk_owner(k, n) for k in range(2 * n))])

    def gather_heads(self, y: Tensor) -> Tensor:
        """The inverse of `scatter_heads`: ``[S, B, H/CP, D]`` -> ``[S/CP, B, H, D]``."""
        n = self.size
        chunks = y.unflatten(0, (2 * n, y.shape[0] // (2 * n)))
        send = torch.stack([torch.cat([chunks[r], chunks[2 * n - 1 - r]]) for r in range(n)])
        got = _AllToAll.apply(send, self.group)  # [head group, S/CP, B, H/CP, D]
        return got.permute(1, 2, 0, 3, 4).flatten(2, 3)


__all__ = ["CP_COMM_TYPES", "Ulysses", "chunk_owner", "describe_comm"]
