"""What a Primus launch reads besides the merged module parameters: the environment its patch
runner sees, with the experiment's own ``env:`` block applied, and the patch filter in it.

Primus's rules, read in its sources (main fd1eeab; ``primus/`` paths):

* ``primus train`` takes the experiment as ``--config`` or ``--exp`` (``core/launcher/parser.py:24-31``;
  argparse, so ``--config=PATH`` and abbreviations such as ``--conf`` work too, and the last given wins).
* ``PrimusRuntime.run_train_module`` loads the configuration, then calls ``_apply_config_env``
  (``core/runtime/train_runtime.py:96-104``) before the backend, the distributed setup or any
  patch: the experiment file itself (``yaml.safe_load``, no ``extends``, no ``${VAR}``
  substitution) is read again, and each key of a top-level ``env:`` mapping, in order, is set
  as ``os.environ[str(key)] = os.path.expandvars(str(value))`` (``:307-358``).  A missing file, a
  missing or empty block does nothing; a block that is no mapping is ignored with a printed line;
  any exception is printed and swallowed, so a key ``os.environ`` rejects (empty, with ``=``, a NUL
  byte) ends the block there, the keys before it set.  So the block wins over the launching shell.
* The patch runner reads ``PRIMUS_PATCHES`` when it runs a phase (``core/patches/patch_runner.py:
  26-39``, ``:89-90``): unset or ``all`` runs every patch, ``none`` none, else the comma-separated
  ids; the others are dropped before any condition is evaluated.

The values are expanded against this module's copy of the environment as it fills, as
``os.path.expandvars`` (CPython's ``posixpath``: ``$name`` / ``${name}``, names of word
characters, unknown names left as written) sees ``os.environ`` while Primus sets the keys.
"""

from __future__ import annotations

import os
import re
from typing import Any, Mapping, Optional, Sequence

import yaml

from .. import refusals as R
from ..errors import Reason

PATCH_ID = "primus_ext.turbo_flex_attention"
"""primus_ext's patch id in Primus's registry (`primus_ext.primus.PATCH_ID`)."""
PRIMUS_PROVIDER_PATCH = "megatron.turbo.te_spec_provider"
"""Primus's own patch that installs its spec provider (when ``enable_primus_turbo``)."""

_CONFIG_FLAGS = ("--config", "--exp")  # train_launcher.py:31-36; parser.py:25-26 gives --exp as an alias
_VARIABLE = re.compile(r"\$(\w+|\{[^}]*\})", re.ASCII)  # posixpath.expandvars


def config_argument(argv: Sequence[str]) -> Optional[str]:
    """The experiment path of a ``primus train ... --config PATH`` command line, as argparse reads it:
    ``--config PATH``, ``--config=PATH``, an abbreviation down to ``--c``, or ``--exp``; the last wins."""
    found = None
    for index, arg in enumerate(argv):
        flag, equals, value = arg.partition("=")
        if flag not in _CONFIG_FLAGS and not (len(flag) >= 3 and "--config".startswith(flag)):
            continue
        if equals:
            found = value
        elif index + 1 < len(argv):
            found = argv[index + 1]
    return found


def _expand(value: str, environ: Mapping[str, str]) -> str:
    def one(match: re.Match) -> str:
        name = match.group(1)
        name = name[1:-1] if name.startswith("{") else name
        return environ.get(name, match.group(0))

    return _VARIABLE.sub(one, value)


def experiment_env(path: Optional[str], environ: Mapping[str, str]) -> dict[str, str]:
    """The variables the experiment's top-level ``env:`` block sets, as Primus sets them (empty where
    Primus would set none: no file, no block, a block that is no mapping, a file it cannot read)."""
    if not path or not os.path.isfile(path):
        return {}
    try:
        with open(path) as handle:  # the locale's encoding, as Primus opens it
            raw: Any = yaml.safe_load(handle) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError):  # Primus prints and goes on
        return {}
    block = raw.get("env") if isinstance(raw, dict) else None
    if not block or not isinstance(block, dict):
        return {}
    seen = dict(environ)
    applied: dict[str, str] = {}
    for key, value in block.items():
        name, text = str(key), _expand(str(value), seen)
        if not name or "=" in name or "\0" in name or "\0" in text:  # os.environ raises: Primus stops there
            break
        seen[name] = applied[name] = text
    return applied


def patch_environment(config: Optional[str], environ: Optional[Mapping[str, str]] = None) -> tuple[dict[str, str], str]:
    """``(environment, where PRIMUS_PATCHES was set)`` for the patches of a run of the experiment at
    ``config``: ``environ`` (the process's when None) with the experiment's ``env:`` block over it."""
    base = dict(os.environ if environ is None else environ)
    block = experiment_env(config, base)
    where = f"set by the env: block of {config}" if "PRIMUS_PATCHES" in block else "in the launching environment"
    return {**base, **block}, where


def enabled_patch_ids(environ: Optional[Mapping[str, str]] = None) -> Optional[set[str]]:
    """The ids ``PRIMUS_PATCHES`` enables, read as Primus reads it: None for all, none for ``none``."""
    raw = (os.environ if environ is None else environ).get("PRIMUS_PATCHES", "").strip()
    if not raw or raw.lower() == "all":
        return None
    if raw.lower() == "none":
        return set()
    return {part.strip() for part in raw.split(",") if part.strip()}


def patch_filter_reasons(environ: Optional[Mapping[str, str]] = None, where: str = "in the environment",
                         ids: Sequence[str] = (PRIMUS_PROVIDER_PATCH, PATCH_ID)) -> list[Reason]:
    """Why ``PRIMUS_PATCHES`` would leave the layers to another attention: it drops one of ``ids``,
    Primus's provider patch (no provider to patch) or primus_ext's (dropped before its condition
    could refuse anything).  ``where`` says where the value was set, for the message."""
    enabled = enabled_patch_ids(environ)
    if enabled is None:
        return []
    value = (os.environ if environ is None else environ).get("PRIMUS_PATCHES")
    missing = [pid for pid in ids if pid not in enabled]
    if not missing:
        return []
    return [R.PATCHES_FILTERED.reason_for(value=repr(value), where=where, missing=" and ".join(missing),
                                          ours=PATCH_ID, provider=PRIMUS_PROVIDER_PATCH)]


__all__ = ["PATCH_ID", "PRIMUS_PROVIDER_PATCH", "config_argument", "enabled_patch_ids", "experiment_env",
           "patch_environment", "patch_filter_reasons"]
