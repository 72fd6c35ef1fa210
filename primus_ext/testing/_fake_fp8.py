"""The fake's fp8 attention: what Primus-Turbo's fp8 Triton attention asserts and returns (``flash_attn_fp8_func``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..backends.layout import infer_qkv_format

# flash_attn_fp8_func permutes q, k and v stored other than bshd by these orders and copies them
# contiguous, then its kernel reads the copies as bshd (flash_attn_interface.py l.505-565 at a6a16cd).
_WRAPPER_PERMUTES = {"sbhd": (1, 0, 2, 3), "bhsd": (0, 2, 1, 3)}


def fp8_layout(q: Tensor, k: Tensor, v: Tensor) -> tuple:
    """q, k, v as flash_attn_fp8_func hands them to its kernel, and the order its output is permuted back by.

    For sbhd memory the wrapper's permute puts the batch where the kernel reads the sequence (and for
    bhsd the heads), so upstream computes another attention, silently: the fake does the same, and the
    plan stores fp8 inputs contiguous bshd, the one layout the wrapper leaves as it is."""
    perm = _WRAPPER_PERMUTES.get(infer_qkv_format(q, k, v))
    if perm is None:
        return q, k, v, None
    return (*(t.permute(*perm).contiguous() for t in (q, k, v)), perm)


def fp8_unpermute(result: Any, perm: Any) -> Any:
    """The wrapper's permute of the output back to its caller's order (both orders are their own inverse)."""
    if perm is None:
        return result
    if isinstance(result, tuple):
        return (result[0].permute(*perm).contiguous(), *result[1:])
    return result.permute(*perm).contiguous()


def check_fp8(name: str, q: Tensor, k: Tensor, v: Tensor, window: tuple) -> None:
    """What Primus-Turbo's fp8 Triton attention asserts (attention_triton_impl.py l.74-78, 350-351, 385-393
    at a6a16cd) on the tensors its wrapper hands it (`fp8_layout`): the full window, contiguous inputs,
    head dims of at least 32 and even (its backward; the fake asserts in the forward, where the call starts)."""
    if window != (-1, -1):
        raise AssertionError(f"{name}: in triton attn kernel, window_size_left and window_size_right must be -1, "
                             f"got {window}")
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


__all__ = ["check_fp8", "fp8_layout", "fp8_output", "fp8_unpermute"]
