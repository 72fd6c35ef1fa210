"""The one way ``check``, ``demo`` and ``selftest`` read a config file.

Whatever the command, a file is read alike: a YAML mapping read safely, a Primus experiment merged as
Primus merges it (``--primus-root``; where each key came from and the keys Primus ignores printed first,
`check_primus`), the Turbo keys through `TurboAttentionSettings` (``--arch`` applied), what Primus's patch
would refuse of the run, and Megatron's model-shape keys through their typed readers
(`primus_ext.settings.model_keys`) and megatron-core's own ``TransformerConfig``.  So a file one command
accepts, the others accept too, and a malformed key is refused with one message by all three.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, TextIO, Union

from .. import refusals as R
from ..errors import Reason, UnsupportedConfigError
from ..megatron.specs import turbo_off_reasons
from ..megatron.validate import lookalike_model_keys, transformer_config_problems
from ..settings import TurboAttentionSettings
from ..settings.model_keys import model_key_problems
from ..settings.primus_config import PrimusExperiment
from ..settings.primus_placement import PLANNED_KEYS
from ..settings.settings import SETTING_KEYS
from ..settings.yaml_file import fragment_note, is_module_fragment, load_yaml_mapping
from .check_primus import primus_merged, primus_refusal, primus_run_settings
from .demo_model import DemoOptions

REFUSED = 2


@dataclass
class CommandInput:
    """A config as every command reads it."""

    path: str
    """The file (or where the default came from), as messages name it."""
    config: dict[str, Any]
    """The keys the layers read: the file's, or a Primus experiment's merged module parameters."""
    settings: TurboAttentionSettings
    experiment: Optional[PrimusExperiment]
    idle: str = ""
    """Why no layer of ours would run (a module fragment, Primus's or Megatron's own attention); empty when
    some would."""
    fragment: bool = False


def settings_for(config: dict, arch: Optional[str], err: Any,
                 read: Callable[[dict], TurboAttentionSettings] = TurboAttentionSettings.from_dict,
                 ) -> Optional[TurboAttentionSettings]:
    """The config's settings (``--arch`` applied), or None after printing why they are refused."""
    if arch is not None:
        named = config.get("turbo_arch")
        if named not in (None, "auto", arch):  # the YAML pins another machine, where the layers would be refused
            raise R.refuse_option(R.CLI_OPTION, option="--arch", what=(
                f"--arch {arch}, but the YAML sets turbo_arch: {named}, which a {arch} device refuses at build"),
                alternative=f"give --arch {named} to check the machine the YAML names, or set turbo_arch: auto "
                f"(or {arch}) in the YAML.")
        config["turbo_arch"] = arch
    try:
        return read(config)
    except UnsupportedConfigError as exc:
        print(exc, file=err)
        return None


def model_problems(config: Mapping[str, Any]) -> list[str]:
    """What is missing or malformed among the model-shape keys the plans need (each key's typed reader), then
    what megatron-core's own ``TransformerConfig`` refuses of them together."""
    reasons = model_key_problems(config) + lookalike_model_keys(config)
    if not reasons:
        reasons = transformer_config_problems(config)
    return [reason.render() for reason in reasons]


def _nested_planned(config: Mapping[str, Any], depth: int = 3) -> list[str]:
    """The planned keys (`PLANNED_KEYS`) under a nested mapping, ``outer.inner`` paths; the Turbo keys whose
    value is a mapping (hook kwargs) and the demo's own mapping aside."""
    found = []
    for key, value in config.items():
        if key in SETTING_KEYS or key == "demo" or not isinstance(value, Mapping) or depth == 0:
            continue
        found += [f"{key}.{inner}" for inner in value if inner in PLANNED_KEYS]
        found += [f"{key}.{inner}" for inner in _nested_planned(value, depth - 1)]
    return found


