"""A CPU stand-in for the parts of Megatron-LM's training package (not in megatron-core's wheel)
that decide which layer spec a run builds, written from Megatron-LM's sources:

* ``megatron.training.get_args()`` returns the parsed arguments once ``initialize_megatron`` ran
  (``megatron/training/global_vars.py``); Primus's Megatron trainer runs it before the model is
  built (Primus ``backends/megatron/megatron_pretrain_trainer.py:45``).
* ``gpt_builder`` (``gpt_builders.py``): with ``args.spec`` set, the layer spec is
  ``megatron.core.transformer.spec_utils.import_module(args.spec)``, taken as it is; otherwise the
  spec provider's (here `primus_ext.testing.fake_primus.layer_spec`).
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Any, Iterator

_ABSENT = object()


@contextlib.contextmanager
def parsed_args(args: Any) -> Iterator[types.ModuleType]:
    """``megatron.training`` with ``get_args()`` returning ``args`` for the block (restored after)."""
    module = types.ModuleType("megatron.training")
    module.get_args = lambda: args
    saved = sys.modules.get("megatron.training", _ABSENT)
    sys.modules["megatron.training"] = module
    try:
        yield module
    finally:
        if saved is _ABSENT:
            sys.modules.pop("megatron.training", None)
        else:
            sys.modules["megatron.training"] = saved


def builder_layer_spec(args: Any) -> Any:
    """The layer spec Megatron-LM's ``gpt_builder`` hands ``GPTModel`` for ``args``."""
    from megatron.core.transformer.spec_utils import import_module

    from .fake_primus import layer_spec

    spec = getattr(args, "spec", None)
    return import_module(tuple(spec)) if spec else layer_spec()


__all__ = ["builder_layer_spec", "parsed_args"]
