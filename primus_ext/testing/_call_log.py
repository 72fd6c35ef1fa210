"""The fake's call log: the most recent calls, and counters of every call ever made.

A call record holds the very tensors the caller passed (tests check their identity and
strides), so an unbounded log would keep every step's inputs alive: a long CPU training
run on the fake would grow without limit.  The log keeps the last `capacity` calls and
counts all of them, per entry and per kernel backend, so memory stays flat over any
number of calls while tests can still ask "how many calls reached AITER".
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from typing import Any, Iterator, Union

DEFAULT_CAPACITY = 512
"""Recent calls kept; more than any single test step here makes, few enough to stay small."""


class CallLog(Sequence):
    """The last `capacity` recorded calls (a sequence equal to the list of them), plus counters."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"the call log keeps at least one call, got capacity={capacity}")
        self.capacity = capacity
        self._recent: deque = deque(maxlen=capacity)
        self.by_entry: Counter = Counter()
        """Every call ever recorded (since `clear`), per entry name."""
        self.by_backend: Counter = Counter()
        """Every call a kernel backend took (since `clear`), per ``(entry, backend)``."""

    def append(self, call: Any) -> None:
        self._recent.append(call)
        self.by_entry[call.entry] += 1
        if call.backend is not None:
            self.by_backend[(call.entry, call.backend)] += 1

    def set_backend(self, call: Any, backend: str) -> None:
        """Record that ``backend`` took ``call`` (a call is routed after it was logged)."""
        if call.backend is not None:
            self.by_backend[(call.entry, call.backend)] -= 1
        object.__setattr__(call, "backend", backend)
        self.by_backend[(call.entry, backend)] += 1

    def clear(self) -> None:
        self._recent.clear()
        self.by_entry.clear()
        self.by_backend.clear()

    @property
    def total(self) -> int:
        """How many calls were recorded since `clear`, kept or not."""
        return sum(self.by_entry.values())

    def __len__(self) -> int:
        return len(self._recent)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._recent)

    def __getitem__(self, index: Union[int, slice]) -> Any:
        if isinstance(index, slice):
            return list(self._recent)[index]
        return self._recent[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (CallLog, list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    def __add__(self, other: Any) -> list:
        return list(self) + list(other)

    def __repr__(self) -> str:
        return f"CallLog({list(self._recent)!r}, total={self.total})"


__all__ = ["CallLog", "DEFAULT_CAPACITY"]
