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
from typing import Any, Hashable, Optional

from torch import Tensor

from ..backends.check_op import tensor_version

_LIMIT = 8
"""Facts kept at once: a step's boundaries (q and kv) and mask, with room for a few more."""


class TensorFacts:
    """The last few ``(tensor, state, claim)`` proven; the oldest goes first.

    A tensor's state is its version counter, storage pointer and metadata: ``t.data = other``
    swaps storage (and may change shape or dtype) without a version bump.  Values written
    behind the version counter (in place through ``t.data``, or through a numpy or DLPack
    alias) are not seen, as autograd does not see them either: reading them back would be a
    host sync per call.
    """

    def __init__(self) -> None:
        self._facts: list[tuple[weakref.ref, tuple, Hashable, Any]] = []

    def known(self, t: Tensor, claim: Hashable) -> bool:
        """Whether ``claim`` was proven for ``t`` as it is now (same object and state)."""
        return self.recall(t, claim) is not None

    def recall(self, t: Tensor, claim: Hashable) -> Any:
        """What was derived with ``claim`` from ``t`` as it is now (True for a bare claim), or None."""
        for ref, seen, said, value in self._facts:
            if ref() is t and said == claim:  # the state is read only for a tensor remembered
                return value if seen == _state(t) else None
        return None

    def learn(self, t: Tensor, claim: Hashable, value: Any = True) -> None:
        """Remember that ``claim`` holds for ``t`` as it is now, with what was derived from it
        (``value``: kept, so it must not hold ``t`` itself)."""
        state = _state(t)
        if state is None:
            return
        self._facts.insert(0, (weakref.ref(t), state, claim, value))
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
