"""The mask_mods and score_mods the ``flex`` backend hands to torch's FlexAttention.

* A plan's hooks reach a backend wrapped (`primus_ext.attention.heads`: the model's head index;
  `primus_ext.hooks.crosscheck.as_torch_calls`: called under ``torch.vmap`` on broadcast grids).
  torch calls a mask_mod under ``vmap`` itself, so the flex backend gives it the user's own hook
  with the head offset added, one stable function per ``(hook, offset)``: every layer using the
  same hook reaches the BlockMask cache with the same key.
* A call without a hook (``causal`` / ``window_size``) becomes mask_mods composed with torch's
  ``and_masks``, indices top-left (query ``i`` is position ``i``), as the reference backend.
* Packed (THD) documents become a document mask over one sequence of ``T`` tokens: each token's
  document and start are computed on the device from ``cu_seqlens`` (no host read), in tensors of
  ``T`` entries whatever the document count, so a compiled kernel sees one shape.
* `captured_state` reads what a hook captures (tensors by identity and version, constants by
  value, code by identity) so that a cached BlockMask is rebuilt exactly when they change.
"""

from __future__ import annotations

import dis
import functools
import inspect
import sys
import types
import weakref
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import and_masks

from ..attention.heads import unshifted
from ..attention.pattern import MaskMod, Pattern, ScoreMod
from ..hooks.crosscheck import TORCH_CALL_CODES
from ..hooks.trace import SNAPSHOT_MAX, same_values
from .check_op import tensor_version

_ON_HEADS: "weakref.WeakKeyDictionary[Any, dict[tuple[str, int], Callable]]" = weakref.WeakKeyDictionary()


