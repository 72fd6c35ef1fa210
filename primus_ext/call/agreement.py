"""Whose ``causal`` / ``window_size`` a flex call runs: one rule for calls that disagree with the plan.

A call *agrees* with its layer's plan when the mask its ``(causal, window_size)`` ask for, read as
``flash_attn_func`` reads them (``causal`` caps the right bound at 0), is the plan's: the plan's
causal flag and window, or ``causal=False, window_size=(-1, -1)`` on a layer whose mask is a hook
(the hook is the whole mask, B11).  ``None`` (the adapter's default) means the plan's value, so
``TurboFlexAttention(plan)(q, k, v)`` runs the attention the plan approved.  An agreeing call runs
the plan's own flags.

A call that disagrees is refused (B11 for a hook layer, B34 otherwise), on every path, unless the
adapter is in *drop-in* mode (``turbo_flex_attention_call_flags: drop_in``, or
``TurboFlexAttention(plan, drop_in=True)``): then a call's own flags run, as a ``flash_attn_func``
caller expects, after the layer's rules have checked them (`AttentionPlan.bind_call`, once per
distinct value).  A hook layer refuses other flags in either mode (they would be composed with the
hook, B11).

Under ``torch.compile`` the verdict is reached while the call is traced, never in the graph: the
flags are Python constants there (a traced int is specialised to its value), `_traced_verdict`
runs for real (``torch.compiler.assume_constant_result``), and its result is a constant of the
graph.  A refusal is raised then as `CompiledCallRefusal`, an `UnsupportedInputError` that Dynamo
lets through unchanged (it wraps any other error of a traced function in its own exception).
"""

from __future__ import annotations

import itertools
import operator
import weakref
from typing import Any, Optional, Tuple

import torch

from .. import refusals as R
from ..attention.pattern import Pattern, pattern_from_flash_args
from ..errors import UnsupportedInputError, short_repr
from ..refusals import CompiledCallRefusal, refuse
from .checks import check_window

PLAN, DROP_IN = "plan", "drop_in"

Flags = Tuple[bool, Tuple[int, int]]

def flash_args(causal: Any, window_size: Any) -> Flags:
    """``(causal, (left, right))`` as plain bool and ints, the window checked (B34)."""
    return bool(causal), check_window(window_size)


_AGREEMENTS: dict[int, "CallAgreement"] = {}
_NEXT = itertools.count(1)


class CallAgreement:
    """One adapter's rule for the ``causal`` / ``window_size`` of its calls (see the module doc)."""

    def __init__(self, plan: Any, drop_in: Optional[bool] = None, owner: Any = None) -> None:
        if drop_in is not None and not isinstance(drop_in, bool):
            raise refuse(R.DROP_IN_TYPE, got=short_repr(drop_in))
        self.plan = plan
        self.drop_in = getattr(plan, "call_flags", PLAN) == DROP_IN if drop_in is None else drop_in
        self.hooked = plan.mask_mod is not None
        window = tuple(plan.window)
        self.flags: Flags = (False, (-1, -1)) if self.hooked else (bool(plan.causal), (int(window[0]), int(window[1])))
        self.pattern = pattern_from_flash_args(*self.flags)
        # A plain int names this agreement inside a traced call (a graph constant, like an op handle).
        self.handle = next(_NEXT)
        _AGREEMENTS[self.handle] = self
        if owner is not None:
            weakref.finalize(owner, _AGREEMENTS.pop, self.handle, None)

    def resolve(self, causal: Any, window_size: Any) -> Flags:
        """The normalised ``(causal, window)`` this call runs, or our refusal (eager or traced)."""
        if torch.compiler.is_compiling():
            flag, odd_flag = _as_constant(causal)
            window, odd_window = _as_constant(window_size)
            return _traced_verdict(self.handle, flag, window, odd_flag, odd_window)
        return self.verdict(causal, window_size)

    def verdict(self, causal: Any, window_size: Any) -> Flags:
        """`resolve` on concrete values: the plan's flags for an agreeing call, a drop-in call's own
        (checked by the layer's rules), else `UnsupportedInputError`."""
        planned_flag, planned_window = self.flags
        try:
            flag = planned_flag if causal is None else bool(causal)
        except (RuntimeError, TypeError, ValueError):  # e.g. a tensor of several flags
            raise refuse(R.CAUSAL_FLAG, got=short_repr(causal)) from None
        window = planned_window if window_size is None else check_window(window_size)
        if (flag == planned_flag and window == planned_window) or pattern_from_flash_args(flag, window) == self.pattern:
            return self.flags
        if self.hooked:
            raise self._refusal(causal, window_size, flag, window, hooked=True)
        if not self.drop_in:
            raise self._refusal(causal, window_size, flag, window, hooked=False)
        bind = self.plan.bind_call
        if bind is not None:
            bind(flag, window)
        return flag, window

    def _refusal(self, causal: Any, window_size: Any, flag: bool, window: Tuple[int, int],
                 hooked: bool) -> UnsupportedInputError:
        plan = self.plan
        asked = (f"causal={self.flags[0] if causal is None else short_repr(causal)}, window_size="
                 f"{self.flags[1] if window_size is None else short_repr(window_size)}")
        mask, context = pattern_from_flash_args(flag, window).describe(), f"layer {plan.layer_number}"
        if hooked:
            return refuse(R.HOOK_FLAGS, context, hook=plan.mask_hook, asked=asked, mask=mask)
        return refuse(R.CALL_FLAGS, context, asked=asked, mask=mask, causal=self.flags[0], window=self.flags[1],
                      planned=self.pattern.describe())

    def opaque(self, odd_flag: str, odd_window: str) -> UnsupportedInputError:
        """The refusal of flags that cannot be graph constants (a tensor, an object) in a traced call."""
        what = " and ".join(f"{name} is {odd}" for name, odd in (("causal", odd_flag), ("window_size", odd_window))
                            if odd)
        return refuse(R.TRACED_FLAGS, f"layer {self.plan.layer_number}", what=what)


def _as_constant(value: Any) -> Tuple[Any, str]:
    """``(value, "")`` with traced ints specialised to their value (``operator.index`` does so under
    Dynamo, guarding on it), tuples and lists as tuples; ``(None, what it is)`` for a value that
    cannot be a graph constant."""
    if isinstance(value, (tuple, list)):
        items = []
        for x in value:
            item, odd = _as_constant(x)
            if odd:
                return None, odd
            items.append(item)
        return tuple(items), ""
    if value is None or isinstance(value, (bool, float, str)):
        return value, ""
    if isinstance(value, int):
        return operator.index(value), ""
    return None, f"a {type(value).__name__}"


@torch.compiler.assume_constant_result  # run for real while a call is traced; its result is a graph constant
def _traced_verdict(handle: int, causal: Any, window_size: Any, odd_flag: str, odd_window: str) -> Flags:
    """`CallAgreement.verdict` of a traced call (constant arguments), refusals as `CompiledCallRefusal`."""
    agreement = _AGREEMENTS[handle]
    try:
        if odd_flag or odd_window:
            raise agreement.opaque(odd_flag, odd_window)
        return agreement.verdict(causal, window_size)
    except UnsupportedInputError as exc:
        raise R.refuse_compiled(exc) from None


__all__ = ["DROP_IN", "PLAN", "CallAgreement", "CompiledCallRefusal", "flash_args"]
