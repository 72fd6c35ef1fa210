"""A Primus experiment YAML merged the way Primus merges it, for ``primus-ext check``; and the two
switches a Primus run needs for primus_ext's patch to take effect (read by the patch and by ``check``).

Primus's rules, read in its sources (main fd1eeab; ``primus/`` paths):

* Every file goes through ``parse_yaml`` (``core/config/yaml_loader.py:18-25``): PyYAML's safe
  load, then ``${VAR}`` / ``${VAR:default}`` in every string value (``:12``, ``:41-103``; an unset
  ``${VAR}`` is an error, ``:95-96``): a string where something was substituted becomes a bool,
  int or float when it reads as one (``:103``, ``:106-128``), one with nothing substituted stays a
  string; then ``extends:`` (a list, or one name, ``:157-158``; relative to the file's folder,
  ``:161``) deep-merged in order, the file's own keys last (``:160-167``; ``deep_merge``:
  ``core/config/merge_utils.py:11-39``, nested mappings merged, everything else replaced).
* ``PrimusParser`` (``core/launcher/parser.py:196-336``) parses the experiment itself that way;
  every module name must contain ``trainer`` (``:330-336``); a module needs ``framework``
  (``:262``); without ``config`` it is left as written (``:265-275``), otherwise it needs ``model``
  (``:278-279``).  The module file is ``configs/modules/<framework>/<config>`` and the model file
  ``configs/models/<framework>/<model>`` (``.yaml`` added when missing), inside the installed
  ``primus`` package's ``configs`` (``core/config/preset_loader.py:24-61``).  Module-level keys
  other than name, framework, config, model, overrides and params are kept where the module file
  lacks them (``parser.py:284-301``); the model file's keys are added only where the module file
  lacks them, so **the module file wins over the model file** (``parser.py:320``,
  ``merge_namespace(..., allow_override=False)``, ``core/utils/yaml_utils.py:112-125``); then
  ``overrides`` is deep-merged over both (``parser.py:323-324``).  Each of those merges writes a
  string ``"null"`` as None (``yaml_utils.py:73-74``, ``:93``).
* The module's params are its keys but name, framework, config, model, params, trainer_class, plus
  ``model`` (``core/config/primus_config.py:42-74``).  ``primus train pretrain`` runs module
  ``pre_trainer``, ``posttrain`` ``post_trainer``, each falling back on the other
  (``primus_config.py:147-167``).  Megatron's arguments are Megatron's defaults with the params'
  Megatron keys over them (``backends/megatron/argument_builder.py:130-203``), then every other
  param added (``core/runtime/train_runtime.py:416``, ``:454-455``); the before_train patches read
  them through ``get_args`` (``core/patches/context.py:87-116``).  So the params are what a patch
  sees, but for a Megatron key they lack, which has Megatron's default.

This reads files with primus_ext's own safe loader (`yaml_file.load_yaml_mapping`), which refuses
a key written twice where PyYAML would keep the last; the command-line overrides of
``primus train`` (``train_runtime.py:293-305``) and ``env:`` are not read.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping, Optional

from .. import refusals as R
from ..errors import Reason, UnsupportedConfigError, short_repr
from .settings import SETTING_KEYS, TurboAttentionSettings
from .primus_launch import PATCH_ID, PRIMUS_PROVIDER_PATCH, patch_filter_reasons
from .yaml_file import load_yaml_mapping

MODULE_NAMES = ("pre_trainer", "post_trainer")
"""The modules ``primus train pretrain`` / ``posttrain`` run, in the order ``check`` looks for them."""

_ENV = re.compile(r"\${([^:{}]+)(?::([^}]*))?}")  # yaml_loader.py:12
_FLOAT = re.compile(r"^-?(?:(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+)$")  # yaml_loader.py:14
_KEPT_ON_MODULE = frozenset({"name", "framework", "config", "model", "overrides", "params"})  # parser.py:285
TOP_KEYS = ("work_group", "user_name", "exp_name", "workspace", "platform", "modules", "env")
"""The experiment's top-level keys Primus reads (parser.py:206-246, 317-323; ``env``: train_runtime.py:307-358)."""
_NOT_PARAMS = frozenset({"name", "framework", "config", "model", "params", "trainer_class"})  # primus_config.py:56


