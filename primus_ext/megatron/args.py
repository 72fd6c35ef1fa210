"""Settings from Megatron's command line, without globals in the modules.

Modules receive `TurboAttentionSettings` explicitly (spec providers bind them).  For
Primus, where modules are built from Megatron's global args, a module built with no
settings reads them from ``megatron.training.get_args()`` when that exists.
`add_turbo_attention_args` is an ``extra_args_provider`` adding every key as a flag.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Optional

from ..settings import TurboAttentionSettings, describe_keys
from ..settings.primus_config import args_settings


def megatron_args() -> Optional[Any]:
    """Megatron-LM's parsed arguments (`megatron.training.get_args()`), or None where there are none."""
    try:
        from megatron.training import get_args  # not part of the megatron-core wheel
    except ImportError:
        return None
    try:
        return get_args()
    except Exception:  # args not parsed yet (e.g. a unit test building a layer)
        return None


def megatron_arg(name: str, default: Any = None) -> Any:
    """One Megatron command-line argument, or ``default`` outside a Megatron-LM run."""
    args = megatron_args()
    value = getattr(args, name, None) if args is not None else None
    return default if value is None else value


def settings_or_megatron_args(settings: Optional[TurboAttentionSettings]) -> TurboAttentionSettings:
    """The given settings; else those of Megatron-LM's parsed args (read as the Primus patch reads them:
    Primus's own keys pass, a mapping Primus made a namespace is read as one); else the defaults."""
    if settings is not None:
        return settings
    args = megatron_args()
    return args_settings(args) if args is not None else TurboAttentionSettings()


def with_megatron_flags(settings: TurboAttentionSettings, config: Any) -> TurboAttentionSettings:
    """Settings plus the Megatron flags that mean the same thing.

    ``reset_attention_mask`` and ``deterministic_mode`` are Megatron-LM arguments too
    (``deterministic_mode`` also a ``TransformerConfig`` field).  When Megatron turns
    one on, the plan must see it even if the Turbo settings were passed explicitly;
    otherwise a run could build with document boundaries silently ignored.
    """
    changes = {}
    if not settings.reset_attention_mask and megatron_arg("reset_attention_mask", False):
        changes["reset_attention_mask"] = True
    if not settings.deterministic_mode and (
        getattr(config, "deterministic_mode", False) or megatron_arg("deterministic_mode", False)
    ):
        changes["deterministic_mode"] = True
    return settings.replace(**changes) if changes else settings


def _optional_bool(text: str) -> Optional[bool]:
    """``true`` / ``false`` / ``null`` on the command line, as the YAML writes them."""
    value = {"true": True, "false": False, "null": None, "none": None}.get(text.strip().lower(), text)
    if isinstance(value, str):
        raise argparse.ArgumentTypeError(f"expected true, false or null, got {text!r}")
    return value


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def add_turbo_attention_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider``: one flag per settings key, dest = the YAML key.

    Booleans are switches (``--use-turbo-flex-attention``; one on by default also has
    ``--no-...``, as ``--no-sink-window-even-layers-only``); hook kwargs take JSON.  A flag
    the parser already has with the same dest is shared, not added again: Megatron-LM
    defines ``--reset-attention-mask`` and ``--deterministic-mode`` itself before it
    calls the extra_args_provider, and argparse refuses a second definition.
    """
    group = parser.add_argument_group("primus_ext turbo attention")
    existing = parser._option_string_actions  # argparse's flag -> action table
    for key, type_text, default, doc in describe_keys():
        known = existing.get(_flag(key))
        if known is not None and known.dest == key:
            continue
        help_text = f"{doc} (default: {default})"
        if isinstance(default, bool) and default:  # on by default: --no-<key> turns it off
            group.add_argument(_flag(key), dest=key, action=argparse.BooleanOptionalAction, default=default,
                               help=help_text)
        elif isinstance(default, bool):
            group.add_argument(_flag(key), dest=key, action="store_true", default=default, help=help_text)
        elif type_text == "bool | null":
            group.add_argument(_flag(key), dest=key, type=_optional_bool, default=default,
                               help=help_text + " true, false or null.")
        elif key.endswith("_kwargs"):
            group.add_argument(_flag(key), dest=key, type=json.loads, default=default, help=help_text + " JSON.")
        elif isinstance(default, int) or type_text == "int | null":
            group.add_argument(_flag(key), dest=key, type=int, default=default, help=help_text)
        else:
            group.add_argument(_flag(key), dest=key, type=str, default=default, help=help_text)
    return parser


__all__ = ["add_turbo_attention_args", "megatron_arg", "megatron_args", "settings_or_megatron_args", "with_megatron_flags"]
