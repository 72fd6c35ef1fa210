"""The random generator state a dropout forward starts from, for the backward op's recompute.

A custom op's backward that runs the forward again must draw the same dropout mask:
the forward op returns the generator state it started from, and the backward op
replays the recompute under that state and then puts the generator back.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor


def rng_size(device: torch.device) -> int:
    """Bytes of the generator state a dropout forward on ``device`` returns."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device).numel()
    return torch.get_rng_state().numel()


def rng_snapshot(device: torch.device, dropout_p: float) -> Tensor:
    """The generator state now (empty without dropout: nothing to replay)."""
    if dropout_p <= 0.0:
        return torch.empty(0, dtype=torch.uint8, device="cpu")
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


@contextlib.contextmanager
def rng_restored(state: Optional[Tensor], device: torch.device):
    """Run the block under ``state`` (None or empty: nothing to replay); the generator is put back afterwards."""
    if state is None or state.numel() == 0:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        if devices:
            torch.cuda.set_rng_state(state, device)
        else:
            torch.set_rng_state(state)
        yield


__all__ = ["rng_restored", "rng_size", "rng_snapshot"]
