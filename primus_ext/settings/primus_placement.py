"""What a merged Primus experiment tells its user beyond its parameters: the keys Primus and primus_ext
both define, where each key the plans read was set, and the keys written where Primus does not apply them.

A key at an experiment's top level other than `primus_config.TOP_KEYS` reaches no module, a key written
beside a module's ``config:`` / ``model:`` is dropped where the module preset sets it (Primus main fd1eeab,
``core/launcher/parser.py:284-301``), and so is a model file's key the module file sets (``parser.py:320``).  Either way the file says one value and the run gets another.  For a
key the attention plans read (a Turbo key or a model-shape key) whose value differs from what the run gets,
that is a refusal (``primus-ignored``): the user asked for an attention the run would not compute.  Any other
misplaced key is listed, not refused: it is not ours to judge, but it is not silent either.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from .. import refusals as R
from ..errors import Reason, short_repr
from .model_keys import READERS
from .primus_config import TOP_KEYS, PrimusExperiment, _Reader
from .settings import SETTING_KEYS, TurboAttentionSettings
from .yaml_file import MODEL_KEYS

PRIMUS_TURBO_YAML = "modules/megatron/primus_turbo.yaml"
"""Primus's module file of its Turbo keys, under its ``configs`` folder."""
PLANNED_KEYS = frozenset(SETTING_KEYS) | frozenset(READERS) | frozenset(MODEL_KEYS)
"""The keys a layer's plan reads: primus_ext's settings and Megatron's model-shape keys."""


def yaml_value(value: Any) -> str:
    """A value as a YAML shows it (``true``, ``null``), for a report."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return short_repr(value)


@dataclass(frozen=True)
class SharedKey:
    """A key both Primus's ``primus_turbo.yaml`` and primus_ext's module config define."""

    key: str
    primus: Any
    ours: Any
    merged: Any
    source: str

    @property
    def conflict(self) -> bool:
        """The two files give it different defaults (``true`` and ``1`` differ: YAML types are kept)."""
        return type(self.primus) is not type(self.ours) or self.primus != self.ours


def shared_keys(experiment: PrimusExperiment, environ: Optional[Mapping[str, str]] = None) -> Optional[list[SharedKey]]:
    """The keys Primus's ``primus_turbo.yaml`` and primus_ext's module config (its defaults, which
    ``configs/modules/megatron/primus_ext_attention.yaml`` lists) both define, in primus_ext's order;
    None when this Primus has no ``primus_turbo.yaml``.  ``merged`` is what this run's layers read:
    the merged value, or primus_ext's default when the merge lacks the key."""
    path = Path(experiment.configs) / PRIMUS_TURBO_YAML
    if not path.is_file():
        return None
    primus, _ = _Reader(Path(experiment.configs), os.environ if environ is None else environ).parse(path)
    ours = TurboAttentionSettings().to_dict()
    return [SharedKey(key, primus[key], ours[key], experiment.params.get(key, ours[key]),
                      experiment.sources.get(key, "not set: primus_ext's default"))
            for key in SETTING_KEYS if key in primus]


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def _gets(experiment: PrimusExperiment, key: str) -> tuple[Any, str]:
    """What this run's layers get for ``key`` and where it was set."""
    if key in experiment.params:
        return experiment.params[key], f"from {experiment.sources.get(key, 'the merge')}"
    if key in SETTING_KEYS:
        return TurboAttentionSettings().to_dict()[key], "primus_ext's default"
    return None, "not set: Megatron's default"


def placement_reasons(experiment: PrimusExperiment) -> list[Reason]:
    """A ``primus-ignored`` reason per planned key Primus does not apply as written, where the run gets
    another value."""
    reasons = []
    for where, key, value in experiment.ignored:
        merged, source = _gets(experiment, key)
        if key not in PLANNED_KEYS or _same(value, merged):
            continue
        rule = {"top": R.PRIMUS_IGNORED_TOP, "preset": R.PRIMUS_IGNORED_PRESET}.get(where, R.PRIMUS_IGNORED_MODEL)
        reasons.append(rule.reason_for(key=key, value=yaml_value(value), merged=yaml_value(merged), source=source,
                                       module=experiment.module, top=", ".join(TOP_KEYS), file=where))
    return reasons


def placement_notes(experiment: PrimusExperiment) -> list[str]:
    """One line per key Primus does not apply as written that `placement_reasons` does not refuse."""
    lines = []
    for where, key, value in experiment.ignored:
        merged, source = _gets(experiment, key)
        if key in PLANNED_KEYS and not _same(value, merged):
            continue
        place = {"top": "at the experiment's top level",
                 "preset": f"beside modules.{experiment.module}.config (its preset sets it)"}.get(
                     where, f"in the model file {where} (the module file sets it, and wins)")
        lines.append(f"  ignored by Primus: {key}: {yaml_value(value)} {place}; the run gets {yaml_value(merged)} "
                     f"({source}); move it under modules.{experiment.module}.overrides to set it")
    return lines


def planned_sources(experiment: PrimusExperiment) -> list[str]:
    """``key = value (file)`` of each planned key the merge sets, in the merge's order."""
    return [f"{key} = {yaml_value(value)} ({experiment.sources.get(key, 'the merge')})"
            for key, value in experiment.params.items() if key in PLANNED_KEYS]


__all__ = ["PLANNED_KEYS", "PRIMUS_TURBO_YAML", "SharedKey", "placement_notes", "placement_reasons",
           "planned_sources", "shared_keys", "yaml_value"]
