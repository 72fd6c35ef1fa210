"""The allow-list of the provable subset (`hook_subset`): what a hook may call, read and execute."""

from __future__ import annotations

import math
import operator
import os
import sysconfig
from typing import Any

import torch
from torch.nn.attention import flex_attention as _flex

from .ops import FUNCTIONS, METHODS

TORCH_DIR = os.path.join(os.path.dirname(torch.__file__), "")
STDLIB_DIR = os.path.join(sysconfig.get_paths()["stdlib"], "")
PACKAGE_DIRS = tuple({os.path.join(sysconfig.get_paths()[k], "") for k in ("purelib", "platlib")})

TORCH_FUNCTIONS: frozenset[Any] = frozenset(f for f in FUNCTIONS if f not in (torch.min, torch.max)) | {
    torch.exp, torch.exp2, torch.log, torch.log2, torch.sqrt, torch.tanh, torch.sigmoid, torch.pow,
    torch.floor, torch.ceil, torch.round, torch.trunc, torch.clamp_min, torch.clamp_max, torch.square}
"""Elementwise torch functions (``torch.min`` / ``torch.max`` are not: one argument reduces)."""
TENSOR_METHODS: frozenset[str] = frozenset(METHODS) | {
    "exp", "exp2", "log", "log2", "sqrt", "tanh", "sigmoid", "pow", "floor", "ceil", "round", "trunc", "neg",
    "clamp_min", "clamp_max", "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "square",
    "__and__", "__or__", "__xor__", "__invert__", "__neg__", "__lt__", "__le__", "__gt__", "__ge__",
    "__eq__", "__ne__", "__floordiv__", "__mod__", "__truediv__"}
"""Elementwise tensor methods; no shape, size, item or reduction (they differ between calls)."""
TENSOR_ATTRIBUTES = frozenset({"dtype", "device", "is_cuda"})
BUILTINS = frozenset({abs, min, max, int, float, bool, round, pow, divmod})
MATH_FUNCTIONS = frozenset({math.floor, math.ceil, math.trunc, math.sqrt, math.isqrt, math.log, math.log2,
                            math.log10, math.exp, math.pow, math.fabs, math.gcd, math.copysign})
OPERATORS = frozenset(v for v in vars(operator).values() if callable(v) and v in FUNCTIONS)
_AND = _flex.and_masks(lambda *a: None).__code__
_OR = _flex.or_masks(lambda *a: None).__code__
COMBINATORS = {_AND: "and_masks", _OR: "or_masks"}
"""torch's own mask combinators, by code object: their parts are checked, not their loop."""

PLAIN = {"RESUME", "NOP", "EXTENDED_ARG", "COPY_FREE_VARS", "KW_NAMES", "PRECALL", "CACHE"}
WORDS = {
    "STORE_GLOBAL": "a write to a module global", "DELETE_GLOBAL": "a write to a module global",
    "STORE_DEREF": "a write to a captured variable", "DELETE_DEREF": "a write to a captured variable",
    "STORE_ATTR": "a write to an attribute", "DELETE_ATTR": "a write to an attribute",
    "STORE_SUBSCR": "a write to an item", "DELETE_SUBSCR": "a write to an item",
    "MAKE_FUNCTION": "a nested function or lambda", "LOAD_CLOSURE": "a nested function or lambda",
    "MAKE_CELL": "a nested function or lambda", "IMPORT_NAME": "an import", "IMPORT_FROM": "an import",
    "GET_ITER": "a loop", "FOR_ITER": "a loop", "JUMP_BACKWARD": "a loop", "JUMP_BACKWARD_NO_INTERRUPT": "a loop",
    "POP_JUMP_BACKWARD_IF_TRUE": "a loop", "POP_JUMP_BACKWARD_IF_FALSE": "a loop",
    "POP_JUMP_BACKWARD_IF_NONE": "a loop", "POP_JUMP_BACKWARD_IF_NOT_NONE": "a loop",
    "YIELD_VALUE": "a generator", "RETURN_GENERATOR": "a generator", "BEFORE_WITH": "a with block",
    "RAISE_VARARGS": "a raise", "RERAISE": "a raise", "CALL_FUNCTION_EX": "a call with *args or **kwargs",
    "BUILD_LIST": "a list", "BUILD_MAP": "a dict", "BUILD_SET": "a set", "BUILD_CONST_KEY_MAP": "a dict",
    "FORMAT_VALUE": "string formatting", "BUILD_STRING": "string formatting", "LOAD_NAME": "a name looked up "
    "at run time", "STORE_NAME": "a name bound at run time", "DELETE_FAST": "a deleted local",
}


__all__ = ["BUILTINS", "COMBINATORS", "MATH_FUNCTIONS", "OPERATORS", "PACKAGE_DIRS", "PLAIN", "STDLIB_DIR",
           "TENSOR_ATTRIBUTES", "TENSOR_METHODS", "TORCH_DIR", "TORCH_FUNCTIONS", "WORDS"]
