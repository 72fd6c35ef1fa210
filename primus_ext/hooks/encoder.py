"""A traced hook's graph as a z3 formula over unbounded integer indices and real scores.

Indices are mathematical integers (no length, so a proof holds at every sequence
length) and scores are reals.  Each supported torch operation maps to its exact
integer / real meaning (`hook_ops`); an operation without one (``tanh``, a reshape, a
data-dependent index) raises `Unsupported`, and the hook is then not proven: evaluated
exactly, or refused.  Integer values must fit the dtype torch gives them, and parts of the
graph fixed by a head index are computed by torch itself.

Indexing a captured tensor by an index expression becomes a chain of ``If`` over its
values, plus an *obligation* that the index stays inside the tensor for every input;
a tensor indexed by ``q_idx`` has a fixed length, so that obligation fails at some
length and the hook is unprovable, as it should be.
"""

from __future__ import annotations

import math
import operator
from fractions import Fraction
from typing import Any, Optional

import torch
import torch.fx as fx
import z3

from .floats import SAFE_MAGNITUDE
from .ops import (FUNCTIONS, INT64, MAX_TABLE, METHODS, Captured, Meta, Unsupported, const, convert, element,
                       expr, num)


_UNKNOWN = object()


def _from_torch(t: torch.Tensor) -> Any:
    """A value torch computed, exactly: a number for a 0-d tensor, else a constant table."""
    if t.dim() != 0:
        return Captured(t, "a tensor computed from constants")
    if t.dtype == torch.bool:
        return z3.BoolVal(bool(t))
    if not t.dtype.is_floating_point:
        return z3.IntVal(int(t))
    value = float(t)
    if not math.isfinite(value):
        raise Unsupported(f"computes the non-finite constant {value}")
    return z3.RealVal(Fraction(value))


_NARROW = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.uint16, torch.uint32)


class _Dtypes(dict):
    """Each node's dtype from one run as torch calls the hook (``dict``), and ``common``: the dtype torch computes
    an operation in after promoting its operands, which is not the result's own for a comparison, and which is
    a narrow integer's where a Python number or a 0-d tensor meets a narrow integer value."""

    def __init__(self) -> None:
        super().__init__()
        self.common: dict[fx.Node, torch.dtype] = {}


def node_dtypes(graph: fx.GraphModule) -> Optional[_Dtypes]:
    """Each node's dtype from one run as torch calls a hook (index 0, a score of 0.0); None if it fails.
    Kept on the graph: a score hook is encoded once per head."""
    if "_primus_ext_dtypes" not in graph.__dict__:
        graph.__dict__["_primus_ext_dtypes"] = _run_dtypes(graph)
    return graph.__dict__["_primus_ext_dtypes"]


def _call(node: fx.Node, args: Any, kwargs: Any) -> Any:
    return node.target(*args, **kwargs) if node.op == "call_function" else getattr(args[0], node.target)(
        *args[1:], **kwargs)


