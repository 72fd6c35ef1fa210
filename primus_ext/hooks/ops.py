"""Each torch operation a traced hook may use, as its exact z3 meaning (`hook_z3` walks the graph).

Indices are mathematical integers and scores reals; ``//`` and ``%`` by positive constants
keep the arithmetic linear.  An operation without an exact meaning here raises
`Unsupported`, and the hook is then not proven.
"""

from __future__ import annotations

import math
import operator
from fractions import Fraction
from typing import Any, Callable, Optional

import torch
import z3

MAX_TABLE = 4096  # longest captured tensor turned into an If-chain
FLOAT_CONST_MAX = 2.0 ** 12  # float constants beyond (or below its inverse) are refused
INDEX_BOUND = 2 ** 40
"""Indices are proven below this bound, so int64 arithmetic on them is checked for overflow."""
INT64 = 2 ** 63


class Unsupported(Exception):
    """The graph uses something without an exact encoding; the text says what."""


class Meta:
    """A device, dtype or shape read off an index tensor: never a value."""


class Captured:
    """A concrete tensor the hook closed over (or built from constants)."""

    def __init__(self, tensor: torch.Tensor, name: str) -> None:
        self.tensor, self.name = tensor.detach(), name


def const(x: Any) -> z3.ExprRef:
    if isinstance(x, bool):
        return z3.BoolVal(x)
    if isinstance(x, int):
        return z3.IntVal(x)
    if isinstance(x, float):
        if not math.isfinite(x) or abs(x) > FLOAT_CONST_MAX or 0 < abs(x) < 1 / FLOAT_CONST_MAX:
            raise Unsupported(f"uses the constant {x!r}, whose floating-point rounding a proof over "
                              "the reals does not model")
        return z3.RealVal(Fraction(torch.tensor(x, dtype=torch.float32).item()))  # torch's float32 scalar
    raise Unsupported(f"uses a constant of type {type(x).__name__}")


def element(x: Any) -> z3.ExprRef:
    """A value stored in a captured tensor: exact as stored (no Python-scalar rounding)."""
    if isinstance(x, float):
        if not math.isfinite(x):
            raise Unsupported(f"reads the non-finite value {x} from a captured tensor")
        return z3.RealVal(Fraction(x))
    return const(x)


def _scalar(c: Captured) -> z3.ExprRef:
    if c.tensor.numel() != 1:
        raise Unsupported(f"uses {c.name} with {c.tensor.numel()} elements as a scalar")
    return element(c.tensor.reshape(()).item())


def expr(v: Any) -> z3.ExprRef:
    if isinstance(v, z3.ExprRef):
        return v
    if isinstance(v, Meta):
        raise Unsupported("uses a tensor attribute (device, dtype, shape, ...) as a value")
    if isinstance(v, Captured):
        return _scalar(v)
    return const(v)


def num(v: Any) -> z3.ArithRef:
    e = expr(v)
    return z3.If(e, 1, 0) if z3.is_bool(e) else e


def boolean(v: Any) -> z3.BoolRef:
    e = expr(v)
    return e if z3.is_bool(e) else e != 0


def _float_scalars(a: Any, b: Any, ea: z3.ExprRef, eb: z3.ExprRef) -> None:
    """An int constant meeting a floating value is a float32 scalar in torch: bounded like a float one."""
    for value, other in ((a, eb), (b, ea)):
        if type(value) is int and z3.is_real(other) and abs(value) > FLOAT_CONST_MAX:
            raise Unsupported(f"uses the constant {value} with a floating value, whose float32 rounding and "
                              "overflow a proof over the reals does not model")


def _pair(a: Any, b: Any) -> tuple[z3.ArithRef, z3.ArithRef]:
    x, y = num(a), num(b)
    _float_scalars(a, b, y, x)
    if z3.is_real(x) and z3.is_int(y):
        y = z3.ToReal(y)
    elif z3.is_int(x) and z3.is_real(y):
        x = z3.ToReal(x)
    return x, y