@dataclass(frozen=True)
class PrimusExperiment:
    """One module of an experiment, merged: ``params`` as Primus hands them to Megatron's arguments."""

    path: str
    module: str
    configs: str
    """Primus's ``configs`` folder the module and model files came from."""
    params: dict[str, Any]
    sources: dict[str, str]
    """Where each top-level key's value was last set: a file (relative to ``configs``) or the experiment's key."""
    files: tuple[str, ...]
    """The files merged, lowest priority first (module chain, model chain, the experiment)."""
    ignored: tuple[tuple[str, str, Any], ...] = ()
    """``(where, key, value)`` of each key Primus does not apply as written: ``where`` is ``top`` (the
    experiment's top level), ``preset`` (beside the module's config: / model:, where its preset sets the key), or
    the model file (relative to ``configs``) whose key the module file sets to another value (the module wins)."""


def _refuse(settings: tuple[str], reason: str, alternative: str) -> UnsupportedConfigError:
    return R.refuse_build(R.PRIMUS_EXPERIMENT, "Primus experiment", key=settings[0], what=reason,
                          alternative=alternative)


def is_experiment(config: Mapping[str, Any]) -> bool:
    """A Primus experiment YAML: its modules are under ``modules:`` (a Megatron YAML has no such key)."""
    return isinstance(config.get("modules"), Mapping)


# ------------------------------------------------------------------ Primus's parse_yaml
def _scalar(text: str) -> Any:
    """yaml_loader.py:106-128: bool, int or float when the substituted text reads as one."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    return float(text) if _FLOAT.fullmatch(text) else text


def _substitute(value: Any, path: Path, environ: Mapping[str, str]) -> Any:
    if isinstance(value, dict):
        return {key: _substitute(item, path, environ) for key, item in value.items()}
    if isinstance(value, list):
        return [_substitute(item, path, environ) for item in value]
    if not isinstance(value, str):
        return value

    def one(match: re.Match) -> str:
        name, default = match.group(1), match.group(2)
        if default is None and name not in environ:
            raise _refuse((name,), f"{path} uses ${{{name}}}, and the environment variable {name} is not set "
                          "(Primus stops on it too).", f"export {name}, or write ${{{name}:default}} in {path}.")
        return environ[name] if default is None else environ.get(name, default)

    replaced = _ENV.sub(one, value)
    return _scalar(replaced) if replaced != value else replaced


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """merge_utils.py:11-39: ``override`` wins; nested mappings merge, everything else is replaced."""
    result = copy.deepcopy(dict(base))
    for key, value in override.items():
        both = isinstance(result.get(key), dict) and isinstance(value, dict)
        result[key] = deep_merge(result[key], value) if both else value
    return result


class _Reader:
    """Parses files as Primus does, noting each file and where each top-level key was set."""

    def __init__(self, configs: Path, environ: Mapping[str, str]) -> None:
        self.configs, self.environ = configs, environ
        self.files: list[str] = []

    def name(self, path: Path) -> str:
        try:
            return str(path.resolve().relative_to(self.configs.resolve()))
        except ValueError:
            return str(path)

    def parse(self, path: Path, chain: tuple[Path, ...] = ()) -> tuple[dict[str, Any], dict[str, str]]:
        if path.resolve() in chain:  # Primus would recurse until Python's limit
            raise _refuse(("extends",), f"{path} extends itself (through {' -> '.join(map(str, chain))}).",
                          "remove the circular extends: entry.")
        data = _substitute(load_yaml_mapping(path, allow_empty=False), path, self.environ)
        merged: dict[str, Any] = {}
        sources: dict[str, str] = {}
        extends = data.pop("extends", [])
        for name in [extends] if isinstance(extends, str) else extends if isinstance(extends, list) else [None]:
            if not isinstance(name, str):
                raise _refuse(("extends",), f"extends: in {path} must name YAML files, got {short_repr(extends)}.",
                              "write extends: [base.yaml, ...], paths relative to the file.")
            base = path.parent / name
            if not base.is_file():
                raise _refuse(("extends",), f"{path} extends {name}, and {base} is not a file.",
                              "name a file relative to the extending file's folder, as Primus reads it.")
            part, part_sources = self.parse(base, chain + (path.resolve(),))
            merged = deep_merge(merged, part)
            sources.update(part_sources)
        self.files.append(self.name(path))
        sources.update({key: self.name(path) for key in data})
        return deep_merge(merged, data), sources

    def preset(self, kind: str, framework: str, name: Any, where: str) -> tuple[dict[str, Any], dict[str, str]]:
        """preset_loader.py:24-61: ``configs/<kind>/<framework>/<name>[.yaml]``, inside ``configs``."""
        folder = self.configs / kind / framework
        if not isinstance(name, str) or not name:
            raise _refuse((where,), f"{where} must name a file of {folder}, got {short_repr(name)}.",
                          f"write {where}: <name>.yaml.")
        path = folder / (name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")
        if os.path.commonpath([os.path.abspath(path), os.path.abspath(self.configs)]) != os.path.abspath(self.configs):
            raise _refuse((where,), f"{where}: {name} leads outside Primus's configs folder {self.configs}.",
                          f"name a file of {folder}.")
        if not path.is_file():
            raise _refuse((where,), f"{where}: {name} is not in this Primus: {path} does not exist.",
                          f"name a file of {folder}, or give --primus-root the Primus checkout the experiment is for.")
        return self.parse(path)


def _nulls(value: Any) -> Any:
    """yaml_utils.py:73-74, applied to every value by Primus's namespace merges: ``"null"`` is None."""
    if isinstance(value, dict):
        return {key: _nulls(item) for key, item in value.items()}
    return None if value == "null" else value


