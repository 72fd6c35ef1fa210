"""Attention vocabulary: mask patterns, the mask library and hook recognition.

Nothing here imports the rest of primus_ext: backends, settings and the plan build on it.
"""

from __future__ import annotations

from . import masks
from .pattern import CAUSAL, FULL, Pattern, pattern_from_flash_args

__all__ = ["CAUSAL", "FULL", "Pattern", "masks", "pattern_from_flash_args"]