def _positive_int(d: Any, what: str) -> int:
    if isinstance(d, Captured) and d.tensor.numel() == 1:
        d = d.tensor.item()
    if isinstance(d, bool) or not isinstance(d, int) or d <= 0:
        raise Unsupported(f"uses {what} by {d!r}; only a positive integer constant divisor is proven")
    return d


def _floordiv(a: Any, d: Any) -> z3.ArithRef:
    x = num(a)
    if not z3.is_int(x):
        raise Unsupported("uses floor division on a floating value")
    return x / _positive_int(d, "floor division")  # z3's Euclidean division is floor for d > 0


def _mod(a: Any, d: Any) -> z3.ArithRef:
    x = num(a)
    if not z3.is_int(x):
        raise Unsupported("uses % on a floating value")
    return x % _positive_int(d, "%")  # Euclidean == Python's (and torch.remainder's) for d > 0


def _int_operand(a: Any, what: str) -> z3.ArithRef:
    x = num(a)
    if not z3.is_int(x):
        raise Unsupported(f"uses {what} on a floating value")
    return x


def _trunc_div(a: Any, d: Any) -> z3.ArithRef:
    x, n = _int_operand(a, "truncating division"), _positive_int(d, "truncating division")
    return z3.If(x >= 0, x / n, -((-x) / n))


def _fmod(a: Any, d: Any) -> z3.ArithRef:
    x, n = _int_operand(a, "fmod"), _positive_int(d, "fmod")
    return z3.If(x >= 0, x % n, -((-x) % n))


def _truediv(a: Any, b: Any) -> z3.ArithRef:
    x, y = num(a), num(b)
    x = z3.ToReal(x) if z3.is_int(x) else x
    if type(b) not in (int, float) or b == 0:
        raise Unsupported("divides by a non-constant (or zero)")
    return x / const(float(b))


def _div(a: Any, b: Any, rounding_mode: Optional[str] = None) -> z3.ArithRef:
    if rounding_mode == "floor":
        return _floordiv(a, b)
    if rounding_mode == "trunc":
        return _trunc_div(a, b)
    return _truediv(a, b)


def _logic(op: Callable[..., Any]) -> Callable[[Any, Any], z3.ExprRef]:
    def run(a: Any, b: Any) -> z3.ExprRef:
        x, y = expr(a), expr(b)
        if z3.is_bool(x) and z3.is_bool(y):
            return op(x, y)
        raise Unsupported("uses a bitwise operation on integers")
    return run


def _compare(op: Callable[[Any, Any], Any]) -> Callable[[Any, Any], z3.BoolRef]:
    def run(a: Any, b: Any) -> z3.BoolRef:
        x, y = expr(a), expr(b)
        if z3.is_bool(x) and z3.is_bool(y) and op in (operator.eq, operator.ne):
            return op(x, y)
        return op(*_pair(x, y))
    return run


_BOOL_ARITH = {operator.add: z3.Or, operator.mul: z3.And}  # torch: bool + bool is a bool


def _arith(op: Callable[[Any, Any], Any]) -> Callable[..., z3.ArithRef]:
    def run(a: Any, b: Any, alpha: Any = 1) -> z3.ArithRef:
        ea, eb = expr(a), expr(b)
        _float_scalars(a, b, ea, eb)
        if z3.is_bool(ea) and z3.is_bool(eb):
            if op not in _BOOL_ARITH or alpha != 1:
                raise Unsupported("subtracts boolean tensors")
            return _BOOL_ARITH[op](ea, eb)
        x, y = _pair(ea, eb)
        if alpha != 1:
            y = y * num(alpha)
        return op(x, y)
    return run


def _invert(a: Any) -> z3.BoolRef:
    x = expr(a)
    if not z3.is_bool(x):
        raise Unsupported("uses ~ on an integer")
    return z3.Not(x)


