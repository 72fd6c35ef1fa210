"""Backends that run an approved attention plan.

``turbo``: Primus-Turbo on ROCm.  ``reference``: exact torch math on any device.  ``flex``:
torch's own FlexAttention (compiled on a GPU) for hooks no fixed kernel computes.
``auto`` picks turbo when ``primus_turbo`` imports, else reference, and says which; the plan
then chooses per layer for hook layers (`primus_ext.plan.build`: admitted hooks run on flex on
a GPU).  The setting's choices are `primus_ext.settings.BACKEND_CHOICES` (one place).
"""

from __future__ import annotations

from typing import Tuple

from .base import AttentionBackend, BackendCapabilities, KernelCall
from .capabilities import entry_accepts, sink_kwargs_for
from .flex import FlexBackend
from .reference import ReferenceBackend
from .turbo import TurboBackend, load_ops

BACKENDS = ("turbo", "reference", "flex")
"""The backends `make_backend` makes (the setting's choices add ``auto``)."""


def turbo_import_problem() -> str:
    """Empty when Primus-Turbo's ops import, else what went wrong (for refusals)."""
    try:
        load_ops()
    except Exception as exc:  # any import failure means the build is unusable here
        return f"`import primus_turbo.pytorch.ops` failed ({type(exc).__name__}: {exc})"
    return ""


def select_backend(choice: str) -> Tuple[str, str, str]:
    """Resolve ``turbo_flex_attention_backend`` to ``(name, why, problem)``.

    ``problem`` is non-empty when ``turbo`` was asked for but cannot be loaded.
    """
    if choice in ("reference", "flex"):
        return choice, f"turbo_flex_attention_backend: {choice}", ""
    problem = turbo_import_problem()
    if choice == "turbo":
        return "turbo", "turbo_flex_attention_backend: turbo", problem
    if problem:
        return "reference", "auto: primus_turbo is not importable here", ""
    return "turbo", "auto: primus_turbo imports", ""


def make_backend(name: str) -> AttentionBackend:
    """A fresh backend instance."""
    if name == "reference":
        return ReferenceBackend()
    if name == "turbo":
        return TurboBackend()
    if name == "flex":
        return FlexBackend()
    raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS}")


__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "BackendCapabilities",
    "FlexBackend",
    "KernelCall",
    "ReferenceBackend",
    "TurboBackend",
    "entry_accepts",
    "make_backend",
    "select_backend",
    "sink_kwargs_for",
    "turbo_import_problem",
]