# ------------------------------------------------------------------ Primus's config folder
def configs_dir(primus_root: Optional[str]) -> Path:
    """Primus's ``configs`` folder: ``--primus-root`` (a checkout, or its ``primus`` package), else the
    installed ``primus`` package's (found without importing it)."""
    def holds(folder: Path) -> bool:
        return (folder / "modules").is_dir() and (folder / "models").is_dir()

    if primus_root is not None:
        root = Path(primus_root)
        for folder in (root / "primus" / "configs", root / "configs"):
            if holds(folder):
                return folder
        raise _refuse(("--primus-root",), f"--primus-root {root} is not a Primus checkout: neither "
                      f"{root / 'primus' / 'configs'} nor {root / 'configs'} holds Primus's modules/ and models/.",
                      "give the folder of a Primus checkout (the one holding primus/configs/modules/megatron/"
                      "pre_trainer.yaml), or leave --primus-root out in Primus's Python environment.")
    try:
        spec = importlib.util.find_spec("primus")
    except (ImportError, ValueError):  # a stand-in module without a spec
        spec = None
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        if holds(Path(location) / "configs"):
            return Path(location) / "configs"
    raise _refuse(("--primus-root",), "the experiment's module and model files are in Primus's configs folder, "
                  "and no --primus-root was given and no installed primus package has one.",
                  "give --primus-root <Primus checkout>, or run check in Primus's Python environment.")


