"""Attention: mask patterns, the mask library, recognition, and the flex adapter."""

from __future__ import annotations

from typing import Any

from . import masks
from .pattern import CAUSAL, FULL, Pattern, pattern_from_flash_args

__all__ = ["CAUSAL", "FULL", "Pattern", "TurboFlexAttention", "masks", "pattern_from_flash_args"]


def __getattr__(name: str) -> Any:
    # Imported on first use: the adapter depends on the backends, which depend on
    # this package's pattern and cache modules.
    if name == "TurboFlexAttention":
        from .flex import TurboFlexAttention

        return TurboFlexAttention
    raise AttributeError(name)
