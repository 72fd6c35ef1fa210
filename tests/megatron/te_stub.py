"""A minimal stand-in for TransformerEngine, for the CPU tests of `PrimusTurboAttention`.

TransformerEngine cannot be installed here: it needs CUDA or ROCm to build and has
no CPU wheel.  `PrimusTurboAttention` is a subclass of
``transformer_engine.pytorch.DotProductAttention`` whose forward never calls the
base class (the Primus-Turbo core does the work), so what the tests need from TE is
only the shell: a ``torch.nn.Module`` that accepts TE's constructor keywords.  That
is what this module provides, and *that is what the CPU tests do*: they put a
``transformer_engine`` package and its ``transformer_engine.pytorch`` submodule
holding `DotProductAttention` below into ``sys.modules`` for the duration of a test
(`installed_te_stub`), then restore whatever was there before.  On a ROCm machine
the real TransformerEngine is used instead and this file plays no part.

The stand-in records the keywords it was built with (``te_kwargs``) so a test can
check what the subclass handed to TE, and its forward refuses to run, so a subclass
that fell through to "TE's" forward would fail loudly instead of computing
something.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types
from typing import Any, Iterator, Optional

import torch

NAMES = ("transformer_engine", "transformer_engine.pytorch")


class DotProductAttention(torch.nn.Module):
    """TE's ``DotProductAttention`` constructor contract, with nothing behind it."""

    def __init__(self, num_attention_heads: int, kv_channels: Any, num_gqa_groups: Optional[int] = None,
                 attention_dropout: float = 0.0, qkv_format: str = "sbhd", attn_mask_type: str = "causal",
                 tp_size: int = 1, tp_group: Any = None, layer_number: Optional[int] = None,
                 attention_type: str = "self", softmax_scale: Optional[float] = None, **kwargs: Any) -> None:
        super().__init__()
        self.te_kwargs = dict(
            num_attention_heads=num_attention_heads, kv_channels=kv_channels, num_gqa_groups=num_gqa_groups,
            attention_dropout=attention_dropout, qkv_format=qkv_format, attn_mask_type=attn_mask_type,
            tp_size=tp_size, tp_group=tp_group, layer_number=layer_number, attention_type=attention_type,
            softmax_scale=softmax_scale, **kwargs,
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("stand-in TransformerEngine has no attention kernels; the subclass must not "
                           "call DotProductAttention.forward")


def _module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__path__ = []  # type: ignore[attr-defined]
    module.__te_stub__ = True  # type: ignore[attr-defined]
    return module


def stub_modules(base: type = DotProductAttention) -> dict[str, types.ModuleType]:
    """Fresh ``transformer_engine`` and ``transformer_engine.pytorch`` module objects."""
    root, pytorch = _module(NAMES[0]), _module(NAMES[1])
    root.__version__ = "0.0.0+cpu.stub"  # type: ignore[attr-defined]
    pytorch.DotProductAttention = base  # type: ignore[attr-defined]
    root.pytorch = pytorch  # type: ignore[attr-defined]
    return dict(zip(NAMES, (root, pytorch)))


def _owned(key: str) -> bool:
    return key == NAMES[0] or key.startswith(NAMES[0] + ".")


@contextlib.contextmanager
def installed_te_stub(base: type = DotProductAttention) -> Iterator[types.ModuleType]:
    """Install the stand-in for the ``with`` block; yield ``transformer_engine.pytorch``.

    Every ``transformer_engine*`` entry of ``sys.modules`` present before (a real TE,
    or a ``None`` blocker) is put back afterwards, and any added inside is dropped.
    """
    saved = {k: v for k, v in sys.modules.items() if _owned(k)}
    for key in saved:
        del sys.modules[key]
    modules = stub_modules(base)
    sys.modules.update(modules)
    try:
        yield modules[NAMES[1]]
    finally:
        for key in [k for k in sys.modules if _owned(k)]:
            del sys.modules[key]
        sys.modules.update(saved)


__all__ = ["DotProductAttention", "installed_te_stub", "stub_modules"]
