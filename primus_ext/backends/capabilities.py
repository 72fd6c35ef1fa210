"""What an installed kernel entry accepts, discovered from its signature.

Primus-Turbo builds differ (``sink`` on the varlen entry, ``deterministic`` on the
flex entries, the bshd flex entry); version strings say nothing reliable about
that, so every decision here reads ``inspect.signature``.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any, Callable, Optional

from torch import Tensor

from .. import refusals as R
from ..errors import Reason


# Answers per entry object: ``inspect.signature`` costs ~10 us, more than the rest of
# a kernel call, and an entry's signature never changes.  Weak keys: a replaced module
# (a new build, a test's fake) frees its entries' answers.
_ACCEPTS: "weakref.WeakKeyDictionary[Any, dict[str, bool]]" = weakref.WeakKeyDictionary()


def _read_signature(entry: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(entry).parameters
    except (TypeError, ValueError):
        return False
    if name in params and params[name].kind is not inspect.Parameter.POSITIONAL_ONLY:
        return True
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def entry_accepts(entry: Callable[..., Any], name: str) -> bool:
    """True when ``entry`` takes a keyword ``name`` (an entry with ``**kwargs`` takes any)."""
    try:
        known = _ACCEPTS.setdefault(entry, {})
    except TypeError:  # not weak-referenceable: read it every time
        return _read_signature(entry, name)
    found = known.get(name)
    if found is None:
        found = known[name] = _read_signature(entry, name)
    return found


_DEFAULTS: "weakref.WeakKeyDictionary[Any, dict[str, Any]]" = weakref.WeakKeyDictionary()


def without_defaults(entry: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` minus those equal to ``entry``'s own defaults: the same call, bound faster
    (each keyword costs the call ~0.1 us).  Compared by type and value, so ``0`` never
    stands for ``False`` or ``0.0``."""
    try:
        defaults = _DEFAULTS.get(entry)
        if defaults is None:
            params = inspect.signature(entry).parameters
            defaults = _DEFAULTS[entry] = {n: p.default for n, p in params.items()
                                           if p.default is not inspect.Parameter.empty}
    except (TypeError, ValueError):
        return dict(kwargs)
    kept = {}
    for name, value in kwargs.items():
        default = defaults.get(name, _MISSING)
        if default is value or (type(default) is type(value) and not isinstance(value, Tensor)
                                and default == value):
            continue
        kept[name] = value
    return kept


_MISSING = object()


def entry_name(entry: Optional[Callable[..., Any]]) -> str:
    return getattr(entry, "__name__", repr(entry)) if entry is not None else "none"


def sink_reason(entry: Callable[..., Any], *, where: str) -> Reason:
    return R.SINK_ENTRY.reason_for(where=where, entry=entry_name(entry))


def sink_kwargs_for(entry: Callable[..., Any], sink: Any, *, where: str) -> dict[str, Any]:
    """Keyword arguments that pass ``sink`` to ``entry`` exactly as it can take them.

    The entry takes ``sink`` -> forward it (``None`` included).  It does not and the
    sink is ``None`` -> omit the keyword (passing ``sink=None`` would be a TypeError).
    It does not and a sink is set -> refuse: dropping it would train another model.
    """
    if entry_accepts(entry, "sink"):
        return {"sink": sink}
    if sink is None:
        return {}
    raise R.refuse_all([sink_reason(entry, where=where)])


def deterministic_reason(entry: Callable[..., Any], *, where: str) -> Reason:
    return R.DETERMINISTIC_ENTRY.reason_for(where=where, entry=entry_name(entry))


def deterministic_kwargs_for(entry: Callable[..., Any], deterministic: bool, *, where: str) -> dict[str, Any]:
    """``{"deterministic": flag}`` when the entry takes it; refuse a requested but impossible one."""
    if entry_accepts(entry, "deterministic"):
        return {"deterministic": bool(deterministic)}
    if not deterministic:
        return {}
    raise R.refuse_all([deterministic_reason(entry, where=where)])


__all__ = [
    "deterministic_kwargs_for",
    "deterministic_reason",
    "entry_accepts",
    "entry_name",
    "sink_kwargs_for",
    "sink_reason",
    "without_defaults",
]
