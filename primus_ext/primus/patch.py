"""The Primus patch: Primus's spec provider builds primus_ext's Turbo attention.

Registered with Primus's registry (`register`) as ``primus_ext.turbo_flex_attention``: backend
``megatron``, phase ``before_train``, priority 42 (after Primus's own
``megatron.turbo.te_spec_provider``, 41, which installs the provider).  It applies when
``use_turbo_flex_attention`` is true; with only ``use_turbo_attention`` Primus's own attention
runs and primus_ext stays out.

Primus logs and swallows an exception a patch *handler* raises and trains on with its own
attention, but evaluates the *condition* outside that ``try``.  So everything that can fail is
done in the condition (the settings are read and checked, the spec provider is found); the
handler only rebinds ``PrimusTurboSpecProvider.core_attention``.  A configuration the plan
refuses (``use_turbo_flex_attention`` without ``use_turbo_attention``, B3, among the rest) is
refused when the model is built, by primus_ext's own module, outside the patch runner.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
import weakref
from typing import Any, Callable

from ..errors import Reason, UnsupportedConfigError
from ..megatron.checkpoint import check_load_checkpoint
from ..settings import TurboAttentionSettings

PATCH_ID = "primus_ext.turbo_flex_attention"
PRIORITY = 42
SPEC_PROVIDER = "primus.backends.megatron.core.extensions.transformer_engine_spec_provider"
_REGISTERED: "weakref.WeakSet[Any]" = weakref.WeakSet()  # the registry modules registered with (by identity)


def register() -> bool:
    """Register the patch with Primus's registry once per process; False when Primus is not importable."""
    try:
        patches = importlib.import_module("primus.core.patches")
    except ImportError:
        return False
    if patches in _REGISTERED:
        return True
    patches.register_patch(PATCH_ID, description="primus_ext: Turbo attention from FlexAttention masks",
                           backend="megatron", phase="before_train", condition=applies, priority=PRIORITY)(install)
    _REGISTERED.add(patches)
    return True


PRIMUS_PROVIDER_PATCH = "megatron.turbo.te_spec_provider"
"""Primus's own patch that installs its spec provider (when ``enable_primus_turbo``)."""


def _args(ctx: Any) -> Any:
    """Megatron's arguments as Primus's own ``get_args(ctx)`` gives them to its patches."""
    getter = getattr(sys.modules.get("primus.core.patches"), "get_args", None)
    if getter is not None:
        return getter(ctx)
    extra = getattr(ctx, "extra", None) or {}
    return extra.get("backend_args", extra.get("args"))


def applies(ctx: Any) -> bool:
    """The patch's condition: ``use_turbo_flex_attention`` is set.  Raises our error for everything
    that would leave the layers on another attention (Primus runs conditions outside its ``try``,
    so this reaches the user): a key that does not check, Primus's spec provider missing, or not
    installed by Primus in this run (``enable_primus_turbo`` off, its patch filtered out), and a
    ``load`` checkpoint of Primus's learned sinks not converted for primus_ext."""
    args = _args(ctx)
    if args is None:
        return False
    settings = TurboAttentionSettings.from_args(args)  # every key, look-alikes too, as the layers read them
    if not settings.use_turbo_flex_attention:
        return False
    reasons = []
    if not getattr(args, "enable_primus_turbo", False):
        reasons.append(Reason(
            ("enable_primus_turbo", "use_turbo_flex_attention"),
            "use_turbo_flex_attention is true but enable_primus_turbo is not: Primus then does not install its spec "
            "provider, and the layers would be built with TransformerEngine's attention, not primus_ext's.",
            "set enable_primus_turbo: true (Primus's switch) with use_turbo_attention: true.", "primus-enable"))
    enabled = _enabled_patch_ids()
    if enabled is not None and PRIMUS_PROVIDER_PATCH not in enabled:
        reasons.append(Reason(
            ("PRIMUS_PATCHES",), f"PRIMUS_PATCHES enables only {sorted(enabled)}, without Primus's "
            f"{PRIMUS_PROVIDER_PATCH}: its spec provider would not be installed, and the layers would not be "
            "primus_ext's.", f"add {PRIMUS_PROVIDER_PATCH} (and {PATCH_ID}) to PRIMUS_PATCHES, or unset it.",
            "primus-enable"))
    if reasons:
        raise UnsupportedConfigError(reasons, context="Primus patch")
    _provider()
    check_load_checkpoint(args)  # an unconverted Primus checkpoint would load no (or zero) sinks
    return True


def _enabled_patch_ids() -> Any:
    """The ids ``PRIMUS_PATCHES`` enables, read as Primus reads it: None for all (unset, ``all``)."""
    raw = os.environ.get("PRIMUS_PATCHES", "").strip()
    if not raw or raw.lower() == "all":
        return None
    if raw.lower() == "none":
        return set()
    return {part.strip() for part in raw.split(",") if part.strip()}


def install(ctx: Any) -> None:
    """The handler: every layer Primus's spec provider builds gets primus_ext's core attention,
    bound to the settings of this run's arguments."""
    settings = TurboAttentionSettings.from_args(_args(ctx))
    _provider().core_attention = _core_attention(settings)


def _provider() -> Any:
    try:
        return importlib.import_module(SPEC_PROVIDER).PrimusTurboSpecProvider
    except (ImportError, AttributeError) as exc:
        raise UnsupportedConfigError(Reason(
            ("use_turbo_flex_attention",), f"Primus's spec provider ({SPEC_PROVIDER}.PrimusTurboSpecProvider) was "
            f"not found ({type(exc).__name__}: {exc}); the patch could not make it build primus_ext's attention, "
            "and Primus would train with its own.",
            "use a Primus version with that spec provider (docs/primus.md), or Megatron's own spec argument with "
            "primus_ext.primus.specs (no patch).", "primus-provider"), context="Primus patch") from None


def _core_attention(settings: TurboAttentionSettings) -> Callable[[Any], Any]:
    """``core_attention(self)`` for the provider: TransformerEngine's module where TE is importable
    (Primus's own provider builds TE layers), megatron-core's local one elsewhere."""
    def core_attention(self: Any) -> Any:
        from ..megatron import PrimusTurboLocalAttention, primus_turbo_te_core_attention

        if importlib.util.find_spec("transformer_engine") is not None:
            return primus_turbo_te_core_attention(settings)
        return functools.partial(PrimusTurboLocalAttention, settings=settings)

    return core_attention


__all__ = ["PATCH_ID", "PRIORITY", "SPEC_PROVIDER", "applies", "install", "register"]
