"""The GPU arch of this process's device, the one input the kernel dispatch model needs from it.

On ROCm it is the device's ``gcnArchName`` (``gfx942`` = MI300, ``gfx950`` = MI355).  A
test double of Primus-Turbo can *present* an arch (`presenting`), so that a CPU test "on
MI355" plans, routes and lays out tensors exactly as ``turbo_arch: auto`` would on that
device: every reader of the device's arch goes through `device_arch`, so none of them can
see another arch than the others.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

_PRESENTED: list[str] = []
"""Arches presented by test doubles, innermost last (`presenting` pushes and pops)."""


def device_arch() -> Optional[str]:
    """The arch of the current device: the innermost presented one, else ``gcnArchName`` on
    ROCm, else None (no ROCm device: nothing about kernel backends is known here)."""
    if _PRESENTED:
        return _PRESENTED[-1]
    if getattr(torch.version, "hip", None) and torch.cuda.is_available():
        name = torch.cuda.get_device_properties(torch.cuda.current_device()).gcnArchName
        return str(name).split(":")[0]
    return None


def presented() -> bool:
    """True while a test double presents the device arch (no real device is asked)."""
    return bool(_PRESENTED)


@contextlib.contextmanager
def presenting(arch: Optional[str]) -> Iterator[None]:
    """Make `device_arch` answer ``arch`` inside the block (None: leave it as it is)."""
    if arch is None:
        yield
        return
    _PRESENTED.append(arch)
    try:
        yield
    finally:
        _PRESENTED.pop()


__all__ = ["device_arch", "presented", "presenting"]
