"""Reading a YAML config file: one loader for `TurboAttentionSettings.from_yaml`, ``check`` and ``demo``.

A file that is not UTF-8 text, is empty, is not a mapping, or repeats a key is refused
with `UnsupportedConfigError` naming the file; PyYAML alone would let a repeated key
silently override the first one.  So is a file whose aliases expand to more than
`MAX_YAML_NODES` values (a "billion laughs" file: a few hundred bytes of nested
``*alias`` references that every later walk of the data, down to quoting it in a
refusal, would expand to gigabytes), or whose aliases refer to themselves.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, TypeVar

import yaml

from .. import refusals as R
from ..errors import UnsupportedConfigError, short_repr

MAX_YAML_NODES = 100_000
"""Most nodes (scalars, lists, mappings, keys included) a YAML file may hold once every
alias is expanded: far above any real config (hundreds), far below an alias bomb."""

_T = TypeVar("_T")


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:  # type: ignore[override]
        # A key written twice is refused; a key written over one merged in from `<<: *anchor` is YAML's
        # own override and stays allowed, so only the explicit keys are compared, before the merge.
        explicit = [(key_node, value) for key_node, value in node.value if key_node.tag != "tag:yaml.org,2002:merge"]
        if len(explicit) != len(node.value):
            self.flatten_mapping(node)
        seen: dict[Any, int] = {}
        for key_node, _ in explicit:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            try:
                repeated = key in seen
            except TypeError:  # an unhashable key (a list): the base class refuses it as YAML
                continue
            if repeated:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {short_repr(key)} appears twice (lines {seen[key]} and {line}); the second "
                    "would silently replace the first", key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


MODEL_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "seq_length")
"""Megatron's model-shape keys; a YAML with none of them is a module fragment (Turbo keys only)."""


def is_module_fragment(config: dict[str, Any]) -> bool:
    """True for a YAML of Turbo attention keys only, like configs/modules/megatron/primus_ext_attention.yaml."""
    return not any(key in config for key in MODEL_KEYS)


def fragment_note(path: str, settings: Any) -> str:
    """What ``check`` and ``demo`` say of a module fragment: valid settings, no model to plan or train."""
    state = ("Megatron's own attention (use_turbo_attention: false)" if not settings.use_turbo_attention
             else "Turbo attention" + (" on the flex path" if settings.use_turbo_flex_attention else ""))
    return (f"{path}: a module fragment: Turbo attention settings only, all valid; its layers would run {state}. "
            "It has no model shape, so there is nothing to plan per layer or to train: merge it into a model "
            f"config with {', '.join(MODEL_KEYS)} (as configs/examples/*.yaml do) to see per-layer plans.")


def _refuse(path: str, reason: str, alternative: str) -> UnsupportedConfigError:
    return R.refuse_build(R.YAML_FILE, path=path, what=reason, alternative=alternative)


def _expanded_size(root: yaml.Node, limit: int) -> Optional[int]:
    """How many nodes the document has with every alias expanded, without expanding it.

    An alias is the very node object of its anchor in the composed graph, so one count per
    distinct node (memoised by identity) is linear in the file.  The walk is iterative (a
    deep file must not overflow the stack), stops once past ``limit`` (returning a number
    above it) and returns ``None`` when a node contains itself (``&a [*a]``).
    """
    sizes: dict[int, int] = {}
    on_path: set[int] = set()  # nodes entered and not yet summed: the current path from the root
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, summed = stack.pop()
        children = _children(node)
        if summed:
            on_path.discard(id(node))
            sizes[id(node)] = size = 1 + sum(sizes[id(child)] for child in children)
            if size > limit:
                return size
        elif id(node) in on_path:
            return None
        elif id(node) not in sizes:
            on_path.add(id(node))
            stack.append((node, True))
            stack.extend((child, False) for child in children if id(child) not in sizes)
    return sizes[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _parse(name: str, text: str) -> Any:
    """The document's data; aliases are bounded (`MAX_YAML_NODES`) before anything is built."""
    loader = _UniqueKeyLoader(text)
    try:
        node = _step(name, loader.get_single_node)
        if node is None:
            return None
        size = _expanded_size(node, MAX_YAML_NODES)
        if size is None:
            raise _refuse(name, "has an alias that refers to a mapping or list containing it (a recursive "
                          "value)", "write the values out instead of the recursive *alias.")
        if size > MAX_YAML_NODES:
            raise _refuse(name, f"expands to more than {MAX_YAML_NODES:,} values once its *aliases are "
                          "expanded (limit MAX_YAML_NODES)", "write the values out, or use fewer aliases: "
                          "a config needs a few hundred values at most.")
        return _step(name, lambda: loader.construct_document(node))
    finally:
        loader.dispose()


def _step(name: str, step: Callable[[], _T]) -> _T:
    """Run one PyYAML step; what it raises for a bad file becomes a refusal naming the file."""
    try:
        return step()
    except yaml.YAMLError as exc:
        raise _refuse(name, f"is not valid YAML: {exc}", "fix the YAML syntax.") from None
    except RecursionError:
        raise _refuse(name, "nests lists or mappings too deeply to be read", "flatten the nesting.") from None
    except (ValueError, TypeError) as exc:  # an int of 5000 digits, a date 2020-13-45
        raise _refuse(name, f"holds a value YAML cannot build: {short_repr(str(exc))}",
                      "fix or quote that value.") from None


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
    data = _parse(name, text)
    if data is None:
        if allow_empty:
            return {}
        raise _refuse(name, "is empty", "write the model and Turbo keys, one 'key: value' per line.")
    if not isinstance(data, dict):
        raise _refuse(name, f"must hold a mapping of keys, got {type(data).__name__}",
                      "write one 'key: value' per line at the top level.")
    return data


__all__ = ["MAX_YAML_NODES", "MODEL_KEYS", "fragment_note", "is_module_fragment", "load_yaml_mapping"]