def _run_dtypes(graph: fx.GraphModule) -> Optional[_Dtypes]:
    """One run of the graph's nodes under ``torch.vmap`` over its indices (and score), as create_block_mask and
    flex_attention call a hook: there a value of the indices is a batched tensor, which torch promotes as a
    dimensioned one (a 0-d captured tensor, or a Python number, then takes its dtype, as in eager code it would
    not).  No fx Interpreter: it costs more than the run."""
    nodes = list(graph.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    out = _Dtypes()

    def run(*values: Any) -> Any:
        env: dict[fx.Node, Any] = dict(zip(placeholders, values))
        for node in nodes:
            if node.op == "get_attr":
                value: Any = getattr(graph, node.target)
            elif node.op in ("call_function", "call_method"):
                args = fx.node.map_arg(node.args, env.__getitem__)
                value = _call(node, args, fx.node.map_arg(node.kwargs, env.__getitem__))
                common = _common_dtype(node, args)
                if common is not None:
                    out.common[node] = common
            else:
                continue
            env[node] = value
            if isinstance(value, torch.Tensor):
                out[node] = value.dtype
        return values[0]

    try:
        with torch.no_grad():
            torch.vmap(run)(*(torch.zeros(1, dtype=torch.float32 if p.target == "score" else torch.int64)
                              for p in placeholders))
    except Exception:  # noqa: BLE001 - no dtypes: the hook is then not proven
        return None
    for p in placeholders:
        out[p] = torch.float32 if p.target == "score" else torch.int64
    return out


_BINARY = frozenset({operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod, operator.truediv,
                     operator.lt, operator.le, operator.gt, operator.ge, operator.eq, operator.ne, operator.and_,
                     operator.or_, operator.xor, torch.add, torch.sub, torch.mul, torch.div, torch.true_divide,
                     torch.floor_divide, torch.remainder, torch.fmod, torch.lt, torch.le, torch.gt, torch.ge,
                     torch.eq, torch.ne, torch.minimum, torch.maximum, torch.bitwise_and, torch.bitwise_or,
                     torch.bitwise_xor, "add", "sub", "mul", "__add__", "__sub__", "__mul__", "__radd__", "__rsub__",
                     "__rmul__", "div", "floor_divide", "remainder", "fmod", "lt", "le", "gt", "ge", "eq", "ne",
                     "minimum", "maximum"})
"""Operations whose two operands torch promotes to one dtype before computing (`_promoted_operands`)."""


def _promoted_operands(node: fx.Node) -> tuple[int, ...]:
    """Positions in ``node.args`` of the operands torch promotes together (``where``: both branches)."""
    if node.target in (torch.where,):
        return (1, 2)
    if node.target == "where" and node.op == "call_method":
        return (0, 2)
    if node.target in _BINARY and len(node.args) >= 2:
        return (0, 1)
    return ()


def _common_dtype(node: fx.Node, args: Any) -> Optional[torch.dtype]:
    """The dtype torch computes ``node`` in, from its operands as they are there: read off a sum of zeros of
    their kinds, since `torch.result_type` under vmap sees the logical shapes, not the ones torch promotes."""
    positions = _promoted_operands(node)
    if not positions or any(p >= len(args) for p in positions):
        return None
    a, b = (args[p] for p in positions)
    if not any(isinstance(x, torch.Tensor) for x in (a, b)):
        return None
    try:
        return ((torch.zeros_like(a) if isinstance(a, torch.Tensor) else a)
                + (torch.zeros_like(b) if isinstance(b, torch.Tensor) else b)).dtype
    except (TypeError, RuntimeError):
        return None


def _wrapped(value: int, dtype: torch.dtype) -> int:
    """A Python int as torch converts it into an integer ``dtype`` before computing: modulo the width."""
    if not -INT64 <= value < INT64:
        raise Unsupported(f"uses the integer constant {value}, which no int64 holds")
    if dtype == torch.int64:
        return value
    return int(torch.tensor(value, dtype=torch.int64).to(dtype))


def _float64_scalars(args: Any) -> tuple:
    """In a float64 operation torch uses a Python float as the double it is, not its float32 rounding."""
    out = []
    for a in args:
        if type(a) is float:
            const(a)  # the same bounds as any float constant
            a = z3.RealVal(Fraction(a))
        out.append(a)
    return tuple(out)


_CASTS = frozenset({"to", "type_as", "float", "double", "half", "bfloat16", "int", "long", "bool"})
_MAY_OVERFLOW = {operator.mul, torch.mul, "mul", "__mul__", "__rmul__", operator.add, operator.sub, torch.add,
                 torch.sub, "add", "sub", "__add__", "__sub__", "__radd__", "__rsub__", operator.neg, torch.neg, "neg"}


class Encoder:
    """Evaluates a traced graph on z3 values; collects the index-range obligations."""

    def __init__(self, graph: fx.GraphModule, names: dict[int, str]) -> None:
        self.graph, self.names = graph, names
        self.obligations: list[tuple[z3.BoolRef, str]] = []
        self.ops: set[str] = set()
        self.dtypes = node_dtypes(graph)
        self._batched: set[fx.Node] = set()  # fixed nodes whose value comes from the indices (batched under vmap)
        self.tables: dict[int, tuple[z3.ExprRef, list[Fraction], z3.ExprRef]] = {}
        """A captured table read at a symbolic index, by the id of its ``If`` chain: ``(chain, values, index)``,
        so that walks of the formula read it in one step (`bias`, `solver`), not node by node."""

    def run(self, inputs: dict[str, Any]) -> z3.ExprRef:
        try:
            return self._run(inputs)
        except z3.Z3Exception as exc:
            raise Unsupported(f"mixes value kinds the prover cannot encode ({exc})") from exc
        except (ArithmeticError, TypeError, ValueError, IndexError, RecursionError) as exc:
            raise Unsupported(f"cannot be encoded ({type(exc).__name__}: {exc})") from exc

    def _run(self, inputs: dict[str, Any]) -> z3.ExprRef:
        env: dict[fx.Node, Any] = {}
        known: dict[fx.Node, Any] = {}  # nodes whose inputs are all fixed (a head proven one by one)
        scored: set[fx.Node] = set()  # nodes the score enters (their float32 path is `floats.score_path`'s)
        for node in self.graph.graph.nodes:
            if node.op == "output":
                return expr(fx.node.map_arg(node.args[0], env.__getitem__))
            if (node.op == "placeholder" and node.target == "score") or any(n in scored for n in node.all_input_nodes):
                scored.add(node)
            value = self._fixed(node, known, inputs)
            if node.op == "placeholder" and value is not _UNKNOWN:
                self._batched.add(node)
            if value is not _UNKNOWN:
                known[node] = value
                if node.op != "get_attr":
                    env[node] = _from_torch(value)
                    continue
            env[node] = value = self._node(node, env, inputs)
            if isinstance(value, z3.ArithRef) and z3.is_int(value):
                self._width(node, value)
            elif isinstance(value, z3.ArithRef) and z3.is_real(value) and node not in scored and node.op != "placeholder":
                # a step of what a score hook adds, computed in floating point by torch: far from overflow
                self.obligations.append((z3.And(value > -SAFE_MAGNITUDE, value < SAFE_MAGNITUDE),
                                         f"computes floating values beyond {SAFE_MAGNITUDE:.3g}, near float32's overflow"))
        raise Unsupported("returns nothing")

    def _fixed(self, node: fx.Node, known: dict[fx.Node, Any], inputs: dict[str, Any]) -> Any:
        """The node's value computed by torch itself when every input is fixed (e.g. ``exp2`` of a slope
        from the head index): torch's own dtype and rounding, which no encoding has to match.  Computed under
        ``torch.vmap`` over the inputs that come from the indices, as torch calls the hook."""
        if node.op == "placeholder":
            v = inputs.get(node.target)
            if isinstance(v, z3.ExprRef) and z3.is_int_value(v):
                return torch.tensor(v.as_long(), dtype=torch.int64)
            return _UNKNOWN
        if node.op == "get_attr":
            return getattr(self.graph, node.target)
        if node.op not in ("call_function", "call_method") or node.target is getattr:
            return _UNKNOWN
        inputs_fixed = all(n in known for n in node.all_input_nodes)
        if not inputs_fixed or not node.all_input_nodes:
            return _UNKNOWN
        batched = [n for n in node.all_input_nodes if n in self._batched]

        def run(*values: Any) -> Any:
            env = {**known, **dict(zip(batched, values))}
            return _call(node, fx.node.map_arg(node.args, env.__getitem__),
                         fx.node.map_arg(node.kwargs, env.__getitem__))

        try:
            with torch.no_grad():
                out = torch.vmap(run)(*(known[n].unsqueeze(0) for n in batched))[0] if batched else run()
        except Exception:  # noqa: BLE001 - encoded symbolically instead
            return _UNKNOWN
        if isinstance(out, torch.Tensor) and batched:
            self._batched.add(node)
        return out if isinstance(out, torch.Tensor) else _UNKNOWN

    def _width(self, node: fx.Node, value: z3.ArithRef) -> None:
        """Integers are unbounded here and wrap in torch: each value must fit its dtype (torch's own
        promotion, read off one eager run of the graph), so that the two agree."""
        dtype = torch.int64 if self.dtypes is None else self.dtypes.get(node, torch.int64)
        if dtype in _NARROW:
            info = torch.iinfo(dtype)
            self.obligations.append((z3.And(value >= info.min, value <= info.max),
                                     f"computes {dtype} values that wrap around"))
        elif node.target in _MAY_OVERFLOW:
            self.obligations.append((z3.And(value > -INT64, value < INT64), "overflows int64 arithmetic"))

    def _node(self, node: fx.Node, env: dict[fx.Node, Any], inputs: dict[str, Any]) -> Any:
        if node.op == "placeholder":
            return inputs[node.target]
        if node.op == "get_attr":
            tensor = getattr(self.graph, node.target)
            if tensor.dtype in _NARROW and self.dtypes is None:
                raise Unsupported(f"reads a {tensor.dtype} tensor, whose arithmetic wraps, in a graph whose "
                                  "dtypes could not be read")
            return Captured(tensor, self.names.get(id(tensor), "a captured tensor"))
        args = fx.node.map_arg(node.args, env.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
        args = self._promoted(node, args)
        if self.dtypes is not None and self.dtypes.get(node) == torch.float64:
            args, kwargs = _float64_scalars(args), {k: _float64_scalars((v,))[0] for k, v in kwargs.items()}
        if node.op == "call_function":
            if node.target is getattr:
                return Meta()
            if node.target is operator.getitem:
                return self._index(*args)
            fn = FUNCTIONS.get(node.target)
            label = f"{getattr(node.target, '__module__', '') or ''}.{getattr(node.target, '__name__', node.target)}"
        elif node.op == "call_method":
            if node.target == "__getitem__":
                return self._index(*args)
            if node.target in _CASTS:  # the target dtype as torch resolves it (a tensor's dtype too)
                return self._converted(node, args)
            fn = METHODS.get(node.target)
            label = f"Tensor.{node.target}"
        else:
            fn, label = None, f"a {node.op} node"
        self.ops.add(label.split(".")[-1])
        if fn is None:
            raise Unsupported(f"uses {label.lstrip('.')}, which the prover has no exact meaning for")
        return fn(*args, **kwargs)

    def _promoted(self, node: fx.Node, args: tuple) -> tuple:
        """``args`` as torch computes ``node`` with them: in an integer dtype (`_Dtypes.common`), a Python
        number is converted with wrap-around, and another node's value must fit (an obligation)."""
        common = None if self.dtypes is None else self.dtypes.common.get(node)
        if common is None or common.is_floating_point or common.is_complex or common == torch.bool:
            return args
        info = torch.iinfo(common)
        out = list(args)
        for p in _promoted_operands(node):
            value, source = out[p], node.args[p]
            if type(value) is int:
                out[p] = _wrapped(value, common)
                continue
            if type(value) is bool or not isinstance(source, fx.Node) or self.dtypes.get(source) in (
                    None, common, torch.bool):
                continue
            if isinstance(value, Captured):
                if value.tensor.numel() == 1 and not value.tensor.dtype.is_floating_point:
                    out[p] = _wrapped(int(value.tensor.reshape(())), common)  # a 0-d table meeting a batched value
                continue
            x = num(value)
            if not z3.is_int(x):
                continue
            fixed = z3.simplify(x)
            if z3.is_int_value(fixed):
                out[p] = _wrapped(fixed.as_long(), common)
            else:
                self.obligations.append((z3.And(x >= info.min, x <= info.max),
                                         f"converts values to {common}, which wraps some of them"))
        return tuple(out)

    def _converted(self, node: fx.Node, args: Any) -> z3.ExprRef:
        out = None if self.dtypes is None else self.dtypes.get(node)
        if out is None:
            raise Unsupported(f"converts with .{node.target}() to a dtype that could not be read")
        x = expr(args[0])
        source = self.dtypes.get(node.args[0]) if isinstance(node.args[0], fx.Node) else None  # type: ignore[union-attr]
        if source == out:
            return x
        return convert(x, out)  # float64 to float32 is a rounding like float32 arithmetic's (over the reals)

    def _index(self, base: Any, index: Any) -> Any:
        if not isinstance(base, Captured):
            raise Unsupported("indexes an index or score tensor")
        table = base.tensor
        if table.dim() != 1 or table.numel() > MAX_TABLE or table.numel() == 0:
            raise Unsupported(f"indexes {base.name} of shape {tuple(table.shape)} (only 1-D tensors up to "
                              f"{MAX_TABLE} elements are proven)")
        i = num(index)
        if not z3.is_int(i):
            raise Unsupported(f"indexes {base.name} with a floating value")
        n = table.numel()
        fixed = z3.simplify(i)
        if z3.is_int_value(fixed):  # e.g. the head index, fixed while proving head by head
            k = fixed.as_long()
            if not 0 <= k < n:
                raise Unsupported(f"indexes {base.name} (length {n}) at {k}, out of range")
            return element(table[k].item())
        self.obligations.append((z3.And(i >= 0, i < n), f"indexes {base.name} (length {n}) out of range"))
        raw = table.tolist()
        values = [element(x) for x in raw]
        result = values[-1]
        for k in range(n - 2, -1, -1):
            result = z3.If(i == k, values[k], result)
        if not table.dtype == torch.bool:
            self.tables[result.get_id()] = (result, [Fraction(x) for x in raw], i)
        return result


__all__ = ["Encoder", "node_dtypes"]
