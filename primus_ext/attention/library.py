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
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

if TYPE_CHECKING:  # pattern.py registers its own mask_mods here, so no runtime import back
    from .pattern import Pattern

F = TypeVar("F", bound=Callable[..., Any])

_PATTERNS: "weakref.WeakKeyDictionary[Any, Optional[Pattern]]" = weakref.WeakKeyDictionary()
_NAMES: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
_FACTORIES: "weakref.WeakSet[Any]" = weakref.WeakSet()


def register_library_mask(mask: F, pattern: "Optional[Pattern]", name: str) -> F:
    """Record ``mask`` (this very object) as computing ``pattern``; ``None``: no fixed kernel."""
    _PATTERNS[mask] = pattern
    _NAMES[mask] = name
    return mask


def _lookup(table: Any, obj: Any) -> Any:
    try:
        return table.get(obj)
    except TypeError:  # unhashable or not weak-referenceable: not ours
        return None


def library_pattern(mask: Any) -> "Optional[Pattern]":
    """The pattern of a library mask, by identity; ``None`` for anything else."""
    return _lookup(_PATTERNS, mask)


def library_name(mask: Any) -> Optional[str]:
    """``"sliding_window(4, 0)"``-style name of a library mask, by identity."""
    return _lookup(_NAMES, mask)


def is_library_mask(mask: Any) -> bool:
    try:
        return mask in _PATTERNS
    except TypeError:
        return False


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
    _FACTORIES.add(factory)
    return factory


def is_hook_factory(obj: Any) -> bool:
    try:
        return obj in _FACTORIES
    except TypeError:
        return False


__all__ = ["hook_factory", "is_hook_factory", "is_library_mask", "library_name", "library_pattern",
           "register_library_mask"]
