"""What a user hook reads: a torch.fx trace plus the Python values its code looks up.

A proof about a hook is only as good as the inputs it assumed.  Tracing gives the
hook's arithmetic as a graph over ``(b, h, q_idx, kv_idx)`` (and ``score``); Python
control flow on those values cannot be traced and makes the hook unprovable.  The
functions a hook can run (its own Python code, not torch's or the standard library's)
are found from its closures and globals, so every module global, module attribute
(``cfg.WINDOW``), default argument and closure variable it reads is known by name:

* code (functions, modules, classes), dtypes, devices and immutable closure values
  (numbers, strings, tuples of them, frozen dataclasses) are part of the hook;
* a module global number can be rebound, a captured tensor changed in place, a
  captured list edited: each becomes an `Assumption` that a proof relies on and
  that is re-checked before a call (cheap: no tensor values are read);
* any other object (dicts, custom objects, tensors the graph does not index)
  makes the hook *dynamic*: it is evaluated exactly or refused.
"""

from __future__ import annotations

import builtins
import dataclasses
import dis
import functools
import reprlib  # bounded: a captured value may be a factory's whole kwargs
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from .fxtrace import symbolic_trace
from .subset import COMBINATORS, Outside, number_list, outside_subset, user_code

_META_ATTRS = {"device", "dtype", "shape", "ndim", "is_cuda"}
_SHAPE_ONLY_METHODS = {"new_ones", "new_zeros", "new_full", "new_empty", "size", "dim"}


@dataclass(frozen=True)
class Assumption:
    """A value a proof used that could change after it: re-checked before each call."""

    what: str
    holds: Callable[[], bool] = field(compare=False, repr=False)


@dataclass
class HookTrace:
    """A traced hook: its graph (or why there is none) and what it reads."""

    graph: Optional[fx.GraphModule]
    problem: str = ""
    reads: list[str] = field(default_factory=list)
    """Human words for every input beyond q_idx, kv_idx and literals, e.g. "the head index"."""
    dynamic: list[str] = field(default_factory=list)
    """Inputs no proof can rely on (a dict, an object, data-dependent control flow)."""
    assumptions: list[Assumption] = field(default_factory=list)
    tensor_names: dict[int, str] = field(default_factory=dict)
    """``id(tensor) -> name`` of captured tensors, for messages."""
    outside: Optional[Outside] = None
    """The first construct outside the provable subset (`hook_subset`): no proof is about this hook."""


def _immutable(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, torch.dtype, torch.device)):
        return True
    if isinstance(value, (tuple, frozenset)):
        return all(_immutable(v) or _is_code(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        params = getattr(type(value), "__dataclass_params__", None)
        return bool(params and params.frozen) and all(
            _immutable(getattr(value, f.name)) for f in dataclasses.fields(value))
    return False


def _is_code(value: Any) -> bool:
    """Code, known by its type (a ``__module__`` that says ``torch`` proves nothing: any object can say so)."""
    return isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType,
                              type, torch._ops.OpOverloadPacket, torch._ops.OpOverload,
                              torch._ops.HigherOrderOperator))


_LOADS = {"LOAD_GLOBAL": "global", "LOAD_NAME": "global", "LOAD_DEREF": "deref", "LOAD_CLASSDEREF": "deref",
          "LOAD_FAST": "fast"}


@functools.lru_cache(maxsize=1024)
def _reads(code: types.CodeType) -> frozenset[tuple[str, ...]]:
    """``("global", "cfg", "W")`` for every ``cfg.W`` a code object (and code nested in it) loads.

    The first item says where the name lives: a module global, a closure cell
    (``deref``) or a local such as a parameter with a default (``fast``).  The attribute
    chain is kept so that ``cfg.W`` is seen, not just ``cfg``.
    """
    reads: set[tuple[str, ...]] = set()
    chain: list[str] = []
    for ins in dis.get_instructions(code):
        if ins.opname in _LOADS:
            if chain:
                reads.add(tuple(chain))
            chain = [_LOADS[ins.opname], str(ins.argval)]
        elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and chain:
            chain.append(str(ins.argval))
        elif chain:
            reads.add(tuple(chain))
            chain = []
    if chain:
        reads.add(tuple(chain))
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            reads |= {r for r in _reads(const) if r[0] == "global"}
    return frozenset(reads)


def _global_reads(code: types.CodeType) -> frozenset[tuple[str, ...]]:
    return frozenset(r[1:] for r in _reads(code) if r[0] == "global")


_DYNAMIC_BUILTINS = {"globals", "vars", "locals", "eval", "exec", "__import__", "getattr", "setattr",
                     "compile", "open", "input"}