def user_hook(hook: Any, kind: str) -> Optional[Callable]:
    """The user's own hook behind a plan's wrappers, called with the model's head index (stable per hook)."""
    if hook is None:
        return None
    inner, offset = unshifted(hook)
    inner = getattr(inner, "__wrapped__", inner) if _is_torch_call_wrapper(inner) else inner
    if offset == 0:
        return inner
    try:
        made = _ON_HEADS.setdefault(inner, {})
    except TypeError:  # not weakly referenceable: a fresh wrapper (the cache then keys on it per call)
        made = {}
    key = (kind, offset)
    if key not in made:
        if kind == "mask_mod":
            def mask_on_heads(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
                return inner(b, h + offset, q_idx, kv_idx)
            made[key] = mask_on_heads
        else:
            def score_on_heads(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
                return inner(score, b, h + offset, q_idx, kv_idx)
            made[key] = score_on_heads
    return made[key]


def reads_argument(hook: Callable, index: int) -> bool:
    """Whether ``hook``'s code may read its positional argument ``index`` (True unless it provably does not:
    a plain function whose bytecode never names that parameter).  Sound for the hooks flex runs (admitted:
    no frame or ``locals()`` introspection), which are the only ones whose mask is broadcast on it."""
    code = getattr(hook, "__code__", None)
    if not isinstance(hook, types.FunctionType) or code is None or index >= code.co_argcount or (
            code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS)):
        return True
    name = code.co_varnames[index]
    # Any instruction naming the parameter counts (whatever its opcode, so a newer Python's loads are covered).
    for ins in dis.get_instructions(code):
        if ins.argval == name or (isinstance(ins.argval, tuple) and name in ins.argval):
            return True
    return False


def _is_torch_call_wrapper(fn: Any) -> bool:
    """One of `as_torch_calls`'s own wrappers, known by its code object (a name or ``__wrapped__`` proves nothing)."""
    return isinstance(fn, types.FunctionType) and fn.__code__ in TORCH_CALL_CODES


# ------------------------------------------------------------------------------------ patterns
def causal_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return kv_idx <= q_idx


_BOUNDS: dict[tuple[str, int], MaskMod] = {}
_WINDOWS: dict[tuple[int, int], Optional[MaskMod]] = {}


def _left_bound(left: int) -> MaskMod:
    if ("left", left) not in _BOUNDS:
        def left_bound(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return q_idx - kv_idx <= left
        _BOUNDS[("left", left)] = left_bound
    return _BOUNDS[("left", left)]


def _right_bound(right: int) -> MaskMod:
    if ("right", right) not in _BOUNDS:
        def right_bound(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return kv_idx - q_idx <= right
        _BOUNDS[("right", right)] = right_bound
    return _BOUNDS[("right", right)]


def window_mod(left: int, right: int) -> Optional[MaskMod]:
    """The flash window ``q - left <= kv <= q + right`` (-1 unbounded) as one mask_mod; None: no mask."""
    key = (left, right)
    if key not in _WINDOWS:
        parts = [causal_mod if right == 0 else _right_bound(right)] if right >= 0 else []
        if left >= 0:
            parts.append(_left_bound(left))
        _WINDOWS[key] = None if not parts else parts[0] if len(parts) == 1 else and_masks(*parts)
    return _WINDOWS[key]


_PATTERNS: dict[Pattern, Optional[MaskMod]] = {}


def pattern_mod(pattern: Pattern) -> Optional[MaskMod]:
    """A call's pattern (no hook) as a mask_mod, top-left; documents at constant positions included.
    One function per pattern (a few hundred kept), so equal calls share their BlockMask."""
    if pattern not in _PATTERNS:
        if len(_PATTERNS) >= 256:
            _PATTERNS.clear()
        _PATTERNS[pattern] = _pattern_mod(pattern)
    return _PATTERNS[pattern]


def _pattern_mod(pattern: Pattern) -> Optional[MaskMod]:
    window = window_mod(pattern.left, pattern.right)
    if not pattern.documents:
        return window
    cuts = pattern.boundaries[1:-1] if pattern.boundaries is not None else pattern.cuts
    chunk = pattern.chunk

    def constant_documents(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if chunk is not None:
            return torch.div(q_idx, chunk, rounding_mode="floor") == torch.div(kv_idx, chunk, rounding_mode="floor")
        doc_q = sum(((q_idx >= c).to(torch.int64) for c in cuts), torch.zeros_like(q_idx))  # type: ignore[union-attr]
        doc_kv = sum(((kv_idx >= c).to(torch.int64) for c in cuts), torch.zeros_like(kv_idx))  # type: ignore[union-attr]
        return doc_q == doc_kv

    return constant_documents if window is None else and_masks(constant_documents, window)


def document_mod(pattern: Pattern, cu_q: Tensor, cu_kv: Tensor, total_q: int, total_kv: int) -> tuple[MaskMod, int]:
    """``(mask_mod, bytes it captures)`` of packed documents, ``pattern``'s window inside each, positions
    counted from each document's start (top-left); computed on ``cu_q``'s device without a host read."""
    shared = cu_kv is cu_q and total_kv == total_q
    doc_q, start_q = _documents(cu_q, total_q)
    doc_kv, start_kv = (doc_q, start_q) if shared else _documents(cu_kv, total_kv)
    inner = window_mod(pattern.left, pattern.right)

    def packed_documents(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        same = doc_q[q_idx] == doc_kv[kv_idx]
        if inner is None:
            return same
        return same & inner(b, h, q_idx - start_q[q_idx], kv_idx - start_kv[kv_idx])

    def shared_documents(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        # One boundary tensor: q and kv of one document share its start, and a window compares only
        # their difference, so the starts cancel (attention-gym's form, one gather fewer per side).
        return (doc_q[q_idx] == doc_q[kv_idx]) & inner(b, h, q_idx, kv_idx)

    if shared and inner is not None:
        return shared_documents, doc_q.numel() * doc_q.element_size()
    held = {id(t): t for t in (doc_q, start_q, doc_kv, start_kv)}
    return packed_documents, sum(t.numel() * t.element_size() for t in held.values())


def _documents(cu: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """Each token's document number and the position its document starts at (``[total]`` int64 each).
    A token at or past the last boundary belongs to one more document, as the reference counts it."""
    bounds = cu.to(torch.int64)
    pos = torch.arange(total, device=cu.device, dtype=torch.int64)
    doc = torch.searchsorted(bounds[1:], pos, right=True)
    start = bounds[torch.clamp(doc, max=bounds.numel() - 1)]
    return doc, start


# ------------------------------------------------------------------------------------ scores
_IN_SCORE_DTYPE: "weakref.WeakKeyDictionary[Any, ScoreMod]" = weakref.WeakKeyDictionary()


def in_score_dtype(score_mod: Optional[ScoreMod]) -> Optional[ScoreMod]:
    """``score_mod`` with its result cast back to the score's dtype (one stable function per hook).

    A hook may return another dtype (``score.to(torch.bfloat16)``: a rounding of the score); torch's
    eager flex_attention would then compute the whole softmax in that dtype, where the reference (and
    the compiled kernel's float32 accumulators) round only the score."""
    if score_mod is None:
        return None
    try:
        made = _IN_SCORE_DTYPE.get(score_mod)
    except TypeError:
        made = None
    if made is None:
        def score_in_dtype(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return score_mod(score, b, h, q_idx, kv_idx).to(score.dtype)
        made = score_in_dtype
        try:
            _IN_SCORE_DTYPE[score_mod] = made
        except TypeError:  # not weakly referenceable: a fresh wrapper per call
            pass
    return made


def with_alibi(score_mod: Optional[ScoreMod], slopes: Optional[Tensor]) -> Optional[ScoreMod]:
    """``score_mod`` then ALiBi ``slope[h] * (kv - q)`` (the project's sign, as the reference)."""
    if slopes is None:
        return score_mod

    def alibi(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if score_mod is not None:
            score = score_mod(score, b, h, q_idx, kv_idx)
        return score + slopes[h].to(score.dtype) * (kv_idx - q_idx).to(score.dtype)

    return alibi


# ------------------------------------------------------------------------------------ captures
_LIMIT = 256
_SKIP_MODULES = ("torch", "builtins", "math", "operator", "functools", "numpy", "primus_ext.attention.masks")
_VALUES = (bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def _skipped(module: str) -> bool:
    """Code nobody rebinds in place: these packages (by whole name, not by prefix) and their submodules."""
    return any(module == m or module.startswith(m + ".") for m in _SKIP_MODULES)


def _home(obj: Any) -> str:
    """The module ``obj`` really belongs to, whatever its ``__module__`` says (``functools.wraps`` copies a
    wrapped function's, and a class body may set its own): a function's globals, a module's entry in
    ``sys.modules``, a class found under its name in the module it names.  Empty when nothing vouches for it,
    so its state is walked."""
    if isinstance(obj, types.FunctionType):
        name = obj.__globals__.get("__name__")
        return name if isinstance(name, str) and sys.modules.get(name) is not None and \
            getattr(sys.modules[name], "__dict__", None) is obj.__globals__ else ""
    if isinstance(obj, types.ModuleType):
        return obj.__name__ if sys.modules.get(obj.__name__) is obj else ""
    if isinstance(obj, type):
        module = sys.modules.get(obj.__module__ or "")
        found: Any = module
        for part in (obj.__qualname__ or "").split("."):
            found = getattr(found, part, None)
        return obj.__module__ if found is obj else ""
    return ""


def _tensor_stamp(t: Tensor, snapshots: bool) -> tuple:
    version = tensor_version(t)
    if version is None:
        return ("inference tensor", id(t))
    # A write through ``.data``, numpy or the storage bumps no version: small tensors are compared by value too
    snapshot = t.detach().clone() if snapshots and t.numel() <= SNAPSHOT_MAX else None
    return ("tensor", weakref.ref(t), version, t.data_ptr(), tuple(t.shape), t.dtype, snapshot)


def captured_state(*hooks: Optional[Callable], snapshots: bool = True) -> tuple:
    """What ``hooks`` read besides their arguments, as stamps a later call compares (`same_state`):
    tensors by weak reference, version and storage (small ones by value too); numbers and strings by value;
    code by identity; anything else, or more than the walk reads, as volatile (the mask is then built at every
    call).  Read through closures, defaults, the module globals a function names, attributes it names of a
    module it reads, ``functools.partial`` parts, the parameters and attributes of objects (an ``nn.Module``,
    a callable instance: volatile, but walked so a learned table behind them is found), and the parts of
    torch's ``and_masks`` / ``or_masks``.  ``snapshots=False``: no value copies (a state only read, not kept)."""
    stamps: list[tuple] = []
    seen: set[int] = set()
    stack: list[tuple[Any, frozenset]] = [(h, frozenset()) for h in hooks if h is not None]
    # (a tensor too large to compare by value is volatile too: a write behind its version counter goes unseen)
    while stack and len(seen) < _LIMIT:
        obj, names = stack.pop()
        if obj is None or isinstance(obj, _VALUES):  # by value, every time: equal values may be one object
            stamps.append(("value", type(obj), obj))
            continue
        if id(obj) in seen:
            stamps.append(("again", id(obj)))
            continue
        seen.add(id(obj))
        if isinstance(obj, Tensor):
            stamps.append(_tensor_stamp(obj, snapshots))
            if snapshots and obj.numel() > SNAPSHOT_MAX:
                stamps.append(("volatile",))
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stamps.append(("container", type(obj), len(obj)))
            stack.extend((item, names) for item in (sorted(obj, key=repr) if isinstance(obj, (set, frozenset))
                                                   else obj))
        elif isinstance(obj, dict):
            stamps.append(("container", dict, len(obj), tuple(map(repr, obj))))
            stack.extend((item, names) for item in obj.values())
        elif isinstance(obj, types.ModuleType):
            if not _skipped(_home(obj)):
                stack.extend((getattr(obj, n), names) for n in sorted(names) if hasattr(obj, n))
        elif isinstance(obj, type):  # ``cfg.W`` of a class, as of a module: the attributes the code names
            stamps.append(("class", id(obj)))
            if not _skipped(_home(obj)):
                stack.extend((getattr(obj, n), names) for n in sorted(names) if hasattr(obj, n))
        elif isinstance(obj, types.FunctionType):
            code = obj.__code__
            stamps.append(("code", id(code), id(obj.__defaults__), id(obj.__kwdefaults__)))
            own = frozenset(_names(code))
            for cell in obj.__closure__ or ():
                try:
                    stack.append((cell.cell_contents, own))
                except ValueError:  # an empty cell
                    continue
            stack.extend((d, own) for d in obj.__defaults__ or ())
            stack.extend((d, own) for d in (obj.__kwdefaults__ or {}).values())
            if not _skipped(_home(obj)):
                glob = obj.__globals__
                stack.extend((glob[n], own) for n in sorted(own) if n in glob)
        elif isinstance(obj, functools.partial):
            stamps.append(("partial", id(obj)))
            stack.extend((part, names) for part in (obj.func, *obj.args, *obj.keywords.values()))
        elif isinstance(obj, types.MethodType):
            stamps.append(("volatile",))
            stack.extend(((obj.__func__, names), (obj.__self__, names)))
        elif isinstance(obj, (types.BuiltinFunctionType, types.BuiltinMethodType)) or (
                callable(obj) and not hasattr(obj, "__dict__")):
            stamps.append(("callable", id(obj)))  # a builtin or torch function: code nobody rebinds in place
        else:  # an object whose attributes may change unseen (outside the provable subset anyway)
            stamps.append(("volatile",))
            if isinstance(obj, torch.nn.Module):
                stack.extend((t, names) for t in (*obj.parameters(), *obj.buffers()))
            stack.extend((v, names) for v in getattr(obj, "__dict__", {}).values())
            call = getattr(type(obj), "__call__", None)
            if isinstance(call, types.FunctionType):
                stack.append((call, names))
    if stack:  # more than the walk reads: what is past it could change unseen
        stamps.append(("volatile",))
    return tuple(stamps)


def captured_bytes(state: tuple) -> int:
    """Bytes of the live tensors a `captured_state` names (each once): what a cached BlockMask keeps alive
    through its mask_mod."""
    held = {}
    for stamp in state:
        if stamp[0] == "tensor" and stamp[1]() is not None:
            held[id(stamp[1]())] = stamp[1]()
            if stamp[6] is not None:  # the value snapshot the entry keeps
                held[id(stamp[6])] = stamp[6]
    return sum(t.numel() * t.element_size() for t in held.values())


def learned_tensors(*hooks: Optional[Callable]) -> int:
    """How many tensors ``hooks`` capture that require grad (a learned bias table): their gradient can come
    only from autograd through the hook as called, which a fixed kernel, a graph's opaque op and (unshown
    here) flex_attention's captured-buffer gradient do not give."""
    return len(learned_tables(*hooks))


def learned_tables(*hooks: Optional[Callable]) -> list[Tensor]:
    """The tensors `learned_tensors` counts, each once, in the order the walk meets them."""
    found = (stamp[1]() for stamp in captured_state(*hooks, snapshots=False) if stamp[0] == "tensor")
    return [t for t in found if t is not None and t.requires_grad]


def learned_in(state: tuple) -> int:
    """`learned_tensors` of the hooks a `captured_state` was taken of (no second walk)."""
    return sum(1 for stamp in state if stamp[0] == "tensor" and stamp[1]() is not None and stamp[1]().requires_grad)


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def same_state(a: tuple, b: tuple, *, watched_only: bool = False) -> bool:
    """Whether two `captured_state` results describe the same values (tensors: the same object, unchanged).
    What cannot be watched (an object's attributes, an inference tensor) counts as changed, or with
    ``watched_only`` as unchanged: only what can be watched is compared."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x[0] in ("inference tensor", "volatile"):  # values that may have changed unseen
            if watched_only and x == y:
                continue
            return False
        if x[0] == "tensor" and y[0] == "tensor":
            live = x[1]()
            if live is None or live is not y[1]() or x[2:6] != y[2:6] or not same_values(
                    x[6], live, "primus_ext: a tensor a flex hook captures was changed behind its version counter"):
                return False
        elif x != y:
            return False
    return True


__all__ = ["captured_bytes", "captured_state", "causal_mod", "document_mod", "in_score_dtype", "learned_in",
           "learned_tables", "learned_tensors", "pattern_mod", "reads_argument", "same_state", "user_hook", "window_mod", "with_alibi"]
