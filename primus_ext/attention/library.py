"""Which callables are the library's own: masks by identity, and opted-in hook factories.

A library mask is known by the function object itself, held in a weak registry, never
by an attribute: ``functools.wraps`` copies a function's ``__dict__`` onto a wrapper, so
an attribute tag would make any wrapper look like the library mask it wraps and run on
a fixed kernel without ever being evaluated.  A wrapper is a new object, so it is traced
and proven like any other user hook.

Factories: a YAML may only *call* a callable that is marked with `hook_factory` (B32);
everything else it names must be the hook itself.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

class _IdentityRegistry:
    """Values keyed by the identity of live objects (``__eq__``/``__hash__`` are never used,
    so an object that claims to equal a library mask is not it)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple["weakref.ref[Any]", Any]] = {}

    def add(self, obj: Any, value: Any) -> None:
        key = id(obj)
        self._entries[key] = (weakref.ref(obj, lambda _, k=key: self._entries.pop(k, None)), value)

    def get(self, obj: Any, default: Any = None) -> Any:
        entry = self._entries.get(id(obj))
        if entry is None or entry[0]() is not obj:
            return default
        return entry[1]

    def __contains__(self, obj: Any) -> bool:
        entry = self._entries.get(id(obj))
        return entry is not None and entry[0]() is obj


_MASKS = _IdentityRegistry()  # mask -> (pattern or None, name)
_FACTORIES = _IdentityRegistry()


def register_library_mask(mask: F, pattern: Any, name: str) -> F:
    """Record ``mask`` (this very object) as computing ``pattern`` (a `~primus_ext.attention.pattern.Pattern`,
    which registers its own masks here, so this module imports nothing back); ``None``: no fixed kernel."""
    _MASKS.add(mask, (pattern, name))
    return mask


def library_pattern(mask: Any) -> Any:
    """The `Pattern` of a library mask, by identity; ``None`` for anything else."""
    return _MASKS.get(mask, (None, None))[0]


def library_name(mask: Any) -> Optional[str]:
    """``"sliding_window(4, 0)"``-style name of a library mask, by identity."""
    return _MASKS.get(mask, (None, None))[1]


def is_library_mask(mask: Any) -> bool:
    return mask in _MASKS


def hook_factory(factory: F) -> F:
    """Mark ``factory`` as one a config may call with ``<setting>_kwargs`` to make a hook.

    Use it on your own factories::

        from primus_ext import hook_factory

        @hook_factory
        def banded(width: int):
            def mask(b, h, q_idx, kv_idx):
                return (q_idx - kv_idx).abs() <= width
            return mask
    """
    _FACTORIES.add(factory, True)
    return factory


def is_hook_factory(obj: Any) -> bool:
    return obj in _FACTORIES


__all__ = ["hook_factory", "is_hook_factory", "is_library_mask", "library_name", "library_pattern",
           "register_library_mask"]