def _has_attributes(value: Any) -> bool:
    """Values whose attributes a chain ``a.b.c`` is followed through (and can be rebound)."""
    return isinstance(value, (types.ModuleType, type, types.FunctionType))


def _follow(value: Any, attrs: tuple[str, ...]) -> tuple[Any, Any, str, int]:
    """``(owner, value, last attribute, depth)`` after following ``attrs`` as far as they lead."""
    owner, last, depth = None, "", 0
    for attr in attrs:
        if not _has_attributes(value) or not hasattr(value, attr):
            break
        owner, last = value, attr
        value, depth = getattr(value, attr), depth + 1
    return owner, value, last, depth


def _cells(fn: types.FunctionType) -> dict[str, tuple[Any, Any]]:
    """``name -> (cell, value)``; an empty cell (filled later) has the value `_MISSING`."""
    out: dict[str, tuple[Any, Any]] = {}
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            out[name] = (cell, cell.cell_contents)
        except ValueError:
            out[name] = (cell, _MISSING)
    return out


def _cell_check(cell: Any, value: Any) -> Callable[[], bool]:
    def holds() -> bool:  # `nonlocal` can rebind a captured variable after the proof
        try:
            return cell.cell_contents is value
        except ValueError:
            return False
    return holds


def _reachable(hook: Any) -> list[tuple[types.FunctionType, dict[str, tuple[Any, Any]]]]:
    """The Python functions a hook can run, found from its closures, defaults and globals.

    Found statically (no tracing hook is installed, so profilers and debuggers keep
    working): torch's own functions are followed only through their closures
    (``and_masks`` keeps the user's masks there), never through their globals.
    """
    found: list[tuple[types.FunctionType, dict[str, tuple[Any, Any]]]] = []
    seen: set[int] = set()
    stack: list[Any] = [hook]
    while stack:
        obj = stack.pop()
        if isinstance(obj, (tuple, list)):
            stack.extend(v for v in obj if callable(v) or isinstance(v, (tuple, list)))
            continue
        if isinstance(obj, types.MethodType):
            obj = obj.__func__
        if not isinstance(obj, types.FunctionType) or id(obj) in seen:
            continue
        seen.add(id(obj))
        cells = _cells(obj)
        stack.extend(v for _, v in cells.values())
        stack.extend(obj.__defaults__ or ())
        stack.extend((obj.__kwdefaults__ or {}).values())
        if not user_code(obj.__code__) and obj.__code__ not in COMBINATORS:  # and_masks' parts live in a cell
            continue
        found.append((obj, cells))
        for chain in _global_reads(obj.__code__):
            _, value, _, _ = _follow(obj.__globals__.get(chain[0]), chain[1:])
            if isinstance(value, (types.FunctionType, types.MethodType, tuple, list)):
                stack.append(value)
    return found


def cell_assumptions(hook: Any) -> tuple[Assumption, ...]:
    """That no closure variable of the functions ``hook`` can run is rebound (``nonlocal``).

    A proof found by fingerprint for another closure with equal values checked that
    closure's cells; this one's are its own.
    """
    reachable = _reachable(hook)
    return tuple(Assumption(f"the captured variable {name} is the same object", _cell_check(cell, value))
                 for _, cells in reachable for name, (cell, value) in cells.items()
                 if value is not _MISSING) + tuple(_function_assumption(fn) for fn, _ in reachable)


def _function_assumption(fn: types.FunctionType) -> Assumption:
    return Assumption(f"the code and default arguments of {fn.__code__.co_name} are the same objects",
                      _defaults_check(fn))


def _builtin_check(globals_: dict[str, Any], name: str) -> Callable[[], bool]:
    value = getattr(builtins, name)
    return lambda: name not in globals_ and getattr(builtins, name, _MISSING) is value


def _rebinding_check(globals_: dict[str, Any], name: str, value: Any) -> Callable[[], bool]:
    return lambda: globals_.get(name, _MISSING) is value


_MISSING = object()


SNAPSHOT_MAX = 1 << 20
"""Captured tensors up to this many elements are also compared by value (a write through ``.data``, numpy or
the storage bumps no version counter); a larger one cannot be watched, so no proof rests on it and flex
rebuilds its BlockMask at every call."""


def _tensor_check(tensor: torch.Tensor) -> Callable[[], bool]:
    """In-place writes bump ``_version``; writes through ``.data`` or numpy do not, so small
    tensors are also compared with a copy (on a device, by an asynchronous assert: no sync)."""
    version, ptr = tensor._version, tensor.data_ptr()
    snapshot = tensor.detach().clone() if tensor.numel() <= SNAPSHOT_MAX else None

    def holds() -> bool:
        if tensor._version != version or tensor.data_ptr() != ptr:
            return False
        return same_values(snapshot, tensor, "primus_ext: a tensor a hook proof read has changed (B31)")

    return holds


