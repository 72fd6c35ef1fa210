"""The fake's ``primus_turbo.pytorch.core.backend``: how Primus-Turbo chooses a kernel backend.

Upstream's ``GlobalBackendManager`` (``primus_turbo/pytorch/core/backend.py`` at a6a16cd) answers
two questions for attention, re-read at every call:

* ``get_attn_backend(precision)``: a backend set in code (``set_attn_backend``; with
  ``backend=None``, with or without a precision, it forgets every code setting, l.291-297), else the
  environment's ``PRIMUS_TURBO_ATTN_BACKEND``, either one name for every precision
  (``aiter``) or ``<precision>:<backend>`` pairs with ``other`` for the rest
  (``bf16:flydsl,other:aiter``); bf16, fp16 and fp32 share one bucket (``BF16_FP16_FP32``);
  ``autotune`` as a name means no pin for attention (its dispatcher reads the bare backend);
  an unknown name raises ``KeyError``.
* ``auto_tune_enabled()``: a value set in code, else ``PRIMUS_TURBO_AUTO_TUNE == "1"``.

Written here from that reading, not copied.  The fake's dispatcher (`._fake_dispatch`) asks
it at every call, as upstream's ``flash_attn_func`` does.
"""

from __future__ import annotations

import enum
import os
import types
from typing import Optional

from ..backends.dispatch import DEFAULT_ORDER, Selection

ATTN_BACKEND, AUTO_TUNE = "PRIMUS_TURBO_ATTN_BACKEND", "PRIMUS_TURBO_AUTO_TUNE"


class PrecisionType(enum.Enum):
    FP4 = enum.auto()
    FP8 = enum.auto()
    BF16_FP16_FP32 = enum.auto()


class BackendType(enum.Enum):
    CK = enum.auto()
    HIPBLASLT = enum.auto()
    AITER = enum.auto()
    TRITON = enum.auto()
    DEEP_EP = enum.auto()
    TURBO = enum.auto()
    FLYDSL = enum.auto()
    HIPKITTENS = enum.auto()


BackendTypeWithGluon = enum.Enum("BackendType", [m.name for m in BackendType] + ["GLUON"])  # type: ignore[misc]
"""A build with PT #469 (the forward-only Gluon backend)."""
_KINDS: list = [BackendType]  # the enum of the installed fake's build


_PRECISIONS = {"FP4": PrecisionType.FP4, "FP8": PrecisionType.FP8, "BF16": PrecisionType.BF16_FP16_FP32,
               "FP16": PrecisionType.BF16_FP16_FP32, "FP32": PrecisionType.BF16_FP16_FP32}


def _backend(name: str) -> Optional[BackendType]:
    name = name.strip().upper()
    return None if name == "AUTOTUNE" else _KINDS[-1][name]  # KeyError for an unknown name


def _from_env(value: str, precision: PrecisionType) -> Optional[BackendType]:
    if not any(word in value.lower() for word in ("fp4", "fp8", "bf16", "fp16", "fp32", "other")):
        return _backend(value)
    table: dict[PrecisionType, Optional[BackendType]] = {}
    other: Optional[BackendType] = None
    for pair in value.split(","):
        if not pair.strip():
            continue
        key, name = (part.strip().upper() for part in pair.split(":"))
        if key == "OTHER":
            other = _backend(name)
        else:
            if key not in _PRECISIONS:
                raise AssertionError(f"Precision {key} not supported.")
            table[_PRECISIONS[key]] = _backend(name)
    return table.get(precision, other)


class GlobalBackendManager:
    """The attention part of upstream's manager: code settings first, then the environment."""

    _attn_backend: Optional[dict] = None
    _auto_tune: Optional[bool] = None

    @classmethod
    def set_attn_backend(cls, backend: Optional[BackendType] = None,
                         precision: Optional[PrecisionType] = None) -> None:
        if backend is None:  # with or without a precision: forget every code setting, the environment rules again
            cls._attn_backend = None
            return
        if cls._attn_backend is None:
            cls._attn_backend = {}
        if precision is None:
            cls._attn_backend = {p: backend for p in PrecisionType}
        else:
            cls._attn_backend[precision] = backend

    @classmethod
    def get_attn_backend(cls, precision: PrecisionType) -> Optional[BackendType]:
        if cls._attn_backend is not None:
            return cls._attn_backend.get(precision)
        value = os.environ.get(ATTN_BACKEND)
        return _from_env(value, precision) if value and value.strip() else None

    @classmethod
    def set_auto_tune(cls, enabled: Optional[bool]) -> None:
        cls._auto_tune = enabled

    @classmethod
    def auto_tune_enabled(cls) -> bool:
        if cls._auto_tune is not None:
            return cls._auto_tune
        return os.environ.get(AUTO_TUNE, "0") == "1"

    @classmethod
    def reset(cls) -> None:
        """Forget code settings (a fresh process) and every dispatcher's autotune cache, as upstream's does
        (l.381-392); the environment is read at each call anyway."""
        cls._attn_backend = cls._auto_tune = None
        TUNE_CACHE.clear()


TUNE_CACHE: dict[tuple, str] = {}
"""The dispatchers' autotune caches: (dispatcher, upstream's ``make_key``) -> the backend kept (`._fake_dispatch`)."""


def selection_now() -> Selection:
    """What the fake's dispatcher routes a call with: the manager's pin and autotune switch."""
    pinned = GlobalBackendManager.get_attn_backend(PrecisionType.BF16_FP16_FP32)
    selection = Selection(pin=pinned.name if pinned is not None else None,
                          autotune=GlobalBackendManager.auto_tune_enabled())
    return DEFAULT_ORDER if selection == DEFAULT_ORDER else selection


def module(name: str, gluon: bool = False) -> types.ModuleType:
    """``primus_turbo.pytorch.core.backend`` as the fake installs it (``gluon``: with PT #469's ``GLUON``)."""
    _KINDS[:] = [BackendTypeWithGluon if gluon else BackendType]
    mod = types.ModuleType(name)
    mod.GlobalBackendManager = GlobalBackendManager  # type: ignore[attr-defined]
    mod.BackendType = _KINDS[-1]  # type: ignore[attr-defined]
    mod.PrecisionType = PrecisionType  # type: ignore[attr-defined]
    return mod


__all__ = ["BackendType", "GlobalBackendManager", "PrecisionType", "TUNE_CACHE", "module", "selection_now"]
