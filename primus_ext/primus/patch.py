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
import itertools
import sys
import weakref
from typing import Any, Callable

from .. import refusals as R
from ..errors import Reason
from ..settings import TurboAttentionSettings
from ..settings.primus_config import args_settings, run_reasons, switch_reasons
from ..settings.primus_launch import PATCH_ID, PRIMUS_PROVIDER_PATCH
from ..settings.primus_owner import owner_reasons, primus_flex_path, wants_primus_ext
from .layer_check import note_condition

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


def _args(ctx: Any) -> Any:
    """Megatron's arguments as Primus's own ``get_args(ctx)`` gives them to its patches."""
    getter = getattr(sys.modules.get("primus.core.patches"), "get_args", None)
    if getter is not None:
        return getter(ctx)
    extra = getattr(ctx, "extra", None) or {}
    return extra.get("backend_args", extra.get("args"))


def applies(ctx: Any) -> bool:
    """The patch's condition: ``use_turbo_flex_attention`` is set and not given to Primus's own flex path
    (``turbo_flex_attention_owner: primus``).  Raises our error for everything
    that would leave the layers on another attention (Primus runs conditions outside its ``try``,
    so this reaches the user): a key that does not check, Primus's spec provider missing, or not
    installed by Primus in this run (``enable_primus_turbo`` off, its patch filtered out), a key two
    owners claim (`primus_ext.settings.primus_owner`), and a
    ``load`` checkpoint of Primus's learned sinks not converted for primus_ext."""
    args = _args(ctx)
    if args is None:
        return False
    settings = args_settings(args)  # every key, look-alikes too, as the layers read them
    primus_flex = primus_flex_path()  # Primus's own flex path may claim the key
    note_condition(wants_primus_ext(settings, primus_flex))  # the launcher's check of the built model reads it
    if not settings.use_turbo_flex_attention:
        return False
    reasons = owner_reasons(settings, primus_flex)
    if wants_primus_ext(settings, primus_flex):
        reasons += switch_reasons(getattr(args, "enable_primus_turbo", False))  # `primus-ext check` applies it too
        reasons += _provider_gates(getattr(ctx, "backend_version", None))
        reasons += run_reasons(_values(args))
    if reasons:
        raise R.refuse_all(reasons, context="Primus patch")
    if not wants_primus_ext(settings, primus_flex):  # turbo_flex_attention_owner: primus
        return False
    _provider()
    # Imported here, not at the top: the launcher registers the patch before Primus puts its bundled
    # Megatron-LM on sys.path, and megatron must not be imported before that.
    from ..megatron.checkpoint import check_load_checkpoint

    check_load_checkpoint(args)  # an unconverted Primus checkpoint would load no (or zero) sinks
    return True


PROVIDER_MEGATRON_BELOW = (0, 17)
"""Primus's provider patch is registered with ``backend_versions=["<0.17"]``
(``patches/turbo/te_spec_provider_patches.py``)."""


def _provider_gates(backend_version: Any) -> list[Reason]:
    """Why Primus's own provider patch would skip this run although ``enable_primus_turbo`` is set:
    its condition wants an importable ``primus_turbo``, and its version filter megatron-core below
    0.17 (a run without a known version fails the filter, as Primus's ``version_in_range`` has it).
    Skipped, Primus logs it and builds TransformerEngine's attention: here it is refused instead."""
    reasons = []
    if not _importable("primus_turbo"):
        reasons.append(R.PRIMUS_NO_TURBO.reason_for(patch=PRIMUS_PROVIDER_PATCH))
    version = _leading_ints(backend_version)
    if version is None or version[:2] >= PROVIDER_MEGATRON_BELOW:
        reasons.append(R.PRIMUS_MEGATRON_VERSION.reason_for(version=backend_version or '(unknown)',
                                                             patch=PRIMUS_PROVIDER_PATCH))
    return reasons


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a module in sys.modules without a spec (a stand-in) counts
        return name in sys.modules


def _leading_ints(version: Any) -> Any:
    """``"0.16.1rc0"`` -> ``(0, 16, 1)``; None when it does not start with a number."""
    parts = []
    for part in str(version or "").split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) if len(parts) >= 2 else None


def _values(args: Any) -> dict:
    try:
        return dict(vars(args))
    except TypeError:
        return {}


def install(ctx: Any) -> None:
    """The handler: every layer Primus's spec provider builds gets primus_ext's core attention,
    bound to the settings of this run's arguments."""
    settings = args_settings(_args(ctx))
    _provider().core_attention = _core_attention(settings)


def _provider() -> Any:
    try:
        return importlib.import_module(SPEC_PROVIDER).PrimusTurboSpecProvider
    except (ImportError, AttributeError) as exc:
        raise R.refuse_build(R.PRIMUS_PROVIDER, "Primus patch", provider=f"{SPEC_PROVIDER}.PrimusTurboSpecProvider",
                             error=f"{type(exc).__name__}: {exc}") from None


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