def same_values(snapshot: Optional[torch.Tensor], live: torch.Tensor, message: str) -> bool:
    """``live`` still holds ``snapshot``'s values (None: too large to keep, the version counter decides).  On a
    device an asynchronous assert with ``message`` instead of a host sync: the process stops, it never goes on."""
    if snapshot is None:
        return True
    if live.device.type == "cpu":
        return torch.equal(live.detach(), snapshot)
    torch._assert_async((live.detach() == snapshot).all(), message)
    return True


def _list_check(value: list[Any]) -> Callable[[], bool]:
    snapshot = repr(value)
    return lambda: repr(value) == snapshot


def _classify(trace: HookTrace, name: str, value: Any, where: str, rebind: Optional[Callable[[], bool]]) -> None:
    label = f"the {where} {name}"
    if _is_code(value) and not isinstance(value, torch.Tensor):
        if rebind is not None:  # a helper function or module can be rebound too
            trace.assumptions.append(Assumption(f"{label} is the same object", rebind))
        return
    if isinstance(value, torch.Tensor):
        if value.numel() > SNAPSHOT_MAX:
            trace.reads.append(f"{label} (a tensor)")
            trace.dynamic.append(f"{label}, a tensor of {value.numel()} elements, too large to watch for writes "
                                 f"that bump no version counter (at most {SNAPSHOT_MAX})")
            return
        trace.tensor_names.setdefault(id(value), name)
        check = _tensor_check(value)
        holds = check if rebind is None else (lambda c=check, r=rebind: r() and c())
        trace.assumptions.append(Assumption(f"{label} (a tensor) is unchanged", holds))
        trace.reads.append(f"{label} (a tensor)")
        return
    if _immutable(value):
        if rebind is not None:  # a module global can be rebound
            trace.assumptions.append(Assumption(f"{label} is still {reprlib.repr(value)}", rebind))
            trace.reads.append(f"{label} ({reprlib.repr(value)})")
        return
    if number_list(value):
        check = _list_check(value)
        holds = check if rebind is None else (lambda c=check, r=rebind: r() and c())
        trace.assumptions.append(Assumption(f"{label} (a list) is unchanged", holds))
        trace.reads.append(f"{label} (a list)")
        return
    trace.reads.append(f"{label} (a {type(value).__name__})")
    trace.dynamic.append(f"{label}, a {type(value).__name__} that can change between calls")


def _attribute_check(owner: Any, attr: str, value: Any) -> Callable[[], bool]:
    return lambda: getattr(owner, attr, _MISSING) is value


def _inspect(trace: HookTrace, hook: Any) -> None:
    builtin_names = vars(builtins)
    for fn, cells in _reachable(hook):
        code = fn.__code__
        if any(ins.opname == "IMPORT_NAME" for ins in dis.get_instructions(code)):
            trace.dynamic.append(f"an import inside {code.co_name}, whose values can change between calls")
        for name, (cell, value) in cells.items():
            if value is _MISSING:
                trace.dynamic.append(f"the captured variable {name}, which is not yet set")
            else:
                _classify(trace, name, value, "captured variable", _cell_check(cell, value))
        trace.assumptions.append(_function_assumption(fn))  # `fn.__code__ = ...`, `fn.__defaults__ = ...` later
        for i, value in enumerate(fn.__defaults__ or ()):
            _classify(trace, f"#{i}", value, "default argument", None)
        for name, value in (fn.__kwdefaults__ or {}).items():
            _classify(trace, name, value, "default argument", None)
        _inspect_attribute_reads(trace, fn, cells)
        globals_ = fn.__globals__
        for chain in sorted(_global_reads(code)):
            if chain[0] not in globals_:
                if chain[0] in _DYNAMIC_BUILTINS:
                    trace.dynamic.append(f"the builtin {chain[0]}(), which reads or changes state by name")
                elif chain[0] not in builtin_names:
                    trace.dynamic.append(f"the undefined global {chain[0]}")
                else:  # a builtin (abs): a module global of that name, or another builtin, would take its place
                    trace.assumptions.append(Assumption(f"the name {chain[0]} is still the builtin",
                                                        _builtin_check(globals_, chain[0])))
                continue
            root = globals_[chain[0]]
            if getattr(root, "__name__", "") == "importlib" or root is builtins:
                trace.dynamic.append(f"{chain[0]}, which loads values by name at call time")
                continue
            owner, value, attr, depth = _follow(root, chain[1:])
            check = (_rebinding_check(globals_, chain[0], root) if owner is None
                     else _both(_rebinding_check(globals_, chain[0], root), _attribute_check(owner, attr, value)))
            _classify(trace, ".".join(chain[:depth + 1]), value, "module global", check)


