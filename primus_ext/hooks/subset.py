"""The provable subset of Python: which hooks a proof may be about (B31).

A proof is about the traced graph; it is only about the hook that runs when the hook's
Python computes the same thing traced and called.  Rather than list what breaks that
(a type check, a ``try`` around an op that fails on tracer objects, the environment,
the clock), the hook's bytecode, and that of every function it calls, is checked
against an *allow-list* before tracing.  Admitted:

* arithmetic, comparisons, bitwise and boolean operators, subscripts, tuples, local
  variables and forward branches (no loops);
* loads of module globals, closure variables and default arguments whose values are
  immutable constants, tensors or number lists (each re-checked per call by
  `hook_trace`), modules, and functions; attributes only of modules, and of tensors
  from `TENSOR_METHODS` / `TENSOR_ATTRIBUTES`;
* calls of `TORCH_FUNCTIONS`, `BUILTINS`, `MATH_FUNCTIONS`, tensor methods, primus_ext
  library masks, user functions that are themselves in the subset, and torch's
  ``and_masks`` / ``or_masks`` over admitted masks (recognised by their code object).

Anything else (any other call, attribute, ``try`` / ``with``, loops, nested functions or
lambdas, writes to globals, cells or attributes, generators, imports) makes the hook
*dynamic*: `outside_subset` names the construct and its source line.  A dynamic hook is
never proven; it is evaluated exactly (``reference``) or refused.
"""

from __future__ import annotations

import builtins
import dis
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .allowlist import (BUILTINS, COMBINATORS, MATH_FUNCTIONS, OPERATORS, PACKAGE_DIRS, PLAIN, STDLIB_DIR,
                             TENSOR_ATTRIBUTES, TENSOR_METHODS, TORCH_DIR, TORCH_FUNCTIONS, WORDS)
from ..attention.library import is_library_mask

_MAX_DEPTH = 16


@dataclass(frozen=True)
class Outside:
    """The first construct of a hook outside the provable subset, and where it is."""

    construct: str
    where: str

    def describe(self) -> str:
        return f"{self.construct} ({self.where})"


class _Dynamic(Exception):
    def __init__(self, construct: str) -> None:
        super().__init__(construct)
        self.construct = construct


@dataclass(frozen=True)
class _Known:
    value: Any


@dataclass(frozen=True)
class _Runtime:
    """A value computed when the hook runs: an index, a tensor, a number."""


@dataclass(frozen=True)
class _Method:
    name: str


_NULL, _RUNTIME = object(), _Runtime()


def _qualname(value: Any) -> str:
    module = getattr(value, "__module__", None) or ""
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None) or type(value).__name__
    return f"{module}.{name}" if module and module != "builtins" else f"{name}"


def user_code(code: types.CodeType) -> bool:
    """Code outside torch and the standard library (installed packages count as the user's)."""
    path = code.co_filename
    if path.startswith(TORCH_DIR) or path.startswith("<frozen"):
        return False
    return path.startswith(PACKAGE_DIRS) or not path.startswith(STDLIB_DIR)


_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_TENSORS = (torch.Tensor, torch.nn.Parameter)
"""Exact types only: a subclass may define operators that run other code on real values."""


def _constant(value: Any) -> bool:
    return type(value) in _SCALARS or type(value) is tuple and all(_constant(v) for v in value)


def number_list(value: Any) -> bool:
    """A plain list of plain numbers (nested lists too): re-checked by value before each call."""
    return type(value) is list and all(type(v) in (bool, int, float) or number_list(v) for v in value)


def _member(value: Any, allowed: frozenset[Any]) -> bool:
    try:
        return value in allowed
    except TypeError:  # unhashable
        return False


def _admit(value: Any, name: str) -> _Known:
    """A loaded value that may enter the hook (operations on it are checked when used)."""
    if (type(value) in (types.ModuleType, types.FunctionType, types.BuiltinFunctionType) or type(value) in _TENSORS
            or _constant(value) or number_list(value) or _member(value, TORCH_FUNCTIONS) or _member(value, BUILTINS)):
        return _Known(value)
    if isinstance(value, type):
        raise _Dynamic(f"the class {name} (a class's attributes and operators can change between calls)")
    raise _Dynamic(f"the value {name}, a {type(value).__name__} that can change between calls")


