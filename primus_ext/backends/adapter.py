"""Deprecated home of `TurboFlexAttention`: it lives in `primus_ext.call` (the call path).

Kept so that ``from primus_ext.backends.adapter import TurboFlexAttention``, as earlier
docs showed it, still works.  The name is looked up when first used, not imported here:
backends never import the call path (the layers in pyproject.toml), and this module holds
no code of its own.
"""

from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    if name == "TurboFlexAttention":
        return importlib.import_module("primus_ext.call").TurboFlexAttention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["TurboFlexAttention"]