# ------------------------------------------------------------------ the merge
def _merge_module(reader: _Reader, where: str, module: dict[str, Any]) -> tuple[dict, dict, list[tuple[str, str, Any]]]:
    """parser.py:257-328: one module's merged config, where each key came from, and the module-level keys its
    preset shadows."""
    if "framework" not in module:
        raise _refuse((f"{where}.framework",), f"{where} has no framework (Primus asserts it).",
                      f"add {where}.framework: megatron.")
    if "config" not in module:  # left as written: no file merged, overrides not applied
        return dict(module), {key: f"{where}.{key}" for key in module}, []
    if "model" not in module:
        raise _refuse((f"{where}.model",), f"{where} names a config but no model (Primus asserts both).",
                      f"add {where}.model: <model>.yaml.")
    framework = module["framework"]
    merged, sources = reader.preset("modules", framework, module["config"], f"{where}.config")
    shadowed: list[tuple[str, str, Any]] = []
    for key, value in module.items():
        if key not in _KEPT_ON_MODULE and not key.startswith("_"):
            if key in merged:
                shadowed.append(("preset", key, value))
            else:
                merged[key], sources[key] = value, f"{where}.{key}"
    model, model_sources = reader.preset("models", framework, module["model"], f"{where}.model")
    if "model" not in model:
        model["model"], model_sources["model"] = module["model"], f"{where}.model"
    for key, value in model.items():
        if key != "name" and key not in merged:  # the module file wins (allow_override=False)
            merged[key], sources[key] = value, model_sources[key]
        elif key not in ("name", "model") and (type(value) is not type(merged[key]) or value != merged[key]):
            shadowed.append((model_sources[key], key, value))
    overrides = module.get("overrides")
    if overrides is not None:
        if not isinstance(overrides, dict):
            raise _refuse((f"{where}.overrides",), f"{where}.overrides must be a mapping of keys, got "
                          f"{short_repr(overrides)}.", "write one key: value per line under overrides:.")
        merged = deep_merge(merged, overrides)
        sources.update({key: f"{where}.overrides" for key in overrides})
        # a model file's key the overrides set again is not lost: the experiment says which value it wants
        shadowed = [(place, key, value) for place, key, value in shadowed if place == "preset" or key not in overrides]
    return _nulls(merged), sources, shadowed


def read_experiment(path: str | os.PathLike[str], primus_root: Optional[str] = None,
                    environ: Optional[Mapping[str, str]] = None) -> PrimusExperiment:
    """The Megatron trainer module of the experiment at ``path``, merged as Primus merges it."""
    environ = os.environ if environ is None else environ
    configs = configs_dir(primus_root)
    reader = _Reader(configs, environ)
    experiment = Path(path)
    data, _ = reader.parse(experiment)
    modules = data.get("modules")
    if not isinstance(modules, dict) or not modules:
        raise _refuse(("modules",), f"{experiment} has no modules mapping.", "write modules: pre_trainer: ...")
    for name, module in modules.items():
        if "trainer" not in str(name) or not isinstance(module, dict):
            raise _refuse((f"modules.{name}",), f"modules.{name} is not a trainer module (Primus accepts only "
                          "mappings named *trainer*).", "name the module pre_trainer (train pretrain).")
    chosen = next((name for name in MODULE_NAMES if name in modules), None)
    if chosen is None:
        raise _refuse(("modules",), f"{experiment} has modules {sorted(modules)}, and primus train runs "
                      "pre_trainer (pretrain) or post_trainer (posttrain).", "name the module pre_trainer.")
    where = f"modules.{chosen}"
    if modules[chosen].get("framework") != "megatron":
        raise _refuse((f"{where}.framework",), f"{where}.framework is {short_repr(modules[chosen].get('framework'))}; "
                      "primus_ext's patch runs in Primus's Megatron backend only.", f"set {where}.framework: megatron.")
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    chosen_files: list[str] = []
    shadowed: list[tuple[str, str, Any]] = []
    for name, module in modules.items():  # Primus parses every module; one that fails stops the run
        reader.files = []
        result = _merge_module(reader, f"modules.{name}", module)
        if name == chosen:
            (merged, sources, shadowed), chosen_files = result, reader.files
    given = merged.get("params")  # a module's own params mapping, under the others (primus_config.py:57-67)
    params = {**(given if isinstance(given, dict) else {}),
              **{k: v for k, v in merged.items() if k not in _NOT_PARAMS and not str(k).startswith("_")}}
    if "model" in merged:
        params["model"] = merged["model"]
    ignored = [("top", key, value) for key, value in data.items() if key not in TOP_KEYS]
    ignored += shadowed
    return PrimusExperiment(str(experiment), chosen, str(configs), params,
                            {k: v for k, v in sources.items() if k in params}, (*chosen_files, str(experiment)),
                            tuple(ignored))


# ------------------------------------------------------------------ what a Primus run's args give
def _plain(value: Any) -> Any:
    """A YAML mapping as Primus hands it to Megatron's args, a ``SimpleNamespace``
    (``yaml_utils.py:19-31``, ``:85-93``), read back as the mapping it was."""
    if isinstance(value, SimpleNamespace):
        return {key: _plain(item) for key, item in vars(value).items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(item) for item in value)
    return value