def _structure_problems(config: Mapping[str, Any]) -> list[Reason]:
    """A flat YAML's planned keys nested where nothing reads them, grouped by their top-level key."""
    by_outer: dict[str, list[str]] = {}
    for path in _nested_planned(config):
        outer, _, inner = path.partition(".")
        by_outer.setdefault(outer, []).append(inner)
    return [R.YAML_NESTED.reason_for(outer=outer, inner=", ".join(inner)) for outer, inner in by_outer.items()]


def read_input(path: Optional[str], out: TextIO, err: TextIO, *, arch: Optional[str] = None,
               primus_root: Optional[str] = None, seq_len: Optional[int] = None,
               default: Optional[tuple[dict[str, Any], str]] = None) -> Union[CommandInput, int]:
    """The config at ``path`` (``default``'s mapping and label when None), or the exit status after printing
    why it cannot be read.  A module fragment or a Primus run that builds Primus's own attention comes back
    with `CommandInput.idle` set and its model keys unchecked (there is no model to check)."""
    if path is None:
        if primus_root is not None:
            raise R.refuse_option(R.CLI_OPTION, option="--primus-root", what="--primus-root is for a Primus "
                                 "experiment YAML, and no config file was given",
                                 alternative="give the experiment YAML, or leave --primus-root out.")
        assert default is not None
        config, label, experiment = dict(default[0]), default[1], None
    else:
        config, experiment = primus_merged(path, load_yaml_mapping(path, allow_empty=False), primus_root, out)
        label = path
    nested = _structure_problems(config) if experiment is None else []
    if nested:
        raise R.refuse_all(nested, context=label)
    read = primus_run_settings if experiment is not None else TurboAttentionSettings.from_dict
    settings = settings_for(config, arch, err, read)
    refusal = primus_refusal(experiment, config, settings, primus_root) if experiment and settings else None
    if refusal is not None:  # the patch's condition would stop this run, or a key is not where Primus reads it
        print(refusal, file=err)
    if settings is None or refusal is not None:
        return REFUSED
    off = turbo_off_reasons(settings)
    if off:  # the layers would be Megatron's own (or Primus's TE ones), which ignore these keys
        raise R.refuse_all(off, context=label)
    found = CommandInput(label, config, settings, experiment)
    # the patch's condition is false (an owner primus left here has Primus's own path): nothing of ours runs
    if experiment and (not settings.use_turbo_flex_attention or settings.turbo_flex_attention_owner == "primus"):
        why = ("use_turbo_flex_attention is not true" if not settings.use_turbo_flex_attention
               else "turbo_flex_attention_owner is primus")
        found.idle = (f"{why}: primus_ext's patch stays out of this run, and Primus builds its own attention "
                      "(nothing to plan here).")
        return found
    if path is not None and is_module_fragment(config):
        found.idle, found.fragment = fragment_note(path, settings), True
        return found
    if not (settings.use_turbo_attention or settings.use_turbo_flex_attention):
        found.idle = ("use_turbo_attention and use_turbo_flex_attention are false: primus_ext's spec providers build "
                      "Megatron's own core attention for every layer (nothing of primus_ext to plan). Set "
                      "use_turbo_attention: true (the direct Turbo path) or both (the flex path) to plan it.")
        return found
    if seq_len is not None:
        if not 1 <= seq_len <= 2 ** 31 - 1:
            raise R.refuse_option(R.CLI_OPTION, option="--seq-len", what=f"--seq-len must be a positive integer below "
                                 f"2**31, got {seq_len}", alternative="give the training sequence length, such as 4096.")
        config["seq_length"] = seq_len
    if "demo" in config:  # what the demo would refuse of its own mapping, every command refuses alike
        DemoOptions.from_mapping(config["demo"], int(config.get("seq_length") or 2 ** 31 - 1))
    problems = model_problems(config)
    if problems:
        print(f"primus_ext cannot read the model shape of {label}:", file=err)
        for text in problems:
            print(f"  - {text}", file=err)
        return REFUSED
    return found


__all__ = ["CommandInput", "REFUSED", "model_problems", "read_input", "settings_for"]
