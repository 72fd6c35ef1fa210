"""The self-test's part for routes on the ``flex`` backend (torch's FlexAttention; B33).

A plan on the flex backend (``plan.backend == "flex"``) runs its routes through the same adapter
the layer uses (`TurboFlexAttention` over a `FlexBackend`), with the same inputs and comparison as
a Turbo route (`primus_ext.call.selftest`): dense calls with the plan's own hooks (mask_mod /
score_mod, evaluated by both sides), packed calls without hooks (B17 refuses hooks on packed
batches), sinks, GQA and ALiBi as the plan says, forward and backward against the ``reference``
backend on the same device.  What this module adds:

* the backend a route runs on: torch's ``flex_attention`` (compiled off the CPU), or ``kernel``, a
  function with its exact call contract (a test's stand-in, never imported from here), with a
  BlockMask cache of its own, so the self-test's masks (at its own length) take no room in the
  cache the layers share;
* what a flex route's results are keyed by besides a Turbo route's: the hooks by identity (for an
  admitted hook no proven pattern stands in for it), the kernel, and whether the backward ran;
* torch's ``flex_attention`` has no CPU backward (`FlexBackend` refuses one, B34.flex-cpu-grad), so on
  the CPU with torch's kernel a flex route is checked forward only and says so (`FORWARD_ONLY`);
  that is no failure, and the self-test is on by default only where a GPU is
  (`selftest.selftest_enabled`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..backends.flex import FlexBackend
from ..backends.flex_cache import BlockMaskCache
from ..backends.flex_masks import captured_state, user_hook
from ..plan.plan import AttentionPlan

FORWARD_ONLY = "forward only: torch's flex_attention has no CPU backward"
"""What a flex route on the CPU with torch's own kernel leaves unchecked, and why."""


def on_flex(plan: AttentionPlan) -> bool:
    """The plan runs on torch's FlexAttention (the flex path on the ``flex`` backend)."""
    return plan.flex and plan.backend == "flex"


def flex_backend(kernel: Optional[Callable[..., Any]] = None) -> FlexBackend:
    """The backend a flex route runs on: torch's ``flex_attention`` when ``kernel`` is None, else
    ``kernel``; a fresh BlockMask cache.  The one place the self-test makes it (a test may replace it)."""
    return FlexBackend(kernel=kernel, block_masks=BlockMaskCache())


def checks_backward(device: torch.device, backend: FlexBackend) -> bool:
    """Whether a flex route's backward can run: anywhere but the CPU with torch's own kernel."""
    return device.type != "cpu" or backend.kernel is not None


def reads_captured_tensors(plan: AttentionPlan) -> bool:
    """Whether the plan's hooks read tensors they capture (document ids per token, a table): such a hook
    may be defined only up to the model's length, so the self-test runs it there or not at all."""
    return any(stamp[0] in ("tensor", "inference tensor")
               for stamp in captured_state(plan.mask_mod, plan.score_mod))


class _Same:
    """An object by identity in a cache key, hashable or not, held alive by the key (so its id is
    not reused while the entry lives)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj


def key_part(plan: AttentionPlan, device: torch.device, backend: Optional[FlexBackend]) -> tuple:
    """What a flex route's result is keyed by besides a Turbo route's (() off flex: no ``backend``): each
    hook by identity, as the backend calls it (`user_hook`: the user's function behind the plan's
    wrappers, with the head offset, one per hook and offset, so the layers of one hook share it), the
    kernel, and whether the backward ran."""
    if backend is None:
        return ()
    hooks = (user_hook(plan.mask_mod, "mask_mod"), user_hook(plan.score_mod, "score_mod"), backend.kernel)
    return ("flex", *map(_Same, hooks), checks_backward(device, backend))


def mask_text(plan: AttentionPlan, packed: bool, inside: str) -> str:
    """A flex route's mask as its row names it: the hooks it runs (dense), else the plan's pattern
    (``inside`` each document for a packed route, which takes no hook)."""
    if packed:
        return inside
    hooks = [f"{kind} {name}" for kind, name in (("mask_mod", plan.mask_hook), ("score_mod", plan.score_hook))
             if name]
    shown = [] if plan.mask_hook and plan.pattern is None else [plan.pattern_text]
    return ", ".join(shown + hooks)


__all__ = ["FORWARD_ONLY", "checks_backward", "flex_backend", "key_part", "mask_text", "on_flex",
           "reads_captured_tensors"]
