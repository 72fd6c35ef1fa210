"""Two owners of one key: a Primus with its own ``use_turbo_flex_attention`` path.

Primus's pull request #1033 (open; AMD-AGI/Primus@1c296eb2) adds
``primus/backends/megatron/core/extensions/turbo_flex_attention.py`` and, in its ``primus_turbo``
module config, keys named as primus_ext's: ``use_turbo_flex_attention`` (default false),
``turbo_flex_attention_mask_mod``, ``turbo_flex_attention_score_mod``.  There the key routes
Primus's own ``PrimusTurboAttention`` through Primus-Turbo's flex entries, with Primus's own rules
(it refuses context parallelism, fp8, ``reset_attention_mask``, ...).  With primus_ext's patch
applied, Primus's spec provider builds primus_ext's layers instead and Primus's path never runs;
without it, Primus's runs.  The same YAML would then mean two attentions, so where that file
exists the run must say whose it is: ``turbo_flex_attention_owner: primus_ext | primus``.

Primus's own path is found without importing Primus (its package folder, from
``importlib.util.find_spec``): that file, or the key ``use_turbo_flex_attention`` in Primus's own
``configs/modules/megatron/primus_turbo.yaml`` (wherever the merged code comes to live).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Optional

import yaml

from .. import refusals as R
from ..errors import Reason
from .settings import TurboAttentionSettings

PRIMUS_FLEX_MODULE = "primus.backends.megatron.core.extensions.turbo_flex_attention"
_RELATIVE = Path("backends", "megatron", "core", "extensions", "turbo_flex_attention.py")
_PRIMUS_TURBO_YAML = Path("configs", "modules", "megatron", "primus_turbo.yaml")


def primus_flex_path(package_dir: Optional[str] = None) -> Optional[str]:
    """Where the Primus at ``package_dir`` (its ``primus`` package folder; the importable one when
    None) has its own flex path; None where it has none."""
    if package_dir is not None:
        folders = [package_dir]
    else:
        loaded = sys.modules.get(PRIMUS_FLEX_MODULE)
        if loaded is not None:
            return getattr(loaded, "__file__", None) or PRIMUS_FLEX_MODULE
        try:
            spec = importlib.util.find_spec("primus")
        except (ImportError, ValueError):  # a stand-in package without a spec
            spec = None
        folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / _RELATIVE
        if path.is_file():
            return str(path)
        keys = Path(folder) / _PRIMUS_TURBO_YAML  # the key itself, wherever Primus's code for it lives
        if keys.is_file() and "use_turbo_flex_attention" in _top_level_keys(keys):
            return str(keys)
    return None


def _top_level_keys(path: Path) -> set:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return set()
    return set(data) if isinstance(data, dict) else set()


def gives_key_to_primus(owner: Optional[str], primus_flex: Optional[str]) -> bool:
    """``turbo_flex_attention_owner: primus`` where Primus has its own path to give the key to (without
    one, the owner is refused, and primus_ext's checks still expect its own layers)."""
    return owner == "primus" and primus_flex is not None


def wants_primus_ext(settings: TurboAttentionSettings, primus_flex: Optional[str]) -> bool:
    """The run asks for primus_ext's flex layers: the key is on and not given to Primus's own path."""
    return settings.use_turbo_flex_attention and not gives_key_to_primus(settings.turbo_flex_attention_owner,
                                                                          primus_flex)


def owner_reasons(settings: TurboAttentionSettings, primus_flex: Optional[str]) -> list[Reason]:
    """Why the run's ``use_turbo_flex_attention`` has no single owner: Primus has its own path
    (``primus_flex``, its file) and the owner is not named, or the owner is Primus and it has none."""
    if not settings.use_turbo_flex_attention:
        return []
    owner = settings.turbo_flex_attention_owner
    if primus_flex is not None and owner is None:
        return [R.OWNER_UNNAMED.reason_for(primus_flex=primus_flex)]
    if primus_flex is None and owner == "primus":
        return [R.OWNER_PRIMUS_WITHOUT_PATH.reason_for(module=PRIMUS_FLEX_MODULE)]
    return []


__all__ = ["PRIMUS_FLEX_MODULE", "gives_key_to_primus", "owner_reasons", "primus_flex_path", "wants_primus_ext"]
