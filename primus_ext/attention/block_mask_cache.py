"""A bounded LRU of FlexAttention BlockMasks, one per (pattern, q_len, kv_len, device).

Why a cache: Primus-Turbo's flex layer classifies a BlockMask by probing its
``mask_mod`` and memoises the answer by the *identity* of the BlockMask object.
Handing it the same object for the same (pattern, shape, device) makes every call
after the first free of probing; building a new object per call would re-probe.

Why analytic: torch's ``create_block_mask`` evaluates the mask on the whole
``S x S`` grid, O(S^2) in time and memory (16 Gi cells at S = 128k).  A window
pattern needs none of that: whether a 128 x 128 tile is empty, partial or full
follows from its corner coordinates, so the build is O((S / 128)^2) on the block
grid.  Measured on a 2-core CPU (torch 2.13) at S = 131072: a causal or window
BlockMask builds in 15-30 ms (best of several runs; the four 1024 x 1024 argsorts
dominate) with about 32 MiB peak RSS growth, of which 16 MiB stay in the BlockMask
(four 1024 x 1024 int32 index tables).  Letting ``from_kv_blocks`` derive the
q-major tables itself costs ~75 ms more, so they are filled from the transposed
tile tables instead.  A full cache of 64 such entries holds about 1 GiB.
Packed-document patterns still go through ``create_block_mask`` (O(S^2)); the
packed path normally uses the varlen entry and builds no BlockMask.

The cache is bounded (B5): a model sees few shapes, so the first eviction means
a pathological mix of shapes and is reported once with a ``RuntimeWarning``.
"""

from __future__ import annotations

import functools

import warnings
from collections import OrderedDict
from typing import Hashable, Union

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from .pattern import Pattern

BLOCK_SIZE = 128
Device = Union[str, torch.device]


def _ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """``(num_blocks [1,1,nq], indices [1,1,nq,nk])`` int32, selected blocks first in order.

    Same layout as torch's dense-to-ordered conversion (a stable descending sort), so
    ``to_dense()`` and the index tensors match ``create_block_mask``.
    """
    dense = blocks.to(torch.int32).contiguous()  # sorting a transposed view: ~10x slower
    num = dense.sum(-1, dtype=torch.int32)
    idx = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
    return num.view(1, 1, -1).contiguous(), idx.view(1, 1, *dense.shape).contiguous()


def window_block_tables(pattern: Pattern, q_len: int, kv_len: int, device: Device,
                        block_size: int = BLOCK_SIZE) -> tuple[Tensor, Tensor]:
    """``(partial, full)`` boolean ``[nq, nk]`` tile tables of a window pattern.

    In a tile with queries ``qs..qe`` and keys ``ks..ke`` the offset ``kv - q`` takes
    every integer in ``[ks - qe, ke - qs]``.  The pattern allows offsets
    ``[-left, right]``.  The tile has an allowed cell iff the two ranges meet, and is
    full iff the first lies inside the second *and* the tile is a whole
    ``block_size`` square (torch pads ragged edge tiles with masked cells, so they
    are never full).
    """
    if pattern.boundaries is not None:
        raise ValueError("window_block_tables takes a window pattern without documents")
    dev = torch.device(device)
    big = q_len + kv_len  # beyond any offset in the grid: stands for "unbounded"
    lowest = -pattern.left if pattern.left >= 0 else -big
    highest = pattern.right if pattern.right >= 0 else big
    q_start = torch.arange(0, q_len, block_size, device=dev)
    kv_start = torch.arange(0, kv_len, block_size, device=dev)
    q_end = torch.clamp(q_start + block_size, max=q_len) - 1
    kv_end = torch.clamp(kv_start + block_size, max=kv_len) - 1
    offset_min = kv_start.view(1, -1) - q_end.view(-1, 1)
    offset_max = kv_end.view(1, -1) - q_start.view(-1, 1)
    any_allowed = (offset_max >= lowest) & (offset_min <= highest)
    whole_tile = ((q_end - q_start + 1) == block_size).view(-1, 1) & (
        (kv_end - kv_start + 1) == block_size).view(1, -1)
    full = (offset_min >= lowest) & (offset_max <= highest) & whole_tile
    return any_allowed & ~full, full