def _where(c: Any, a: Any, b: Any) -> z3.ExprRef:
    x, y = expr(a), expr(b)
    if not (z3.is_bool(x) and z3.is_bool(y)):
        x, y = _pair(x, y)
    return z3.If(boolean(c), x, y)


def _minimum(a: Any, b: Any) -> z3.ArithRef:
    x, y = _pair(a, b)
    return z3.If(x <= y, x, y)


def _maximum(a: Any, b: Any) -> z3.ArithRef:
    x, y = _pair(a, b)
    return z3.If(x >= y, x, y)


def _clamp(a: Any, min: Any = None, max: Any = None) -> z3.ArithRef:  # noqa: A002 - torch's names
    x = num(a)
    if min is not None:
        x = _maximum(x, min)
    if max is not None:
        x = _minimum(x, max)
    return x


def _abs(a: Any) -> z3.ArithRef:
    x = num(a)
    return z3.If(x >= 0, x, -x)


def _sign(a: Any) -> z3.ArithRef:
    x = num(a)
    return z3.If(x > 0, 1, z3.If(x < 0, -1, 0))


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def convert(x: z3.ExprRef, target: Any) -> z3.ExprRef:
    """``x`` as ``target`` (a dtype, or "float64"/"narrow"), exactly, or `Unsupported`."""
    if target == torch.bool:
        return boolean(x)
    if z3.is_bool(x):
        return z3.If(x, 1.0, 0.0) if target in (torch.float64, *_FLOATS) else z3.If(x, 1, 0)
    if target == torch.float64:
        return z3.ToReal(x) if z3.is_int(x) else x
    if target in _FLOATS:
        if z3.is_int(x):
            raise Unsupported(f"converts index values to {target}, which rounds large indices")
        if target != torch.float32:  # scores are float32 where torch computes them: narrower rounds, saturates
            raise Unsupported(f"converts a floating value to {target}, which rounds it (and overflows past "
                              f"{torch.finfo(target).max:.6g})")
        return x  # float32 to float32: the value itself
    if target == torch.int64:
        if z3.is_real(x):
            raise Unsupported("converts a floating value to an integer")
        return x
    raise Unsupported(f"converts values to {target}, which wraps or rounds some of them")


_METHOD_DTYPES = {"bool": torch.bool, "float": torch.float32, "double": torch.float64,
                  "half": torch.float16, "bfloat16": torch.bfloat16, "long": torch.int64, "int": torch.int32}


def _cast(method: str) -> Callable[..., z3.ExprRef]:
    def run(a: Any, *args: Any, **kwargs: Any) -> z3.ExprRef:
        x = expr(a)
        if method in _METHOD_DTYPES:
            return convert(x, _METHOD_DTYPES[method])
        dtype = kwargs.get("dtype") or next((v for v in args if isinstance(v, torch.dtype)), None)
        if method == "type_as":
            other = args[0] if args else None
            if isinstance(other, Meta) or other is None:
                raise Unsupported("uses type_as with a tensor of unknown dtype")
            o = expr(other)
            if z3.is_bool(o):
                return boolean(x)
            if z3.is_int(o):
                return convert(x, torch.int64)
            if z3.is_int(x):
                raise Unsupported("converts index values to a floating dtype with type_as")
            return x
        return x if dtype is None else convert(x, dtype)
    return run


def _like(fill: Any) -> Callable[..., z3.ExprRef]:
    def run(a: Any, *args: Any, dtype: Any = None, **_: Any) -> z3.ExprRef:
        value = fill if fill is not None else (args[0] if args else 0)
        if type(value) not in (bool, int, float):
            raise Unsupported(f"fills a tensor with a {type(value).__name__}, not a constant")
        const(value)  # refuses non-finite values
        source = None if isinstance(a, Meta) else expr(a)
        if dtype == torch.bool or (dtype is None and source is not None and z3.is_bool(source)):
            return z3.BoolVal(bool(value))
        if (dtype is not None and dtype.is_floating_point) or (
                dtype is None and source is not None and z3.is_real(source)):
            return z3.RealVal(Fraction(float(value)))
        return const(int(value))
    return run


