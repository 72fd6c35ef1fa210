"""Facts proven about a tensor's values, shared by every layer of a model.

Document boundaries and Megatron's attention mask are values, not metadata: proving them
costs an on-device check.  Every layer of a step gets the same tensor object, so a fact
is kept per tensor, by weak reference and in-place version counter, and a 96-layer step
checks each tensor once.  A freed tensor's address can be reused by another one, so
identity (the weak reference), never the address, says "the same tensor"; an in-place
write bumps the version, which voids the fact.  Inference tensors have no version
counter: nothing is kept for them, they are checked at every call.
"""

from __future__ import annotations

import weakref
from typing import Hashable, Optional

import torch
from torch import Tensor

from ..backends.check_op import tensor_version

_LIMIT = 8
"""Facts kept at once: a step's boundaries (q and kv) and mask, with room for a few more."""
_SNAPSHOT_MAX = 4096
"""Elements of a CPU tensor whose values are kept and compared (boundaries are; a mask is not)."""


class TensorFacts:
    """The last few ``(tensor, state, claim)`` proven; the oldest goes first.

    A tensor's state is its version counter, storage pointer and metadata: ``t.data = other``
    swaps storage (and may change shape or dtype) without a version bump.  On the CPU, where
    reading values costs no sync, a copy of a small tensor's values (boundaries, up to 4096
    elements) is kept and compared too: writes that bypass the version counter (through
    ``t.data[...]`` or a numpy alias) are caught there.  Elsewhere (an accelerator, a mask)
    such writes are not seen, as autograd does not see them either.
    """

    def __init__(self) -> None:
        self._facts: list[tuple[weakref.ref, tuple, Optional[Tensor], Hashable]] = []

    def known(self, t: Tensor, claim: Hashable) -> bool:
        """Whether ``claim`` was proven for ``t`` as it is now (same object, state and values)."""
        state = _state(t)
        if state is None:
            return False
        for ref, seen, values, said in self._facts:
            if ref() is t and seen == state and said == claim:
                return values is None or torch.equal(values, t)
        return False

    def learn(self, t: Tensor, claim: Hashable) -> None:
        """Remember that ``claim`` holds for ``t`` as it is now."""
        state = _state(t)
        if state is None:
            return
        values = t.detach().clone() if t.device.type == "cpu" and t.numel() <= _SNAPSHOT_MAX else None
        self._facts.insert(0, (weakref.ref(t), state, values, claim))
        del self._facts[_LIMIT:]

    def forget(self) -> None:
        self._facts.clear()


def _state(t: Tensor) -> Optional[tuple]:
    """What says "unchanged" without reading values, or None for an inference tensor (no version)."""
    version = tensor_version(t)
    if version is None:
        return None
    return (version, t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


FACTS = TensorFacts()
"""The one store every call site shares (boundaries, masks)."""

__all__ = ["FACTS", "TensorFacts"]
