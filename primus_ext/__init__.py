"""primus_ext: Primus-Turbo attention for Megatron-LM, driven by YAML settings.

`hook_factory` is exported here because users decorate their own hook factories with it
(``@primus_ext.hook_factory``): a config may only call a factory that opted in (B32).  It is
imported on first use, so ``primus-ext`` can say what it is loading before torch is imported.
"""

from typing import Any

__all__ = ["hook_factory"]


def __getattr__(name: str) -> Any:
    if name == "hook_factory":
        from .attention.library import hook_factory

        return hook_factory
    raise AttributeError(f"module 'primus_ext' has no attribute {name!r}")