def _same(x: Any, y: Any) -> bool:
    """One abstract value on both paths (by identity: a captured tensor has no usable ``==``)."""
    if isinstance(x, _Known) and isinstance(y, _Known):
        return x.value is y.value
    return x is y or (type(x) is type(y) is _Method and x.name == y.name)


def _is_code(value: Any) -> bool:
    """A module, function or other callable: what a hook may only use where the checker sees it."""
    return isinstance(value, _Known) and (type(value.value) is types.ModuleType or (
        callable(value.value) and not isinstance(value.value, torch.Tensor)))


def _kind(value: Any) -> str:
    return "module" if type(value.value) is types.ModuleType else "function"


def _unify(x: Any, y: Any) -> Any:
    if _same(x, y):
        return x
    if _is_code(x) or _is_code(y):  # e.g. `f = isinstance if FLAG else abs`: which one runs is not known here
        raise _Dynamic("a function or module chosen by a branch")
    return _RUNTIME


def _merge(a: list[Any], b: list[Any]) -> list[Any]:
    if len(a) != len(b):
        raise _Dynamic("branches that leave different stack depths")
    return [_unify(x, y) for x, y in zip(a, b)]


def _merge_locals(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {k: _unify(a[k], b[k]) if k in a and k in b else _unify(a.get(k, _RUNTIME), b.get(k, _RUNTIME))
            for k in a.keys() | b.keys()}


def _attribute(base: Any, name: str) -> Any:
    if isinstance(base, _Known):
        value = base.value
        if isinstance(value, types.ModuleType):
            if not hasattr(value, name):
                raise _Dynamic(f"the undefined attribute {value.__name__}.{name}")
            return _admit(getattr(value, name), f"{value.__name__}.{name}")
        if not isinstance(value, torch.Tensor):
            raise _Dynamic(f"the attribute .{name} of a {type(value).__name__} (attributes are read only "
                           "from modules and tensors)")
    if name in TENSOR_METHODS:
        return _Method(name)
    if name in TENSOR_ATTRIBUTES:
        return _RUNTIME
    raise _Dynamic(f"the attribute .{name}, which is not an elementwise tensor method")


class _Checker:
    """Walks code objects with a small stack model: what each call and attribute is applied to."""

    def __init__(self) -> None:
        self.active: set[int] = set()
        self.where = ""
        self.depth = 0

    def function(self, fn: types.FunctionType, index_args: int, depth: int) -> None:
        if depth > _MAX_DEPTH or id(fn) in self.active:
            raise _Dynamic(f"recursion into {fn.__qualname__}")
        code = fn.__code__
        if not user_code(code):
            raise _Dynamic(f"a call of {_qualname(fn)}, a function of torch or the standard library")
        self.where = f"{code.co_filename}:{code.co_firstlineno} in {code.co_name}"
        if type(fn.__globals__) is not dict:
            raise _Dynamic(f"a {type(fn.__globals__).__name__} as the globals of {code.co_name}")
        if code.co_flags & (0x20 | 0x80 | 0x100 | 0x200):  # generator, coroutine, async generator
            raise _Dynamic("a generator or coroutine")
        if getattr(code, "co_exceptiontable", b""):
            uses_with = any(i.opname == "BEFORE_WITH" for i in dis.get_instructions(code))
            raise _Dynamic("a with block" if uses_with else "a try block")
        self.active.add(id(fn))
        outer, self.depth = self.depth, depth
        try:
            self._code(fn, index_args, depth)
        finally:
            self.active.discard(id(fn))
            self.depth = outer

    def _initial_locals(self, fn: types.FunctionType, index_args: int) -> dict[str, Any]:
        code = fn.__code__
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        defaults = dict(zip(code.co_varnames[:code.co_argcount][code.co_argcount - len(fn.__defaults__ or ()):],
                            fn.__defaults__ or ()))
        defaults.update(fn.__kwdefaults__ or {})
        out: dict[str, Any] = {}
        for i, name in enumerate(names):
            # Only torch's call of the hook itself is known to leave the defaults in place: a function the
            # hook calls may be passed anything for any parameter, so there each is a run-time value.
            if self.depth == 0 and i >= index_args and name in defaults:
                value = _admit(defaults[name], f"{name} (a default argument)")
                if _is_code(value):
                    raise _Dynamic(f"the {_kind(value)} {name} as a default argument (only module globals may hold "
                                   "code the hook runs)")
                out[name] = value
            else:
                out[name] = _RUNTIME
        return out

    def _load_global(self, fn: types.FunctionType, name: str) -> _Known:
        if name in fn.__globals__:
            return _admit(fn.__globals__[name], name)
        if hasattr(builtins, name):
            return _admit(getattr(builtins, name), name)
        raise _Dynamic(f"the undefined name {name}")

    def _code(self, fn: types.FunctionType, index_args: int, depth: int) -> None:
        code = fn.__code__
        cells = dict(zip(code.co_freevars, fn.__closure__ or ()))
        local = self._initial_locals(fn, index_args)
        stack: Optional[list[Any]] = []
        pending: dict[int, tuple[list[Any], dict[str, Any]]] = {}
        line = code.co_firstlineno
        for ins in dis.get_instructions(code):
            if ins.positions is not None and ins.positions.lineno:
                line = ins.positions.lineno
            self.where = f"{code.co_filename}:{line} in {code.co_name}"
            if ins.offset in pending:
                other_stack, other_local = pending.pop(ins.offset)
                if stack is None:
                    stack, local = other_stack, other_local
                else:  # two paths meet: a value they disagree on is only known at run time
                    stack, local = _merge(stack, other_stack), _merge_locals(local, other_local)
            if stack is None:
                continue  # unreachable
            op = ins.opname
            if op in PLAIN:
                continue
            if op in WORDS:
                raise _Dynamic(WORDS[op])
            if op == "LOAD_FAST":
                stack.append(local.get(ins.argval, _RUNTIME))
            elif op == "STORE_FAST":
                value = stack.pop()
                if isinstance(value, _Known) and type(value.value) is types.ModuleType:
                    raise _Dynamic(f"the module {value.value.__name__} held in a local variable (its attributes "
                                   "are then read where no per-call check sees them)")
                local[ins.argval] = value
            elif op == "LOAD_CONST":
                if isinstance(ins.argval, types.CodeType):
                    raise _Dynamic("a nested function or lambda")
                stack.append(_Known(ins.argval))
            elif op in ("LOAD_DEREF", "LOAD_CLASSDEREF"):
                cell = cells.get(ins.argval)
                try:
                    value = cell.cell_contents if cell is not None else None
                except ValueError:
                    raise _Dynamic(f"the captured variable {ins.argval}, which is not yet set") from None
                if cell is None:
                    raise _Dynamic(f"the variable {ins.argval} of an enclosing function")
                known = _admit(value, f"{ins.argval} (a captured variable)")
                if type(known.value) is types.ModuleType:
                    raise _Dynamic(f"the module {known.value.__name__} held in the captured variable {ins.argval} "
                                   "(only module globals may hold code the hook runs)")
                stack.append(known)
            elif op == "LOAD_GLOBAL":
                if ins.arg is not None and ins.arg & 1:
                    stack.append(_NULL)
                stack.append(self._load_global(fn, ins.argval))
            elif op == "LOAD_ATTR":
                stack.append(_attribute(stack.pop(), ins.argval))
            elif op == "LOAD_METHOD":
                base = stack.pop()
                stack.extend((_attribute(base, ins.argval), base))
            elif op == "PUSH_NULL":
                stack.append(_NULL)
            elif op == "CALL":
                argc = int(ins.arg or 0)
                args = stack[len(stack) - argc:]
                del stack[len(stack) - argc:]
                second, first = stack.pop(), stack.pop()
                self._call(second if first is _NULL else first, args, depth)
                stack.append(_RUNTIME)
            elif op in ("BINARY_OP", "COMPARE_OP", "IS_OP", "CONTAINS_OP", "BINARY_SUBSCR"):
                del stack[-2:]
                stack.append(_RUNTIME)
            elif op in ("UNARY_NEGATIVE", "UNARY_POSITIVE", "UNARY_INVERT", "UNARY_NOT"):
                stack[-1] = _RUNTIME
            elif op in ("BUILD_TUPLE", "BUILD_SLICE"):
                items = stack[len(stack) - int(ins.arg or 0):]
                if any(_is_code(v) for v in items):
                    raise _Dynamic("a function or module inside a tuple (it is no longer known where it is used)")
                del stack[len(stack) - int(ins.arg or 0):]
                stack.append(_RUNTIME)
            elif op == "POP_TOP":
                stack.pop()
            elif op == "COPY":
                stack.append(stack[-int(ins.arg)])
            elif op == "SWAP":
                i = int(ins.arg)
                stack[-1], stack[-i] = stack[-i], stack[-1]
            elif op.startswith("POP_JUMP_FORWARD_IF_"):
                stack.pop()
                self._branch(pending, ins.argval, stack, local)
            elif op in ("JUMP_IF_TRUE_OR_POP", "JUMP_IF_FALSE_OR_POP"):
                self._branch(pending, ins.argval, stack, local)
                stack.pop()
            elif op == "JUMP_FORWARD":
                self._branch(pending, ins.argval, stack, local)
                stack = None
            elif op == "RETURN_VALUE":
                if _is_code(stack[-1]):
                    raise _Dynamic("a function or module returned (the caller's use of it is not checked)")
                stack = None
            else:
                raise _Dynamic(f"the operation {op}")

    @staticmethod
    def _branch(pending: dict[int, tuple[list[Any], dict[str, Any]]], target: int, stack: list[Any],
                local: dict[str, Any]) -> None:
        """Forward only, so every path into ``target`` is walked before it; each keeps its own locals."""
        state = (list(stack), dict(local))
        if target in pending:
            state = (_merge(pending[target][0], state[0]), _merge_locals(pending[target][1], state[1]))
        pending[target] = state

    def _call(self, callee: Any, args: list[Any], depth: int) -> None:
        if isinstance(callee, _Method):
            return
        if not isinstance(callee, _Known):
            raise _Dynamic("a call of a computed value")
        fn = callee.value
        for arg in args:
            if _is_code(arg):
                raise _Dynamic(f"a {_kind(arg)} passed as an argument to {_qualname(fn)} (it is not checked there)")
        if fn is len and all(isinstance(a, _Known) for a in args):
            return  # of a constant: a tensor's length differs between torch's calls (0-d) and broadcast grids
        if any(_member(fn, allowed) for allowed in (TORCH_FUNCTIONS, BUILTINS, MATH_FUNCTIONS, OPERATORS)):
            return
        if isinstance(fn, types.FunctionType):
            where = self.where
            self.hook(fn, len(fn.__code__.co_varnames[:fn.__code__.co_argcount]), depth + 1)
            self.where = where
            return
        raise _Dynamic(f"a call of {_qualname(fn)}")

    def hook(self, fn: Any, index_args: int, depth: int) -> None:
        """``fn`` as a hook or a function a hook calls: ``index_args`` parameters are run-time values."""
        if isinstance(fn, types.MethodType):
            raise _Dynamic(f"the method {fn.__qualname__} of an object (its attributes can change between calls)")
        if not isinstance(fn, types.FunctionType):
            raise _Dynamic(f"a callable {type(fn).__name__} object (only plain functions are checked)")
        if is_library_mask(fn):
            return
        combinator = COMBINATORS.get(fn.__code__)
        if combinator is not None:
            parts = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ())).get("mask_mods")
            for part in parts.cell_contents if parts is not None else ():
                self.hook(part, 4, depth + 1)
            return
        self.function(fn, index_args, depth)


def outside_subset(hook: Callable[..., Any], kind: str) -> Optional[Outside]:
    """The first construct of ``hook`` (``mask_mod`` or ``score_mod``) outside the provable subset, or None."""
    checker = _Checker()
    try:
        checker.hook(hook, 4 if kind == "mask_mod" else 5, 0)
    except _Dynamic as exc:
        return Outside(exc.construct, checker.where or f"the hook {_qualname(hook)}")
    return None


def combined_parts(hook: Any) -> Optional[tuple[str, tuple[Any, ...]]]:
    """``("and_masks" | "or_masks", parts)`` for a mask built by torch's combinators, else None."""
    code = getattr(hook, "__code__", None)
    if not isinstance(hook, types.FunctionType) or code not in COMBINATORS:
        return None
    parts = dict(zip(code.co_freevars, hook.__closure__ or ())).get("mask_mods")
    return COMBINATORS[code], tuple(parts.cell_contents) if parts is not None else ()


__all__ = ["BUILTINS", "COMBINATORS", "MATH_FUNCTIONS", "Outside", "TENSOR_ATTRIBUTES", "TENSOR_METHODS",
           "TORCH_FUNCTIONS", "combined_parts", "number_list", "outside_subset", "user_code"]
