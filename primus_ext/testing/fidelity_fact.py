"""One row of the fidelity table (`primus_ext.testing.fidelity`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fact:
    """One row: an upstream fact and how the fake and the plan follow it."""

    id: str
    fact: str
    source: str
    fake: str
    plan: str


__all__ = ["Fact"]
