"""What a config may have primus_ext call (B32): the trust rule of hook resolution.

A config only *names* a hook; resolving it calls the named object (the probe, a factory),
so only a plain Python function defined outside the standard library, or an object
registered by `primus_ext.attention.library`, is ever called, and a standard-library,
builtins or torch module is not even imported.  torch's ``and_masks`` / ``or_masks``
(recognised by their code object, not their module) are trusted when every part is.
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any, Optional

from ..hooks.subset import combined_parts
from ..attention.library import is_hook_factory, is_library_mask

# C-level callables: they have no Python body to read and may do anything (os.system).
_C_CALLABLES = (types.BuiltinFunctionType, types.MethodWrapperType, types.WrapperDescriptorType,
                types.MethodDescriptorType, types.ClassMethodDescriptorType)


def is_stdlib(module_name: Any) -> bool:
    """True for builtins, standard-library and torch modules, judged by the top-level package.

    torch's own functions are never a user's hook, and some change process state when
    called (``torch:set_printoptions``), so a config may not name them either.
    """
    if not isinstance(module_name, str) or not module_name:
        return True  # no importable home: nothing vouches for it
    top = module_name.split(".", 1)[0]
    return (top in sys.stdlib_module_names or top in sys.builtin_module_names
            or top in ("builtins", "torch"))


def untrusted(obj: Any) -> Optional[str]:
    """What ``obj`` is, if a config may not have it called (B32); ``None`` if it may."""
    if is_library_mask(obj) or is_hook_factory(obj):
        return None  # registered by the library or opted in by its author, by identity
    combined = combined_parts(obj)
    if combined is not None:  # torch's and_masks / or_masks, by code object: trusted as its parts are
        name, parts = combined
        for part in parts:
            what = untrusted(part)
            if what is not None:
                return f"{name}(...) over {what}"
        return None
    if isinstance(obj, types.FunctionType):  # its globals say where its code lives; ``functools.wraps`` copies
        module = obj.__globals__.get("__name__")  # the wrapped function's __module__ onto a wrapper
        return f"a function of the standard library module `{module}`" if is_stdlib(module) else None
    if isinstance(obj, type):
        return f"the class `{obj.__module__}.{obj.__qualname__}`"
    if isinstance(obj, functools.partial):
        return "a functools.partial"
    if isinstance(obj, _C_CALLABLES):
        return "a built-in (C) function"
    if isinstance(obj, types.MethodType):
        return "a bound method"
    return f"a callable `{type(obj).__name__}` instance"


__all__ = ["is_stdlib", "untrusted"]
