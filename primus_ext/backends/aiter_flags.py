"""The two flags ``flash_attn_func`` gives AITER's backward, chosen exactly as upstream chooses them.

* ``is_v3_atomic_fp32``: from ``PRIMUS_TURBO_ATTN_V3_ATOMIC_FP32``, "1" by default; "0" turns it
  off and any other value counts as on (``_resolve_is_v3_atomic_fp32_from_env``,
  ``primus_turbo/pytorch/ops/attention/attention_utils.py`` l.18-20 at a6a16cd).
* ``how_v3_bf16_cvt``: 0 at compute capability >= 9.5 (gfx950), else 1 (``FlashAttnFunc.forward``,
  ``flash_attn_interface.py`` l.162-163).

A compiled step calls the kernel-level backward itself (`turbo_kernels`), so it must pass what
an eager step's autograd would: otherwise the two run different kernels on gfx950.
"""

from __future__ import annotations

import os
from typing import Optional

V3_ATOMIC_FP32_ENV = "PRIMUS_TURBO_ATTN_V3_ATOMIC_FP32"


def v3_flags(arch: Optional[str]) -> tuple[bool, int]:
    """``(is_v3_atomic_fp32, how_v3_bf16_cvt)`` for a backward on ``arch``, read now from the environment."""
    value = os.environ.get(V3_ATOMIC_FP32_ENV, "1")
    atomic = value == "1" if value in ("0", "1") else True
    return atomic, 0 if arch == "gfx950" else 1


__all__ = ["V3_ATOMIC_FP32_ENV", "v3_flags"]
