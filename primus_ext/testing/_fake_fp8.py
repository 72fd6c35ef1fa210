"""The fake's fp8 attention: what Primus-Turbo's fp8 Triton attention asserts and returns (``flash_attn_fp8_func``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def check_fp8(name: str, q: Tensor, k: Tensor, v: Tensor, window: tuple) -> None:
    """What Primus-Turbo's fp8 Triton attention asserts (attention_triton_impl.py l.74-78, 350-351, 385-393
    at a6a16cd): the full window, contiguous inputs, head dims of at least 32 and even (its backward; the
    fake asserts in the forward, where the call starts)."""
    if window != (-1, -1):
        raise ValueError(f"{name}: the fp8 kernel only takes window_size=(-1, -1), got {window}")
    if not all(t.is_contiguous() for t in (q, k, v)):
        raise AssertionError(f"{name}: the fp8 attention kernel asserts contiguous q, k and v")
    for t in (q, v):
        if t.shape[-1] < 32 or t.shape[-1] % 2:
            raise AssertionError(f"{name}: the fp8 attention backward asserts head dims >= 32 and even, got "
                                 f"{t.shape[-1]}")


def fp8_output(result: Any) -> Any:
    """fp8 attention returns bf16 whatever the input dtype (attention_triton_impl.py l.89-95 at a6a16cd)."""
    if isinstance(result, tuple):
        return (result[0].to(torch.bfloat16), *result[1:])
    return result.to(torch.bfloat16)


__all__ = ["check_fp8", "fp8_output"]
