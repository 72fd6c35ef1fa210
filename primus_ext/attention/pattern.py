"""`Pattern`: an attention mask that Primus-Turbo's fixed kernels can run.

Window bounds use the flash-attention convention: a key/value position ``kv`` is
allowed for a query position ``q`` iff ``q - left <= kv <= q + right``, where ``-1``
means unbounded on that side.  So ``(-1, -1)`` is full attention, ``(-1, 0)`` is
causal and ``(W, 0)`` is a causal sliding window that sees the current token and
``W`` tokens to its left (``W + 1`` in all).  torchtitan's ``window_size=W`` counts
the current token inside ``W``; it equals ``(W - 1, 0)`` here.

Indices are those of the FlexAttention ``mask_mod`` (top-left aligned).  Packed
documents restrict the window to each document: ``boundaries`` are the cumulative
document lengths ``(0, l0, l0 + l1, ..., S)`` shared by q and kv, for one length S.
A proven hook can also describe documents for *every* length: ``chunk`` (documents of
``chunk`` tokens each, the last one cut short) or ``cuts`` (documents start at these
constant positions, the last one runs to the end); `Pattern.at_length` turns either
into ``boundaries`` for one call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from .library import register_library_mask

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class Pattern:
    """A recognised mask: a flash-convention window, optionally inside documents."""

    left: int = -1
    right: int = -1
    boundaries: Optional[tuple[int, ...]] = None
    chunk: Optional[int] = None
    cuts: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        for name in ("left", "right"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < -1:
                raise ValueError(f"Pattern.{name} must be an int >= -1, got {value!r}")
        if sum(x is not None for x in (self.boundaries, self.chunk, self.cuts)) > 1:
            raise ValueError("Pattern takes one of boundaries, chunk and cuts")
        if self.boundaries is not None:
            b = self.boundaries
            if len(b) < 2 or b[0] != 0 or any(x > y for x, y in zip(b, b[1:])):
                raise ValueError(f"Pattern.boundaries must start at 0 and not decrease: {b}")
        if self.chunk is not None and (not isinstance(self.chunk, int) or self.chunk < 1):
            raise ValueError(f"Pattern.chunk must be an int >= 1, got {self.chunk!r}")
        if self.cuts is not None and (not self.cuts or self.cuts[0] < 1
                                      or any(x >= y for x, y in zip(self.cuts, self.cuts[1:]))):
            raise ValueError(f"Pattern.cuts must be increasing positions >= 1: {self.cuts}")

    @property
    def documents(self) -> bool:
        return self.boundaries is not None or self.chunk is not None or self.cuts is not None

    def at_length(self, length: int) -> "Pattern":
        """This pattern at one sequence length: ``chunk``/``cuts`` become ``boundaries``."""
        if self.chunk is None and self.cuts is None:
            return self
        if self.chunk is not None:
            inner = tuple(range(self.chunk, length, self.chunk))
        else:
            inner = tuple(c for c in self.cuts or () if c < length)
        return Pattern(self.left, self.right, boundaries=(0, *inner, length))

    @property
    def window(self) -> tuple[int, int]:
        return (self.left, self.right)

    @property
    def is_causal(self) -> bool:
        """True when no key to the right of the query is allowed."""
        return self.right == 0

    @property
    def kind(self) -> str:
        """One of ``full``, ``causal``, ``window``, ``documents``."""
        if self.documents:
            return "documents"
        if self.window == (-1, -1):
            return "full"
        if self.window == (-1, 0):
            return "causal"
        return "window"

    def describe(self) -> str:
        if self.kind in ("full", "causal"):
            return self.kind
        text = f"window(left={self.left}, right={self.right})"
        if self.documents:
            inner = "" if self.window == (-1, -1) else f", {text}"
            if self.window == (-1, 0):
                inner = ", causal"
            if self.chunk is not None:
                return f"chunks({self.chunk}{inner})"
            if self.cuts is not None:
                return f"documents(cut at {', '.join(map(str, self.cuts))}{inner})"
            return f"documents({len(self.boundaries or ()) - 1}{inner})"
        return text

    def allows(self, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        """Boolean tensor of allowed (q, kv) pairs; broadcasts like a mask_mod."""
        diff = q_idx - kv_idx
        ok = torch.ones_like(diff, dtype=torch.bool)
        if self.left >= 0:
            ok = ok & (diff <= self.left)
        if self.right >= 0:
            ok = ok & (-diff <= self.right)
        if self.chunk is not None:
            ok = ok & (torch.div(q_idx, self.chunk, rounding_mode="floor")
                       == torch.div(kv_idx, self.chunk, rounding_mode="floor"))
        inner = self.boundaries[1:-1] if self.boundaries is not None else self.cuts
        if inner is not None:
            bounds = torch.tensor(inner, device=q_idx.device, dtype=q_idx.dtype)
            ok = ok & (
                torch.bucketize(q_idx, bounds, right=True)
                == torch.bucketize(kv_idx, bounds, right=True)
            )
        return ok

    def mask_mod(self) -> MaskMod:
        """A FlexAttention mask_mod computing exactly this pattern."""
        pattern = self

        def pattern_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return pattern.allows(q_idx, kv_idx)

        return register_library_mask(pattern_mask, pattern, pattern.describe())


def index_grid(batch: int, heads: int, q_len: int, kv_len: int, device: torch.device):
    """Broadcastable ``(b, h, q_idx, kv_idx)`` index tensors of shape ``[B, H, Sq, Skv]``."""
    kw = dict(device=device, dtype=torch.int64)
    return (
        torch.arange(batch, **kw).view(-1, 1, 1, 1),
        torch.arange(heads, **kw).view(1, -1, 1, 1),
        torch.arange(q_len, **kw).view(1, 1, -1, 1),
        torch.arange(kv_len, **kw).view(1, 1, 1, -1),
    )


FULL = Pattern(-1, -1)
CAUSAL = Pattern(-1, 0)


def pattern_from_flash_args(causal: bool, window_size: tuple[int, int]) -> Pattern:
    """The pattern of a ``flash_attn_func(causal=..., window_size=...)`` call (Sq == Skv).

    ``causal=True`` caps the right bound at 0; the left bound is kept.
    """
    left, right = (int(window_size[0]), int(window_size[1]))
    if causal:
        right = 0
    return Pattern(left, right)


__all__ = ["CAUSAL", "FULL", "MaskMod", "Pattern", "ScoreMod", "index_grid", "pattern_from_flash_args"]
