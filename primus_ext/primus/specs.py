"""Ready ``ModuleSpec`` objects for Megatron's own ``spec: [module, attr]`` argument: the route
into Primus (or Megatron-LM) that needs no patch.

Megatron-LM's GPT builder imports ``args.spec`` and takes the attribute as it is
(``megatron.core.transformer.spec_utils.import_module`` returns ``vars(module)[name]`` without
calling it), so these are built when this module is imported.  Their core attention is
primus_ext's, built with no ``settings=``: each layer reads the keys from Megatron's parsed
arguments (``megatron.training.get_args()``) when the model is built, where Primus has merged
the module-YAML keys.

* ``gpt_layer_local_spec``: megatron-core's local GPT layer (no TransformerEngine);
* ``gpt_layer_te_spec``: megatron-core's TransformerEngine GPT layer, defined only where
  TransformerEngine imports (Primus's containers).

    spec: [primus_ext.primus.specs, gpt_layer_te_spec]
"""

from __future__ import annotations

from typing import Any

from ..megatron import get_gpt_layer_primus_turbo_local_spec, primus_turbo_te_core_attention, use_core_attention

gpt_layer_local_spec = get_gpt_layer_primus_turbo_local_spec(None)


def _te_spec() -> Any:
    import transformer_engine  # noqa: F401 - the spec below is only built where TE imports
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return use_core_attention(get_gpt_layer_with_transformer_engine_spec(), primus_turbo_te_core_attention(None))


try:
    gpt_layer_te_spec = _te_spec()
except ImportError:  # no TransformerEngine here: only the local spec
    pass

__all__ = ["gpt_layer_local_spec"]
