"""Reading a YAML config file: one loader for `TurboAttentionSettings.from_yaml`, ``check`` and ``demo``.

A file that is not UTF-8 text, is empty, is not a mapping, or repeats a key is refused
with `UnsupportedConfigError` naming the file; PyYAML alone would let a repeated key
silently override the first one.
"""

from __future__ import annotations

import os
from typing import Any

import yaml

from ..errors import Reason, UnsupportedConfigError


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:  # type: ignore[override]
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice (lines {seen[key]} and {line}); the second would "
                    "silently replace the first", key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


MODEL_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "seq_length")
"""Megatron's model-shape keys; a YAML with none of them is a module fragment (Turbo keys only)."""


def is_module_fragment(config: dict[str, Any]) -> bool:
    """True for a YAML of Turbo attention keys only, like configs/modules/megatron/primus_turbo.yaml."""
    return not any(key in config for key in MODEL_KEYS)


def fragment_note(path: str, settings: Any) -> str:
    """What ``check`` and ``demo`` say of a module fragment: valid settings, no model to plan or train."""
    state = ("Megatron's own attention (use_turbo_attention: false)" if not settings.use_turbo_attention
             else "Turbo attention" + (" on the flex path" if settings.use_turbo_flex_attention else ""))
    return (f"{path}: a module fragment: Turbo attention settings only, all valid; its layers would run {state}. "
            "It has no model shape, so there is nothing to plan per layer or to train: merge it into a model "
            f"config with {', '.join(MODEL_KEYS)} (as configs/examples/*.yaml do) to see per-layer plans.")


def _refuse(path: str, reason: str, alternative: str) -> UnsupportedConfigError:
    return UnsupportedConfigError(Reason(settings=(path,), reason=f"the file {reason}.", alternative=alternative))


def load_yaml_mapping(path: str | os.PathLike[str], *, allow_empty: bool = True) -> dict[str, Any]:
    """The top-level mapping of a YAML file (``{}`` for an empty file when ``allow_empty``)."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as handle:
            raw = handle.read()
    except OSError as exc:
        raise _refuse(name, f"cannot be read ({exc.strerror or exc})", "give the path of a YAML file.") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _refuse(name, f"is not UTF-8 text (byte {exc.start}: {raw[exc.start:exc.start + 1]!r})",
                      "give a YAML text file saved as UTF-8.") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise _refuse(name, f"is not valid YAML: {exc}", "fix the YAML syntax.") from None
    if data is None:
        if allow_empty:
            return {}
        raise _refuse(name, "is empty", "write the model and Turbo keys, one 'key: value' per line.")
    if not isinstance(data, dict):
        raise _refuse(name, f"must hold a mapping of keys, got {type(data).__name__}",
                      "write one 'key: value' per line at the top level.")
    return data


__all__ = ["MODEL_KEYS", "fragment_note", "is_module_fragment", "load_yaml_mapping"]
