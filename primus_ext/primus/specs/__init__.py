"""``ModuleSpec`` objects for Megatron's own ``spec: [module, attr]`` argument: the route into
Primus (or Megatron-LM) that needs no patch.

Megatron-LM's GPT builder imports ``args.spec`` and takes the attribute as it is
(``megatron.core.transformer.spec_utils.import_module``: ``__import__(module, ..., [attr])``, then
``vars(module)[attr]``, never called).  For a package, ``__import__`` asks for each name of its
from-list first (``importlib._bootstrap._handle_fromlist``: ``hasattr``, which reaches the
module's ``__getattr__``); that is why this is a package, and where these are built: from the run's parsed arguments (``megatron.training.get_args()``), through
the megatron-core spec function Megatron's builder would call for a dense model without ``spec``
(``get_gpt_layer_local_spec`` / ``get_gpt_layer_with_transformer_engine_spec``), with the arguments
the builder passes it (``qk_layernorm``, ``qk_l2_norm``, ``normalization``, ``multi_latent_attention``,
...), by name, and primus_ext's core attention.  The spec is then kept in the
module for the builder's ``vars()`` read (one dense layer spec serves every pipeline stage).

* ``gpt_layer_local_spec``: megatron-core's local GPT layer (no TransformerEngine);
* ``gpt_layer_te_spec``: megatron-core's TransformerEngine GPT layer (where TransformerEngine imports).

    spec: [primus_ext.primus.specs, gpt_layer_te_spec]

A run the builder would give another block refuses (our error, out of the builder): MoE
(``num_experts``: a decoder block spec per pipeline stage), MTP (``mtp_num_layers``: the builder
builds those layers from megatron-core's own specs), Kitchen, a heterogeneous or experimental
layer config, ``transformer_impl: inference_optimized``, a spec function that would not take a
setting the run makes, no TransformerEngine for the TE spec, or no parsed arguments at all.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from ... import refusals as R
from ...errors import Reason, short_repr

_CONTEXT = "primus_ext.primus.specs"

SPECS = ("gpt_layer_local_spec", "gpt_layer_te_spec")
_FROM_ARGS = {
    # the spec function's parameters Megatron-LM's builder fills from the args (gpt_builders.py,
    # `_get_transformer_layer_spec`), by name: megatron-core 0.16.1 names them, the Megatron-LM
    # Primus bundles (d3528a21) takes ``*args, **kwargs`` and passes them on
    "gpt_layer_local_spec": ("num_experts", "moe_grouped_gemm", "qk_layernorm", "multi_latent_attention",
                             "moe_use_legacy_grouped_gemm", "normalization", "qk_l2_norm"),
    "gpt_layer_te_spec": ("num_experts", "moe_grouped_gemm", "qk_layernorm", "multi_latent_attention",
                          "moe_use_legacy_grouped_gemm", "qk_l2_norm", "use_te_op_fuser", "use_te_activation_func"),
}


def _spec_function(name: str) -> Callable[..., Any]:
    from megatron.core.models.gpt import gpt_layer_specs

    if name == "gpt_layer_te_spec":
        import transformer_engine  # noqa: F401 - an ImportError here is the attribute's absence

        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec
    return gpt_layer_specs.get_gpt_layer_local_spec


def _refusals(name: str, args: Any) -> list[Reason]:
    """What the dense layer spec cannot express, read as Megatron's builder branches on it."""
    alternative = ("remove spec: (Primus's spec provider then builds every layer, MoE and MTP included, with "
                   "primus_ext's attention through the patch: python -m primus_ext.primus, docs/primus.md)")
    reasons = []
    checks = (
        ("num_experts", bool(getattr(args, "num_experts", None)), "a MoE model: Megatron's builder gives it a "
         "decoder block spec of its own per pipeline stage, which one layer spec cannot be"),
        ("mtp_num_layers", getattr(args, "mtp_num_layers", None) is not None, "MTP layers: with spec: set, "
         "Megatron-LM's builder builds them from megatron-core's own layer specs (not this one), and its "
         "use_transformer_engine is then unset"),
        ("kitchen_config_file", getattr(args, "kitchen_config_file", None) is not None, "Kitchen: Megatron's "
         "builder takes use_kitchen from the TransformerConfig, which this spec does not see"),
        ("heterogeneous_layers_config_path", getattr(args, "heterogeneous_layers_config_path", None) is not None,
         "a heterogeneous layer config: Megatron's builder builds a spec per layer from it"),
        ("experimental_attention_variant", getattr(args, "experimental_attention_variant", None) is not None,
         "an experimental attention variant: Megatron's builder builds its own block spec"),
        ("transformer_impl", getattr(args, "transformer_impl", None) == "inference_optimized",
         "the inference-optimized layer spec"),
    )
    for key, hit, what in checks:
        if hit:
            reasons.append(R.SPEC_FOREIGN_MODEL.reason_for(key=key, name=name, value=short_repr(getattr(args, key)),
                                                           what=what, alternative=alternative))
    return reasons


def build_spec(name: str, args: Any) -> Any:
    """The spec ``name`` for Megatron's parsed ``args``, or our error naming what it cannot express."""
    from ...megatron import primus_turbo_te_core_attention, use_core_attention
    from ...megatron.specs import PrimusTurboLocalSpecProvider

    if args is None:
        raise R.refuse_build(R.SPEC_NO_ARGS, _CONTEXT, name=name)
    reasons = _refusals(name, args)
    if reasons:
        raise R.refuse_all(reasons, context=_CONTEXT)
    function = _spec_function(name)
    parameters = inspect.signature(function).parameters
    open_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    kwargs = {key: getattr(args, key) for key in _FROM_ARGS[name] if getattr(args, key, None) is not None}
    lost = [key for key, value in kwargs.items() if key not in parameters and not open_kwargs and value]
    if lost:  # a megatron-core whose spec function has another signature: never drop a setting
        raise R.refuse_all([R.SPEC_LOST_KEYS.reason_for(function=f"{function.__name__}{inspect.signature(function)}",
                                                    lost=lost, lost_text=", ".join(lost))], context=_CONTEXT)
    kwargs = {key: value for key, value in kwargs.items() if key in parameters or open_kwargs}
    core = (primus_turbo_te_core_attention(None) if name == "gpt_layer_te_spec"
            else PrimusTurboLocalSpecProvider(None).core_attention())
    return use_core_attention(function(**kwargs), core)


def __getattr__(name: str) -> Any:
    if name not in SPECS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from ...megatron.args import megatron_args

    try:
        spec = build_spec(name, megatron_args())
    except ImportError as exc:  # an AttributeError here would become Megatron's bare KeyError
        raise R.refuse_build(R.SPEC_NO_TE, _CONTEXT, name=name, error=f"{type(exc).__name__}: {exc}") from None
    globals()[name] = spec  # Megatron's import_module reads it with vars() right after
    return spec


__all__ = ["SPECS", "build_spec"]
