"""primus_ext: Primus-Turbo attention for Megatron-LM, driven by YAML settings.

`hook_factory` is exported here because users decorate their own hook factories with it
(``@primus_ext.hook_factory``): a config may only call a factory that opted in (B32).
"""

from .attention.library import hook_factory

__all__ = ["hook_factory"]