def _new(method: str) -> Callable[..., z3.ExprRef]:
    """``new_ones`` / ``new_zeros`` / ``new_full`` / ``new_tensor``: the source's dtype unless given."""
    def run(src: Any, *args: Any, dtype: Any = None, **kwargs: Any) -> z3.ExprRef:
        if method == "new_tensor":
            value = args[0] if args else kwargs.get("data")
        elif method == "new_full":
            value = args[1] if len(args) > 1 else kwargs.get("fill_value")
        else:
            value = 1 if method == "new_ones" else 0
        if type(value) not in (bool, int, float):
            raise Unsupported(f"uses {method} with a non-constant value")
        const(value)  # refuses non-finite values
        if dtype is None:
            source = None if isinstance(src, Meta) else expr(src)
            if source is None:
                raise Unsupported(f"uses {method} on a value of unknown dtype")
            kind = "bool" if z3.is_bool(source) else "float" if z3.is_real(source) else "int"
        else:
            kind = "bool" if dtype == torch.bool else "float" if dtype in (torch.float64, torch.float32) else (
                "int" if dtype == torch.int64 else None)
            if kind is None:
                raise Unsupported(f"uses {method} with dtype {dtype}")
        if kind == "bool":
            return z3.BoolVal(bool(value))
        if kind == "int":
            return z3.IntVal(int(value))  # torch truncates a float fill toward zero
        return const(float(value))
    return run


def _tensor(data: Any, *args: Any, dtype: Any = None, **_: Any) -> Any:
    """``torch.tensor(constant)``: its values were read while tracing (and are assumed constant)."""
    floating = isinstance(dtype, torch.dtype) and dtype.is_floating_point
    if isinstance(data, (bool, int, float)):
        return float(data) if floating else data
    try:
        values = torch.tensor(data, dtype=torch.float64 if floating else None)
    except (TypeError, ValueError) as exc:
        raise Unsupported(f"builds a tensor from {type(data).__name__} values inside the hook") from exc
    return Captured(values, "a tensor built by the hook")


def _bucketize(x: Any, bounds: Any, *, right: bool = False, out_int32: bool = False) -> z3.ArithRef:
    if not isinstance(bounds, Captured) or bounds.tensor.dim() != 1:
        raise Unsupported("uses torch.bucketize with non-constant boundaries")
    if bounds.tensor.dtype.is_floating_point or bounds.tensor.dtype == torch.bool:
        raise Unsupported(f"uses torch.bucketize with {bounds.tensor.dtype} boundaries {bounds.name}, which torch "
                          "compares in a floating dtype that rounds large indices")
    values = bounds.tensor.tolist()
    if any(a > b for a, b in zip(values, values[1:])):
        raise Unsupported(f"uses torch.bucketize with unsorted boundaries {bounds.name}")
    v = num(x)
    if not z3.is_int(v):
        raise Unsupported("uses torch.bucketize on a floating value")
    return z3.Sum([z3.If(num(b) <= v if right else num(b) < v, 1, 0) for b in bounds.tensor.tolist()] or [z3.IntVal(0)])