def build_block_mask(pattern: Pattern, q_len: int, kv_len: int, device: Device) -> BlockMask:
    """A BlockMask for ``pattern``: analytic for windows, torch's builder for documents."""
    if int(q_len) < 1 or int(kv_len) < 1:
        raise ValueError(f"q_len and kv_len must be >= 1, got {q_len} and {kv_len}")
    if pattern.boundaries is not None:
        return create_block_mask(pattern.mask_mod(), None, None, q_len, kv_len,
                                 device=device, _compile=False)
    partial, full = window_block_tables(pattern, q_len, kv_len, device)
    kv_num_blocks, kv_indices = _ordered(partial)
    full_kv_num_blocks, full_kv_indices = _ordered(full)
    block_mask = BlockMask.from_kv_blocks(
        kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
        BLOCK_SIZE=BLOCK_SIZE, mask_mod=pattern.mask_mod(), seq_lengths=(q_len, kv_len),
        compute_q_blocks=False)
    # torch derives the q-major tables by densifying the kv-major ones under vmap
    # (~75 ms at S = 128k); here the dense tables are at hand, so a transpose is enough.
    # Same values as torch's own derivation (checked by the tests against create_block_mask).
    block_mask.q_num_blocks, block_mask.q_indices = _ordered(partial.T)
    block_mask.full_q_num_blocks, block_mask.full_q_indices = _ordered(full.T)
    return block_mask


class BlockMaskCache:
    """LRU of BlockMasks keyed by ``(pattern, q_len, kv_len, str(device))``.

    ``get`` returns the *same* object on a hit, because Primus-Turbo memoises its
    mask classification by object identity.  At most ``maxsize`` entries are kept;
    the first eviction emits one ``RuntimeWarning`` per cache object.  Not
    thread-safe; one cache belongs to one backend instance.
    """

    def __init__(self, maxsize: int = 64) -> None:
        if int(maxsize) < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self.maxsize = int(maxsize)
        self._entries: OrderedDict[Hashable, BlockMask] = OrderedDict()
        self._warned = False
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    @staticmethod
    def key(pattern: Pattern, q_len: int, kv_len: int, device: Device) -> tuple:
        # A torch.device hashes as it is; converting it to a string cost a third of a hit.
        dev = device if isinstance(device, torch.device) else torch.device(device)
        return (pattern, int(q_len), int(kv_len), dev)

    def get(self, pattern: Pattern, q_len: int, kv_len: int, device: Device) -> BlockMask:
        """The cached BlockMask for this pattern and shape, built on a miss."""
        key = self.key(pattern, q_len, kv_len, device)
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            return found
        self.misses += 1
        block_mask = build_block_mask(pattern, int(q_len), int(kv_len), key[3])
        self._entries[key] = block_mask
        if len(self._entries) > self.maxsize:
            self._evict_oldest()
        return block_mask

    def _evict_oldest(self) -> None:
        if not self._warned:
            shapes = {(k[1], k[2]) for k in self._entries}
            warnings.warn(
                f"primus_ext: the cache of {self.maxsize} BlockMasks is full: "
                f"{len(self._entries)} entries over {len(shapes)} distinct (q_len, kv_len) "
                "shapes were requested, a pathological mix of shapes. The least recently used "
                "BlockMask is evicted and will be rebuilt (and re-probed by Primus-Turbo) if "
                "needed again. Pad or bucket sequence lengths to a few shapes. "
                "This warning is shown once per cache.",
                RuntimeWarning, stacklevel=3)
            self._warned = True
        self._entries.popitem(last=False)
        self.evictions += 1

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def clear(self) -> None:
        """Drop every entry; counters and the one-warning flag are kept."""
        self._entries.clear()


@functools.lru_cache(maxsize=None)
def shared_block_mask_cache() -> BlockMaskCache:
    """One cache for all layers of a process (the Megatron modules use it).

    Layers with the same pattern and shape then share one BlockMask object: one
    build, one Turbo probe, one copy in memory instead of one per layer.
    """
    return BlockMaskCache()


__all__ = ["shared_block_mask_cache", "BLOCK_SIZE", "BlockMaskCache", "build_block_mask", "window_block_tables"]
