"""A stand-in of how AMD Primus turns an experiment YAML into Megatron's arguments, written from
Primus's sources (main fd1eeab, ``primus/`` paths) in their own shape (namespaces, merged in place),
on its own: it shares no code with `primus_ext.settings.primus_config`, which ``primus-ext check``
uses, so that a test holding the two equal tests both against Primus.

* ``parse_yaml``: ``core/config/yaml_loader.py:18-169`` (PyYAML's safe load, ``${VAR:default}``,
  ``extends``), ``deep_merge``: ``core/config/merge_utils.py:11-39``;
* the namespace helpers: ``core/utils/yaml_utils.py:19-125`` (a merge writes ``"null"`` as None);
* ``parse_experiment``: ``PrimusParser.parse`` (``core/launcher/parser.py:196-336``, platform and
  meta keys left out), ``PresetLoader.load`` (``core/config/preset_loader.py:24-61``);
* ``module_config``: ``_normalize_module_for_runtime`` and ``get_module_config``
  (``core/config/primus_config.py:42-74``, ``:147-167``);
* ``convert_config``: ``MegatronArgBuilder`` (``backends/megatron/argument_builder.py:102-203``):
  Megatron's defaults, the params' Megatron keys over them.  Megatron's argument parser
  (``megatron.training``) is not in megatron-core's wheel, so `MEGATRON_DEFAULTS` holds the defaults
  of the Megatron arguments primus_ext reads (``megatron/training/arguments.py``); with Megatron-LM
  importable its own parser's are used, as Primus does.
"""

from __future__ import annotations

import copy
import os
import re
from types import SimpleNamespace
from typing import Any, Optional

import yaml

ENV_PATTERN = re.compile(r"\${([^:{}]+)(?::([^}]*))?}")
FLOAT_PATTERN = re.compile(r"^-?(?:(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+)$")

MEGATRON_DEFAULTS: dict[str, Any] = {
    "num_layers": None, "hidden_size": None, "num_attention_heads": None, "num_query_groups": 1,
    "kv_channels": None, "seq_length": None, "tensor_model_parallel_size": 1, "context_parallel_size": 1,
    "deterministic_mode": False, "reset_attention_mask": False, "load": None, "pretrained_checkpoint": None,
    "ckpt_step": None,
}


# ------------------------------------------------------------------ yaml_loader.py
def parse_yaml(path: str) -> dict:
    with open(path, "r") as handle:
        cfg = yaml.load(handle, Loader=yaml.SafeLoader)
    if cfg is None:
        raise ValueError(f"YAML configuration file '{path}' is empty or invalid.")
    return _apply_extends(path, _resolve_env(cfg))


