"""Mask library: mask_mod factories a YAML can name without writing Python.

Every factory returns a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool``
built from torch's own ``and_masks`` / ``or_masks``.  Masks that a fixed
Primus-Turbo kernel can run are registered with their `Pattern` by identity
(`library`), so they are never traced; the others run on the ``reference`` backend.

Window convention (flash-attention): ``sliding_window(left, right)`` allows
``q - left <= kv <= q + right``; ``-1`` is unbounded.  torchtitan's
``sliding_window(W)`` lets a query see ``W`` tokens *including itself*, which is
``sliding_window(W - 1, 0)`` here; attention-gym's ``q_idx - kv_idx <= W`` is
``sliding_window(W, 0)``.

YAML use::

    turbo_flex_attention_mask_mod: "primus_ext.attention.masks:prefix_lm"
    turbo_flex_attention_mask_mod_kwargs: {prefix_length: 64}
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import and_masks, noop_mask, or_masks

from .library import hook_factory, register_library_mask
from .pattern import CAUSAL, FULL, MaskMod, Pattern


_tagged = register_library_mask  # known by identity, never by an attribute a wrapper could copy


def _integer(name: str, value: object) -> int:
    """``value`` as an int; a float or a bool is refused, not truncated (``{prefix_length: true}`` was a prefix
    of 1, so a causal mask; ``{left: 32.7}`` a window of 32)."""
    if isinstance(value, (bool, float)):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    return int(value)  # type: ignore[call-overload]


@hook_factory
def full() -> MaskMod:
    """Every query sees every key."""

    def full_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return noop_mask(b, h, q_idx, kv_idx)

    return _tagged(full_mask, FULL, "full")


@hook_factory
def causal() -> MaskMod:
    """A query sees itself and every earlier key (``kv <= q``)."""

    def causal_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx <= q_idx

    return _tagged(causal_mask, CAUSAL, "causal")


_causal_mask = causal  # the factories below take a `causal` flag that shadows it


@hook_factory
def sliding_window(left: int, right: int = 0) -> MaskMod:
    """Flash-convention window: allowed iff ``q - left <= kv <= q + right`` (-1 = unbounded).

    ``sliding_window(W)`` is a causal window of the current token plus ``W`` to its left.
    """
    pattern = Pattern(_integer("left", left), _integer("right", right))

    def window_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return pattern.allows(q_idx, kv_idx)

    return _tagged(window_mask, pattern, f"sliding_window({left}, {right})")


@hook_factory
def prefix_lm(prefix_length: int) -> MaskMod:
    """Bidirectional over the first ``prefix_length`` keys, causal after them."""
    n = _integer("prefix_length", prefix_length)
    if n < 0:
        raise ValueError(f"prefix_length must be >= 0, got {prefix_length}")

    def prefix_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx < n

    return _tagged(or_masks(causal(), prefix_mask), None, f"prefix_lm({n})")


@hook_factory
def packed_documents(
    cu_seqlens: Sequence[int] | Tensor, causal: bool = True, window: Sequence[int] = (-1, -1)
) -> MaskMod:
    """Block-diagonal mask of packed documents, given their cumulative lengths.

    ``cu_seqlens = (0, l0, l0 + l1, ..., S)``.  Inside a document the mask is causal
    (``causal=True``) and/or restricted by the flash-convention ``window``.
    """
    bounds = tuple(int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens))
    left, right = _integer("window[0]", window[0]), _integer("window[1]", window[1])
    if causal:
        right = 0
    pattern = Pattern(left, right, boundaries=bounds)

    def document_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return pattern.allows(q_idx, kv_idx)

    return _tagged(document_mask, pattern, f"packed_documents({len(bounds) - 1})")


@hook_factory
def chunked(chunk_size: int, causal: bool = True) -> MaskMod:
    """Local attention in fixed chunks of ``chunk_size`` (Llama-4 style), causal inside."""
    c = _integer("chunk_size", chunk_size)
    if c <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")

    def same_chunk(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return torch.div(q_idx, c, rounding_mode="floor") == torch.div(kv_idx, c, rounding_mode="floor")

    mask = and_masks(same_chunk, _causal_mask()) if causal else same_chunk
    return _tagged(mask, None, f"chunked({c})")


__all__ = ["causal", "chunked", "full", "packed_documents", "prefix_lm", "sliding_window"]