def primus_settings(values: Mapping[str, Any]) -> TurboAttentionSettings:
    """The settings of a Primus run's merged parameters or Megatron args (``vars(args)``): the one
    reading the patch's condition and ``check`` share.  Our keys' namespaces are read as mappings
    (``turbo_flex_attention_mask_mod_kwargs: {prefix_length: 64}`` reaches the args as a namespace);
    Primus's own keys that look like ours pass (`primus_ext.settings.settings.FOREIGN_KEYS`)."""
    return TurboAttentionSettings.from_dict(
        {key: _plain(value) if key in SETTING_KEYS else value
         for key, value in values.items()})


def args_settings(args: Any) -> TurboAttentionSettings:
    """The settings of Megatron's args (Primus's or Megatron-LM's), read as `primus_settings` reads
    merged parameters; an object without ``__dict__`` is read by attribute."""
    try:
        values = vars(args)
    except TypeError:
        return TurboAttentionSettings.from_args(args)
    return primus_settings(values)


# ------------------------------------------------------------------ the switches of a Primus run
def switch_reasons(enable_primus_turbo: Any, environ: Optional[Mapping[str, str]] = None,
                   ours: bool = False, where: str = "in the environment") -> list[Reason]:
    """Why Primus would not install its spec provider in a run with ``use_turbo_flex_attention: true``
    (then the layers would be TransformerEngine's, not primus_ext's): ``enable_primus_turbo`` off, or
    ``PRIMUS_PATCHES`` (read from ``environ``, the process's when None, as Primus reads it when the
    condition runs) without Primus's provider patch, or with ``ours`` without primus_ext's (a condition
    that runs was not dropped; `check` and the launcher ask)."""
    reasons = []
    if not enable_primus_turbo:
        reasons.append(R.PRIMUS_TURBO_OFF.reason_for())
    ids = (PRIMUS_PROVIDER_PATCH, PATCH_ID) if ours else (PRIMUS_PROVIDER_PATCH,)
    return reasons + patch_filter_reasons(environ, where, ids)


SPECS_MODULE = "primus_ext.primus.specs"
"""primus_ext's ready ``ModuleSpec`` objects for Megatron's ``spec`` argument (no patch needed)."""


def run_reasons(values: Mapping[str, Any]) -> list[Reason]:
    """Why a run with ``use_turbo_flex_attention: true`` under Primus would not compute what its keys
    say, from Megatron's arguments (or the merged parameters): layers Primus's spec provider does not
    build (``transformer_impl: local``, a ``spec`` other than primus_ext's), ``sink_sliding_window``
    without ``use_sink_attention`` (Primus's attention applies the window only with sinks,
    ``primus_turbo.py`` l.927-942: the key would mean more here than in Primus), and
    ``reset_attention_mask`` without Megatron's mask (``create_attention_mask_in_dataloader: false``)."""
    reasons = []
    spec = values.get("spec")
    if spec and not (isinstance(spec, (list, tuple)) and spec and spec[0] == SPECS_MODULE):
        reasons.append(R.PRIMUS_FOREIGN_SPEC.reason_for(spec=short_repr(spec), specs=SPECS_MODULE))
    if values.get("transformer_impl", "transformer_engine") == "local" and not spec:
        reasons.append(R.PRIMUS_LOCAL_IMPL.reason_for(specs=SPECS_MODULE))
    window = values.get("sink_sliding_window") or 0
    if isinstance(window, int) and window > 0 and not values.get("use_sink_attention"):
        reasons.append(R.PRIMUS_WINDOW.reason_for(window=window))
    if values.get("reset_attention_mask") and values.get("create_attention_mask_in_dataloader") is False:
        reasons.append(R.DOCUMENT_MASK_MISSING.reason_for())
    return reasons


__all__ = ["MODULE_NAMES", "TOP_KEYS", "SPECS_MODULE", "run_reasons",
           "PrimusExperiment", "args_settings", "configs_dir", "deep_merge", "is_experiment",
           "primus_settings", "read_experiment", "switch_reasons"]