def _resolve_env(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _resolve_env(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_resolve_env(v) for v in obj]
    if isinstance(obj, str):
        def replace_match(m: re.Match) -> str:
            var, default = m.group(1), m.group(2)
            if default is None:
                if var not in os.environ:
                    raise ValueError(f"Environment variable '{var}' is required but not set.")
                return os.environ[var]
            return os.environ.get(var, default)

        replaced = ENV_PATTERN.sub(replace_match, obj)
        return _try_scalar(replaced) if replaced != obj else replaced
    return obj


def _try_scalar(v: str) -> Any:
    if v.lower() in {"true": True, "false": False}:
        return {"true": True, "false": False}[v.lower()]
    if re.fullmatch(r"-?\d+", v):
        return int(v)
    if FLOAT_PATTERN.fullmatch(v):
        return float(v)
    return v


def _apply_extends(path: str, cfg: dict) -> dict:
    if "extends" not in cfg:
        return cfg
    merged: dict = {}
    extends = cfg["extends"]
    if isinstance(extends, str):
        extends = [extends]
    for ext in extends:
        merged = deep_merge(merged, parse_yaml(os.path.join(os.path.dirname(path), ext)))
    return deep_merge(merged, {k: v for k, v in cfg.items() if k != "extends"})


def deep_merge(base: dict, override: dict) -> dict:
    result = copy.deepcopy(base)
    for key, val in override.items():
        if key in result and isinstance(result[key], dict) and isinstance(val, dict):
            result[key] = deep_merge(result[key], val)
        else:
            result[key] = val
    return result


# ------------------------------------------------------------------ yaml_utils.py
def to_namespace(obj: Any) -> Any:
    if isinstance(obj, dict):
        return SimpleNamespace(**{k: to_namespace(v) for k, v in obj.items()})
    if isinstance(obj, list):
        return [to_namespace(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_namespace(v) for v in obj)
    return obj


def to_dict(obj: Any) -> Any:
    if isinstance(obj, SimpleNamespace):
        return {k: to_dict(v) for k, v in vars(obj).items()}
    if isinstance(obj, list):
        return [to_dict(v) for v in obj]
    return obj


def _assign(namespace: SimpleNamespace, src: dict) -> None:
    for key, value in src.items():
        if isinstance(value, dict):
            current = getattr(namespace, key, None)
            if isinstance(current, SimpleNamespace):
                _assign(current, value)
            else:
                setattr(namespace, key, to_namespace(value))
        else:
            value = to_namespace(value)
            setattr(namespace, key, None if value == "null" else value)


def deep_merge_namespace(namespace: SimpleNamespace, override: dict) -> SimpleNamespace:
    _assign(namespace, deep_merge(to_dict(namespace), override))
    return namespace


def merge_namespace(dst: SimpleNamespace, src: SimpleNamespace, allow_override: bool = False,
                    excepts: tuple[str, ...] = ()) -> None:
    dst_dict = to_dict(dst)
    deep_merge_namespace(dst, {k: v for k, v in to_dict(src).items()
                               if k not in excepts and (allow_override or k not in dst_dict)})


# ------------------------------------------------------------------ parser.py, preset_loader.py
def _preset(configs: str, kind: str, framework: str, name: str) -> dict:
    filename = name if name.endswith((".yaml", ".yml")) else f"{name}.yaml"
    path = os.path.abspath(os.path.join(configs, kind, framework, filename))
    if os.path.commonpath([path, os.path.abspath(configs)]) != os.path.abspath(configs):
        raise ValueError(f"[Primus] Invalid preset path: path traversal detected for '{path}'.")
    if not os.path.exists(path):
        raise FileNotFoundError(f"[Primus] Preset '{name}' not found for framework '{framework}' in '{kind}'.")
    return parse_yaml(path)


def _trainer_module(exp: SimpleNamespace, configs: str, module_name: str) -> None:
    module = getattr(exp.modules, module_name)
    module.name = f"exp.modules.{module_name}"
    assert hasattr(module, "framework"), f"Failed to find key(framework) in namespace({module.name})"
    if not hasattr(module, "config"):
        return
    assert hasattr(module, "model"), f"Failed to find key(model) in namespace({module.name})"
    preserved = {k: v for k, v in vars(module).items()
                 if k not in {"name", "framework", "config", "model", "overrides", "params"} and not k.startswith("_")}
    module_config = to_namespace(_preset(configs, "modules", module.framework, module.config))
    module_config.name = f"exp.modules.{module_name}.config"
    module_config.framework = module.framework
    for key, value in preserved.items():
        if not hasattr(module_config, key):
            setattr(module_config, key, value)
    model_config = to_namespace(_preset(configs, "models", module.framework, module.model))
    model_config.name = f"exp.modules.{module_name}.model"
    if not hasattr(model_config, "model"):
        model_config.model = module.model
    merge_namespace(module_config, model_config, allow_override=False, excepts=("name",))
    if hasattr(module, "overrides") and module.overrides is not None:
        deep_merge_namespace(module_config, to_dict(module.overrides))
    module_config.name = module_name
    setattr(exp.modules, module_name, module_config)


def parse_experiment(path: str, configs: str) -> SimpleNamespace:
    """The experiment with each module merged (``PrimusParser.parse``); ``configs`` is Primus's
    ``primus/configs`` folder (upstream: the installed package's)."""
    exp = to_namespace(parse_yaml(path))
    for module_name in vars(exp.modules):
        if "trainer" not in module_name:
            raise ValueError(f"Unsupported module: {module_name}")
        _trainer_module(exp, configs, module_name)
    return exp


def module_config(exp: SimpleNamespace, module_name: str = "pre_trainer") -> SimpleNamespace:
    """The runtime shape of one module (``get_module_config`` over the normalized modules): its
    keys under ``params``, but name, framework, config, model and trainer_class."""
    names = vars(exp.modules)
    if module_name not in names:
        module_name = {"pre_trainer": "post_trainer", "post_trainer": "pre_trainer"}.get(module_name, module_name)
    normalized = copy.deepcopy(names[module_name])
    params = to_dict(getattr(normalized, "params", None)) or {}
    for key, value in list(vars(normalized).items()):
        if key in {"name", "framework", "config", "model", "params", "trainer_class"} or key.startswith("_"):
            continue
        params[key] = value
        delattr(normalized, key)
    normalized.params = to_namespace(params)
    if hasattr(normalized, "model"):
        normalized.params.model = normalized.model
    return normalized


# ------------------------------------------------------------------ argument_builder.py
def _megatron_defaults() -> dict[str, Any]:
    try:
        import argparse

        from megatron.training.arguments import add_megatron_arguments  # type: ignore[import-not-found]
    except ImportError:
        return dict(MEGATRON_DEFAULTS)
    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    return vars(parser.parse_args([]))


def convert_config(params: SimpleNamespace, defaults: Optional[dict[str, Any]] = None) -> SimpleNamespace:
    """Megatron's args from Primus's params: Megatron's defaults, the params' Megatron keys over them
    (the others are merged in by the runtime after the build_args patches)."""
    final = dict(_megatron_defaults() if defaults is None else defaults)
    final.update({k: v for k, v in vars(params).items() if k in final})
    final.update(world_size=1, rank=0, local_rank=0)  # get_torchrun_env() of a single process
    return SimpleNamespace(**final)


__all__ = ["MEGATRON_DEFAULTS", "convert_config", "deep_merge", "deep_merge_namespace", "merge_namespace",
           "module_config", "parse_experiment", "parse_yaml", "to_dict", "to_namespace"]
