"""``primus-ext check EXPERIMENT.yaml`` for a Primus experiment: the config it checks is the one
Primus's patch will read.

An experiment YAML (``modules:``) is merged the way Primus merges it
(`primus_ext.settings.primus_config.read_experiment`: module file and its ``extends`` chain, model
file, the module's ``overrides``, ``${VAR:default}`` from this environment), and ``check`` goes on
with the merged module parameters as the Megatron YAML it checks.  Before the plans it prints:

* the module and the files merged, lowest priority first;
* the keys Primus's ``primus_turbo.yaml`` and primus_ext's module config
  (``configs/modules/megatron/primus_ext_attention.yaml``) both define: those with equal defaults
  on one line, and each key whose defaults differ (a *conflict*) with both defaults and the value
  this run's layers get, and where that value was set.  A conflict is reported, not refused: the
  layers read the merged value, which is what ``check`` plans with;
A run Primus would not switch on for primus_ext (``primus-enable``; ``PRIMUS_PATCHES`` without
primus_ext's patch too, read from this environment with the experiment's ``env:`` block over it, as
Primus's patches will see it), or whose keys would not mean what they say under Primus (``primus-layers``,
``primus-window``, ``B25.no-mask``), is refused here as the patch's condition refuses it, by the
same rules.
"""

from __future__ import annotations

from typing import Any, Optional, TextIO

from .. import refusals as R
from ..errors import UnsupportedConfigError, short_repr
from ..settings import TurboAttentionSettings
from ..settings.primus_config import (PrimusExperiment, configs_dir, is_experiment, primus_settings, read_experiment,
                                      run_reasons, switch_reasons)
from ..settings.primus_placement import placement_notes, placement_reasons, planned_sources, shared_keys, yaml_value
from ..settings.primus_owner import owner_reasons, primus_flex_path, wants_primus_ext
from ..settings.primus_launch import patch_environment


def describe(experiment: PrimusExperiment) -> list[str]:
    """The lines ``check`` prints about a merged experiment, before its plans."""
    lines = [f"{experiment.path}: Primus experiment, module {experiment.module} (megatron), merged as Primus "
             f"merges it from {experiment.configs}:",
             f"  files, lowest priority first: {', '.join(experiment.files)}"]
    shared = shared_keys(experiment)
    if shared is None:
        lines.append("  this Primus has no modules/megatron/primus_turbo.yaml: no shared keys to compare")
    else:
        same = [s.key for s in shared if not s.conflict]
        if same:
            lines.append(f"  keys Primus's primus_turbo.yaml and primus_ext_attention.yaml both define, same "
                         f"defaults: {', '.join(same)}")
        conflicts = [s for s in shared if s.conflict]
        for s in conflicts:
            lines.append(f"  conflict: {s.key}: Primus's primus_turbo.yaml has {yaml_value(s.primus)}, "
                         f"primus_ext_attention.yaml {yaml_value(s.ours)}; this run's layers get {yaml_value(s.merged)} "
                         f"(from {s.source})")
        if not conflicts:
            lines.append("  no conflicts: every shared key has one default")
    sources = planned_sources(experiment)
    if sources:
        lines.append("  attention and model keys this run's layers read, and where each was set:")
        lines += [f"    {line}" for line in sources]
    return lines + placement_notes(experiment)


def primus_merged(path: str, config: dict[str, Any], primus_root: Optional[str],
                  out: TextIO) -> tuple[dict[str, Any], Optional[PrimusExperiment]]:
    """``(config to read, the experiment or None)``: a Primus experiment's merged module parameters,
    after printing `describe`; any other YAML unchanged."""
    if not is_experiment(config):
        if primus_root is not None:
            raise R.refuse_option(R.CLI_OPTION, option="--primus-root", what=f"--primus-root is for a Primus experiment "
                                 f"YAML (one with modules:); {path} has no modules: mapping",
                                 alternative="leave --primus-root out, or give the experiment YAML.")
        if "extends" in config:  # only Primus merges extends:, and only in an experiment's module and model files
            raise R.refuse_build(R.PRIMUS_EXPERIMENT, key="extends", what=(
                f"{path} has extends: {short_repr(config['extends'])} but is not a Primus experiment (no modules: "
                "mapping): Megatron reads a flat YAML as it is, so the files named would not be merged and their "
                "keys would not reach the plan."),
                alternative="copy the keys of the files named into this one, or check the Primus experiment that "
                "uses this file (primus-ext check exp.yaml --primus-root PATH).")
        return config, None
    experiment = read_experiment(path, primus_root)
    for line in describe(experiment):
        print(line, file=out)
    print(file=out)
    return dict(experiment.params), experiment


def primus_run_settings(config: dict[str, Any]) -> TurboAttentionSettings:
    """The settings of merged parameters, read exactly as the patch's condition reads Megatron's args."""
    return primus_settings(config)


def primus_refusal(experiment: PrimusExperiment, config: dict[str, Any], settings: TurboAttentionSettings,
                   primus_root: Optional[str] = None) -> Optional[UnsupportedConfigError]:
    """The refusal of the patch's condition (or the launcher's) for the experiment at ``path``, where Primus
    would not install its spec provider or would drop primus_ext's patch, in the environment Primus's
    patches would see here (this one, with the experiment's ``env:`` block applied), or where the Primus
    of ``primus_root`` (the installed one without it) has its own flex path and the owner is not named; or
    where a key the plans read is written where Primus does not apply it (`placement_reasons`)."""
    reasons = placement_reasons(experiment)
    if not settings.use_turbo_flex_attention:
        return R.refuse_all(reasons, context="Primus experiment") if reasons else None
    primus_flex = primus_flex_path(str(configs_dir(primus_root).parent))
    reasons += owner_reasons(settings, primus_flex)
    if wants_primus_ext(settings, primus_flex):
        environ, where = patch_environment(experiment.path)
        reasons += switch_reasons(config.get("enable_primus_turbo", False), environ, True, where)
        reasons += run_reasons(config)
    return R.refuse_all(reasons, context="Primus patch") if reasons else None


__all__ = ["describe", "primus_merged", "primus_refusal", "primus_run_settings"]
