"""What a user hook reads: a torch.fx trace plus the Python values its code looks up.

A proof about a hook is only as good as the inputs it assumed.  Tracing gives the
hook's arithmetic as a graph over ``(b, h, q_idx, kv_idx)`` (and ``score``); Python
control flow on those values cannot be traced and makes the hook unprovable.  While
tracing, the frames of the hook's own Python code (not torch's, not the standard
library's) are watched, so every module global and closure variable it reads is
known by name:

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
import os
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

MASK_ARGS = ("b", "h", "q_idx", "kv_idx")
SCORE_ARGS = ("score", "b", "h", "q_idx", "kv_idx")

_TORCH_DIR = os.path.dirname(torch.__file__)
_STDLIB_DIR = os.path.dirname(os.__file__)
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
    return isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                              types.ModuleType, type, torch._ops.OpOverloadPacket)) or callable(value) and (
        getattr(value, "__module__", "") or "").startswith("torch")


def _numbers(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(
        isinstance(v, (bool, int, float)) or _numbers(v) for v in value)


def _user_code(code: types.CodeType) -> bool:
    path = code.co_filename
    return not (path.startswith(_TORCH_DIR) or path.startswith(_STDLIB_DIR) or path.startswith("<frozen"))


def _loaded_globals(code: types.CodeType) -> set[str]:
    names = {ins.argval for ins in dis.get_instructions(code) if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    return {n for n in names if isinstance(n, str)}


class _Watcher:
    """Records each user-code frame entered while the hook itself runs under the tracer."""

    def __init__(self, root: types.CodeType) -> None:
        self.root, self.active = root, 0
        self.frames: list[tuple[types.CodeType, dict[str, Any], dict[str, Any]]] = []
        self._seen: set[int] = set()

    def __call__(self, frame: types.FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if code is self.root:  # only what runs inside the hook counts, not the tracer around it
            self.active += 1 if event == "call" else -1 if event == "return" else 0
            return
        if event != "call" or not self.active or not _user_code(code) or str(
                frame.f_globals.get("__name__", "")).startswith("torch"):
            return
        free = {name: frame.f_locals.get(name) for name in code.co_freevars}
        key = id(code) ^ hash(tuple(id(v) for v in free.values()))
        if key not in self._seen:
            self._seen.add(key)
            self.frames.append((code, frame.f_globals, free))


def _rebinding_check(globals_: dict[str, Any], name: str, value: Any) -> Callable[[], bool]:
    return lambda: globals_.get(name, _MISSING) is value


_MISSING = object()


def _tensor_check(tensor: torch.Tensor) -> Callable[[], bool]:
    version, ptr = tensor._version, tensor.data_ptr()
    return lambda: tensor._version == version and tensor.data_ptr() == ptr


def _list_check(value: list[Any]) -> Callable[[], bool]:
    snapshot = repr(value)
    return lambda: repr(value) == snapshot


def _classify(trace: HookTrace, name: str, value: Any, where: str, rebind: Optional[Callable[[], bool]]) -> None:
    label = f"the {where} {name}"
    if _is_code(value) and not isinstance(value, torch.Tensor):
        return
    if isinstance(value, torch.Tensor):
        trace.tensor_names.setdefault(id(value), name)
        check = _tensor_check(value)
        holds = check if rebind is None else (lambda c=check, r=rebind: r() and c())
        trace.assumptions.append(Assumption(f"{label} (a tensor) is unchanged", holds))
        trace.reads.append(f"{label} (a tensor)")
        return
    if _immutable(value):
        if rebind is not None:  # a module global can be rebound
            trace.assumptions.append(Assumption(f"{label} is still {value!r}", rebind))
            trace.reads.append(f"{label} ({value!r})")
        return
    if isinstance(value, list) and _numbers(value):
        check = _list_check(value)
        holds = check if rebind is None else (lambda c=check, r=rebind: r() and c())
        trace.assumptions.append(Assumption(f"{label} (a list) is unchanged", holds))
        trace.reads.append(f"{label} (a list)")
        return
    trace.reads.append(f"{label} (a {type(value).__name__})")
    trace.dynamic.append(f"{label}, a {type(value).__name__} that can change between calls")


def _inspect_frames(trace: HookTrace, watcher: _Watcher) -> None:
    for code, globals_, free in watcher.frames:
        for name, value in free.items():
            _classify(trace, name, value, "captured variable", None)
        builtin_names = vars(builtins)
        for name in sorted(_loaded_globals(code)):
            if name in globals_:
                value = globals_[name]
                _classify(trace, name, value, "module global", _rebinding_check(globals_, name, value))
            elif name not in builtin_names:
                trace.dynamic.append(f"the undefined global {name}")


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

    root = _root(hook, kind)
    watcher = _Watcher(root.__code__)
    previous = sys.getprofile()
    sys.setprofile(watcher)
    try:
        graph = fx.symbolic_trace(root)
        problem = ""
    except fx.proxy.TraceError as exc:
        graph, problem = None, f"uses Python control flow on index or score values ({exc})"
    except Exception as exc:  # noqa: BLE001 - any failure to trace leaves the hook unprovable
        graph, problem = None, f"cannot be traced symbolically ({type(exc).__name__}: {exc})"
    finally:
        sys.setprofile(previous)
    trace = HookTrace(graph=graph, problem=problem)
    _inspect_frames(trace, watcher)
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


__all__ = ["Assumption", "HookTrace", "MASK_ARGS", "SCORE_ARGS", "trace_hook"]