FUNCTIONS: dict[Any, Callable[..., Any]] = {
    operator.add: _arith(operator.add), operator.sub: _arith(operator.sub),
    operator.mul: _arith(operator.mul), operator.neg: lambda a: -num(a), operator.pos: num,
    operator.floordiv: _floordiv, operator.mod: _mod, operator.truediv: _truediv,
    operator.lt: _compare(operator.lt), operator.le: _compare(operator.le),
    operator.gt: _compare(operator.gt), operator.ge: _compare(operator.ge),
    operator.eq: _compare(operator.eq), operator.ne: _compare(operator.ne),
    operator.and_: _logic(z3.And), operator.or_: _logic(z3.Or), operator.xor: _logic(z3.Xor),
    operator.invert: _invert, operator.abs: _abs,
    torch.add: _arith(operator.add), torch.sub: _arith(operator.sub), torch.mul: _arith(operator.mul),
    torch.neg: lambda a: -num(a), torch.div: _div, torch.true_divide: _truediv,
    torch.floor_divide: _floordiv, torch.remainder: _mod, torch.fmod: _fmod,
    torch.lt: _compare(operator.lt), torch.le: _compare(operator.le), torch.gt: _compare(operator.gt),
    torch.ge: _compare(operator.ge), torch.eq: _compare(operator.eq), torch.ne: _compare(operator.ne),
    torch.logical_and: lambda a, b: z3.And(boolean(a), boolean(b)),
    torch.logical_or: lambda a, b: z3.Or(boolean(a), boolean(b)),
    torch.logical_xor: lambda a, b: z3.Xor(boolean(a), boolean(b)),
    torch.logical_not: lambda a: z3.Not(boolean(a)),
    torch.bitwise_and: _logic(z3.And), torch.bitwise_or: _logic(z3.Or), torch.bitwise_xor: _logic(z3.Xor),
    torch.bitwise_not: _invert, torch.where: _where, torch.minimum: _minimum, torch.maximum: _maximum,
    torch.min: _minimum, torch.max: _maximum, torch.clamp: _clamp, torch.clip: _clamp,
    torch.abs: _abs, torch.sign: _sign, torch.ones_like: _like(1), torch.zeros_like: _like(0),
    torch.full_like: _like(None), torch.tensor: _tensor, torch.scalar_tensor: _tensor,
    torch.bucketize: _bucketize,
}
METHODS: dict[str, Callable[..., Any]] = {
    "add": _arith(operator.add), "sub": _arith(operator.sub), "mul": _arith(operator.mul),
    "__add__": _arith(operator.add), "__sub__": _arith(operator.sub), "__mul__": _arith(operator.mul),
    "div": _div, "floor_divide": _floordiv, "remainder": _mod, "fmod": _fmod,
    "lt": _compare(operator.lt), "le": _compare(operator.le), "gt": _compare(operator.gt),
    "ge": _compare(operator.ge), "eq": _compare(operator.eq), "ne": _compare(operator.ne),
    "logical_and": FUNCTIONS[torch.logical_and], "logical_or": FUNCTIONS[torch.logical_or],
    "logical_not": FUNCTIONS[torch.logical_not], "logical_xor": FUNCTIONS[torch.logical_xor],
    "abs": _abs, "clamp": _clamp, "clip": _clamp, "sign": _sign, "where": lambda a, c, b: _where(c, a, b),
    "minimum": _minimum, "maximum": _maximum,
    "new_ones": _new("new_ones"), "new_zeros": _new("new_zeros"), "new_full": _new("new_full"),
    "new_tensor": _new("new_tensor"),
    "bool": _cast("bool"), "float": _cast("float"), "double": _cast("double"), "half": _cast("half"),
    "bfloat16": _cast("bfloat16"), "long": _cast("long"), "int": _cast("int"), "to": _cast("to"),
    "type_as": _cast("type_as"), "expand": lambda a, *s, **k: expr(a), "expand_as": lambda a, b: expr(a),
    "contiguous": lambda a, *k, **kw: expr(a), "clone": lambda a, *k, **kw: expr(a),
    "detach": lambda a: expr(a),
}


__all__ = ["Captured", "FLOAT_CONST_MAX", "FUNCTIONS", "INDEX_BOUND", "INT64", "MAX_TABLE", "METHODS", "Meta",
           "Unsupported", "boolean", "const", "convert", "element", "expr", "num"]
