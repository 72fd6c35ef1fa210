"""BlockMasks built once and shared by every layer: the ``flex`` backend's cache.

Building a BlockMask (torch's ``create_block_mask``) evaluates the mask_mod at every cell of the
call; a 24-layer model whose layers share a hook needs it once per step, not 24 times.  An entry is
found by its key (the mask_mod's identity, B, H, Sq, Skv, device, block size) and taken only when
its *state* still holds: the boundary tensors it was built from (packed calls: ``cu_seqlens``) are
the same objects, unchanged (weak reference and in-place version counter, as
`primus_ext.call.facts` keeps tensor facts), and what the hook captures is unchanged
(`primus_ext.backends.flex_masks.captured_state`: a tensor updated in place bumps its version).
Otherwise the mask is built again and replaces the entry.  Nothing of a call's inputs is kept
alive: boundaries are held by weak reference.  An entry holds its BlockMask, and through the
BlockMask its mask_mod and what that captures (per-token document numbers derived on the device, a
hook's captured tensors) until it is replaced or evicted; all of it is counted in bytes.  The cache is
bounded in bytes (least recently used first out); `builds` and `hits` count what happened.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional

from torch import Tensor

from .check_op import tensor_version
from .flex_masks import same_state

DEFAULT_LIMIT_BYTES = 512 << 20
"""Half a GiB of BlockMasks: at 128k tokens with 128-token blocks one mask is about 8 MiB per head."""


def boundary_state(*tensors: Optional[Tensor]) -> tuple:
    """Stamps of boundary tensors (None for an absent one), compared by `same_state`: an inference tensor
    (no version counter) never matches, so its mask is built at every call."""
    stamps: list[tuple] = []
    for t in tensors:
        if t is None:
            stamps.append(("value", type(None), None))
            continue
        version = tensor_version(t)
        # no value snapshot: boundaries are read on the device, and a write behind the version counter is the
        # documented limit of the shared tensor facts too (docs/performance.md, caches)
        stamps.append(("tensor", weakref.ref(t), version, t.data_ptr(), tuple(t.shape), t.dtype, None)
                      if version is not None else ("inference tensor", id(t)))
    return tuple(stamps)


def block_mask_bytes(mask: Any) -> int:
    """Bytes of the tensors a BlockMask holds (block counts and indices, full and partial, both directions)."""
    return sum(t.numel() * t.element_size() for t in mask.as_tuple() if isinstance(t, Tensor))


@dataclass
class _Entry:
    mask: Any
    state: tuple
    nbytes: int


class BlockMaskCache:
    """Bounded, shared BlockMasks (see the module docstring)."""

    def __init__(self, limit_bytes: int = DEFAULT_LIMIT_BYTES) -> None:
        self.limit_bytes = limit_bytes
        self.builds = 0
        """BlockMasks built (a miss, or an entry whose state changed)."""
        self.hits = 0
        """Calls that took a cached BlockMask."""
        self.evictions = 0
        self._entries: "OrderedDict[Hashable, _Entry]" = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes held now (BlockMasks and what their mask_mods capture)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable, state: tuple, build: Callable[[], tuple[Any, int]]) -> Any:
        """The BlockMask of ``key`` built in ``state``; ``build()`` gives ``(mask, bytes its mask_mod captures)``."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and same_state(entry.state, state):
                self._entries.move_to_end(key)
                self.hits += 1
                return entry.mask
        mask, extra = build()
        with self._lock:
            self.builds += 1
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            entry = _Entry(mask, state, block_mask_bytes(mask) + extra)
            self._entries[key] = entry
            self._bytes += entry.nbytes
            while self._bytes > self.limit_bytes and len(self._entries) > 1:
                _, gone = self._entries.popitem(last=False)
                self._bytes -= gone.nbytes
                self.evictions += 1
        return mask

    def clear(self) -> None:
        """Forget every BlockMask and reset the counts."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0
            self.builds = self.hits = self.evictions = 0


BLOCK_MASKS = BlockMaskCache()
"""The one cache every ``flex`` layer of the process shares."""

__all__ = ["BLOCK_MASKS", "BlockMaskCache", "DEFAULT_LIMIT_BYTES", "block_mask_bytes", "boundary_state"]
