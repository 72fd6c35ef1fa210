"""Spec providers: settings reach the attention modules explicitly, not through globals."""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from .. import refusals as R
from ..errors import Reason
from ..settings import TurboAttentionSettings
from ..settings.primus_placement import yaml_value
from .local import PrimusTurboLocalAttention


class PrimusTurboLocalSpecProvider(LocalSpecProvider):
    """megatron-core's local provider whose core attention is Turbo attention bound to ``settings``."""

    def __init__(self, settings: Optional[TurboAttentionSettings] = None) -> None:
        super().__init__()
        self.settings = settings

    def core_attention(self) -> Callable[..., Any]:
        if self.settings is not None and not _turbo_on(self.settings):
            off = turbo_off_reasons(self.settings)
            if off:
                raise R.refuse_all(off, context="spec provider")
            return super().core_attention()  # use_turbo_attention: false -> Megatron's own attention
        return functools.partial(PrimusTurboLocalAttention, settings=self.settings)


TURBO_ONLY = (("use_sink_attention", "learned sink"), ("sink_sliding_window", "sink sliding window"),
              ("enable_turbo_attention_float8", "Primus-Turbo fp8 attention"),
              ("packed_shared_prefix", "shared-prefix rows"))
"""Settings only Turbo layers read, with what Megatron's own attention lacks of them."""


def turbo_off_reasons(settings: TurboAttentionSettings) -> list[Reason]:
    """A ``turbo-off`` reason per Turbo-only setting asked for while both switches are off (the layers are then
    Megatron's own, which would ignore it)."""
    if _turbo_on(settings):
        return []
    return [R.TURBO_OFF.reason_for(key=key, value=yaml_value(getattr(settings, key)), what=what)
            for key, what in TURBO_ONLY if getattr(settings, key)]


def _turbo_on(settings: TurboAttentionSettings) -> bool:
    """Turbo attention is asked for; with neither switch on, the layer stays Megatron's own.
    (``use_turbo_flex_attention`` without ``use_turbo_attention`` is built, and refused, B3.)"""
    return settings.use_turbo_attention or settings.use_turbo_flex_attention


def use_core_attention(layer_spec: ModuleSpec, core_attention: Callable[..., Any]) -> ModuleSpec:
    """Put ``core_attention`` into a transformer-layer spec built by megatron-core."""
    layer_spec.submodules.self_attention.submodules.core_attention = core_attention
    return layer_spec


def get_gpt_layer_primus_turbo_local_spec(settings: Optional[TurboAttentionSettings] = None,
                                          **kwargs: Any) -> ModuleSpec:
    """megatron-core's ``get_gpt_layer_local_spec(**kwargs)`` with Turbo core attention."""
    provider = PrimusTurboLocalSpecProvider(settings)
    return use_core_attention(get_gpt_layer_local_spec(**kwargs), provider.core_attention())


def primus_turbo_te_core_attention(settings: Optional[TurboAttentionSettings] = None) -> Callable[..., Any]:
    """The TransformerEngine-based Turbo core attention bound to ``settings`` (imports TE)."""
    from .te import te_attention_class

    return functools.partial(te_attention_class(), settings=settings)


__all__ = [
    "PrimusTurboLocalSpecProvider",
    "get_gpt_layer_primus_turbo_local_spec",
    "primus_turbo_te_core_attention",
    "turbo_off_reasons",
    "use_core_attention",
]