def _defaults_check(fn: types.FunctionType) -> Callable[[], bool]:
    code, positional = fn.__code__, fn.__defaults__
    keywords = dict(fn.__kwdefaults__ or {})

    def holds() -> bool:
        now = fn.__kwdefaults__ or {}
        return (fn.__code__ is code and fn.__defaults__ is positional and now.keys() == keywords.keys()
                and all(now[k] is v for k, v in keywords.items()))
    return holds


def _defaults(fn: types.FunctionType) -> dict[str, Any]:
    code = fn.__code__
    names = code.co_varnames[:code.co_argcount]
    values = dict(zip(names[len(names) - len(fn.__defaults__ or ()):], fn.__defaults__ or ()))
    values.update(fn.__kwdefaults__ or {})
    return values


def _inspect_attribute_reads(trace: HookTrace, fn: types.FunctionType, cells: dict[str, tuple[Any, Any]]) -> None:
    """``cfg.W`` where ``cfg`` is a captured variable or a parameter's default (a class, a module)."""
    defaults = _defaults(fn)
    for where, name, *attrs in sorted(_reads(fn.__code__)):
        if not attrs or where == "global":
            continue
        if where == "deref" and name in cells and cells[name][1] is not _MISSING:
            root, label = cells[name][1], "captured variable"
        elif where == "fast" and name in defaults:
            root, label = defaults[name], "default argument"
        else:
            continue
        owner, value, attr, depth = _follow(root, tuple(attrs))
        if depth:
            _classify(trace, ".".join([name, *attrs[:depth]]), value, label,
                      _attribute_check(owner, attr, value))


def _both(first: Callable[[], bool], second: Callable[[], bool]) -> Callable[[], bool]:
    return lambda: first() and second()


def _value_uses(graph: fx.Graph, placeholder: fx.Node) -> bool:
    """True when the hook's value depends on this input (not only its device or shape)."""
    for user in placeholder.users:
        if user.op == "call_method" and user.target in _SHAPE_ONLY_METHODS and user.args[0] is placeholder:
            continue
        if user.op == "call_function" and user.target is getattr and user.args[1] in _META_ATTRS:
            continue
        return True
    return False


def trace_hook(hook: Callable[..., Any], kind: str) -> HookTrace:
    """Trace ``hook`` (``kind`` ``mask_mod`` or ``score_mod``) symbolically; never raises."""

    outside = outside_subset(hook, kind)
    if outside is not None:  # the graph would be about another function than the one that runs
        graph, problem = None, f"is outside the provable subset: it uses {outside.describe()}"
    else:
        try:
            graph, problem = symbolic_trace(_root(hook, kind)), ""
        except fx.proxy.TraceError as exc:
            graph, problem = None, f"uses Python control flow on index or score values ({exc})"
        except Exception as exc:  # noqa: BLE001 - any failure to trace leaves the hook unprovable
            graph, problem = None, f"cannot be traced symbolically ({type(exc).__name__}: {exc})"
    trace = HookTrace(graph=graph, problem=problem, outside=outside)
    _inspect(trace, hook)
    if graph is not None:
        words = {"b": "the batch index", "h": "the head index"}
        for node in graph.graph.nodes:
            if node.op == "placeholder" and node.target in words and _value_uses(graph.graph, node):
                trace.reads.insert(0, words[node.target])
            if node.op == "get_attr":
                tensor = getattr(graph, node.target)
                if id(tensor) not in trace.tensor_names:
                    # Made while tracing from values already accounted for (torch.tensor(LIST)),
                    # or captured in a way no frame showed: either way the proof relies on it.
                    trace.tensor_names[id(tensor)] = "a tensor built by the hook"
                    trace.assumptions.append(Assumption("a tensor built by the hook is unchanged",
                                                        _tensor_check(tensor)))
    trace.reads = list(dict.fromkeys(trace.reads))
    return trace


def _root(hook: Callable[..., Any], kind: str) -> Callable[..., Any]:
    """A function with named parameters around ``hook``: fx makes one placeholder per name."""
    if kind == "mask_mod":
        def mask_root(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return hook(b, h, q_idx, kv_idx)

        return mask_root

    def score_root(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return hook(score, b, h, q_idx, kv_idx)

    return score_root


__all__ = ["Assumption", "HookTrace", "cell_assumptions", "trace_hook"]
