"""`PlanTarget`: one layer's approved plan on its backend, for one checked call.

It turns a checked `CallArgs` into the backend's `KernelCall` (the mask and numerics the
plan approved for it) and runs it: eagerly, as the bound runner the prepared-call cache
keeps, or as the kernel-level pair a compiled step's ops call.  What an op handle names
(`primus_ext.call.ops`).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from .. import refusals as R
from ..attention.library import library_pattern
from ..attention.pattern import Pattern, pattern_from_flash_args
from ..backends.base import TURBO_DISPATCH, AttentionBackend, CallArgs, KernelCall, KernelPair, Output
from ..backends.call_route import CallRoutes
from ..backends.flex_masks import captured_state, learned_tensors, same_state, user_hook
from ..plan.plan import AttentionPlan
from .prepared import Runner


class PlanTarget:
    """Runs ``plan`` on ``backend``; calls come checked and normalised (``causal`` a bool, ``window``
    two ints), by the adapter or by an op's schema."""

    def __init__(self, plan: AttentionPlan, backend: AttentionBackend) -> None:
        self.plan = plan
        self.backend = backend
        caps = backend.capabilities()
        exact = caps.runs_any_mask
        self.caps = caps
        # Routes of the dispatch model the backend declares (Primus-Turbo's, or none).  A hook plan takes no packed
        # calls (B17), so its varlen calls are its own documents, not declared ones.
        self.routes = None if exact or caps.dispatch != TURBO_DISPATCH else CallRoutes(
            plan.arch, plan.selection, plan.equal_documents and plan.mask_mod is None, plan.turbo_build)
        # Fixed kernels take ALiBi as slopes; a backend that runs any mask runs the score_mod itself.
        self.score_mod = plan.score_mod if exact else None
        # Such a backend evaluates every user hook itself at every call, proven or not, so it stays
        # exact whatever a proof assumed; only library masks run as their pattern.
        self.hook_runs_itself = exact and plan.mask_mod is not None and library_pattern(plan.mask_mod) is None
        # Chunks and constant document cuts hold at every length; a call gets its boundaries.
        self.per_length = plan.pattern is not None and (plan.pattern.chunk is not None
                                                        or plan.pattern.cuts is not None)
        # A proof that used a module global or a captured tensor holds while they are unchanged; a
        # backend evaluating the hooks itself needs no check.
        self.assumptions = () if exact else tuple(plan.hook_assumptions)
        # Hooks this backend evaluates, at the forward and again at the backward: what they read must not change
        # in between (`hook_state`).
        # The user's own hooks behind the plan's wrappers (whose own module state is the project's).
        self._stateful = tuple(user_hook(h, kind) for h, kind in ((plan.mask_mod if self.hook_runs_itself else None,
                                                                  "mask_mod"), (self.score_mod, "score_mod"))
                               if h is not None)

    def kernel_call(self, a: CallArgs, flash: Optional[Pattern] = None) -> KernelCall:
        """What ``a`` computes: the plan's pattern (at the call's length) for a dense call on a hook
        layer, else the call's own ``(causal, window)`` (``flash``: their pattern, if built already)."""
        dense = a.cu_q is None
        if not dense or self.plan.mask_mod is None:
            return KernelCall(pattern=flash or pattern_from_flash_args(a.causal, a.window),
                              mask_mod=self.plan.mask_mod if dense else None,
                              score_mod=self.score_mod if dense else None, scale=a.scale, dropout_p=a.dropout_p,
                              sink=a.sink, alibi_slopes=a.alibi, bias=a.bias, deterministic=a.deterministic,
                              return_lse=a.return_lse, flash_args=(a.causal, a.window) if dense else None)
        pattern = None if self.hook_runs_itself else self.plan.pattern
        if pattern is not None and self.per_length:
            pattern = pattern.at_length(a.q.shape[1])
        return KernelCall(pattern=pattern, mask_mod=self.plan.mask_mod, score_mod=self.score_mod, scale=a.scale,
                          dropout_p=a.dropout_p, sink=a.sink, alibi_slopes=a.alibi, bias=a.bias,
                          deterministic=a.deterministic, return_lse=a.return_lse)

    def check(self, a: CallArgs, call: Optional[KernelCall] = None) -> None:
        """The call's kernel route and storage layout on the plan's arch (B33, B34): the adapter runs
        it on an eager call, the forward op inside a compiled graph (``call``: `kernel_call` of ``a``).
        Fixed kernels that declare they take no ALiBi slopes or bias are given none (B34.backend-lacks)."""
        caps = self.caps
        if not caps.runs_any_mask:
            for name, given, takes in (("alibi_slopes", a.alibi, caps.alibi), ("bias", a.bias, caps.bias)):
                if given is not None and not takes:
                    raise R.refuse(R.BACKEND_LACKS, what=name, backend=caps.name)
        if self.routes is None:
            return
        pattern = (call or self.kernel_call(a)).pattern
        if pattern is None:
            return
        entry = "varlen" if a.cu_q is not None or pattern.documents else "dense"
        self.routes.check(entry, a, pattern.right == 0, pattern.window)

    def check_assumptions(self) -> None:
        """What the hook proofs rest on still holds (B31): the adapter checks it on an eager call, the forward
        op when a compiled graph runs (its Python reads of version counters and storage are no graph's)."""
        for assumption in self.assumptions:
            if not assumption.holds():
                hooks = " / ".join(h for h in (self.plan.mask_hook, self.plan.score_hook) if h)
                raise R.refuse(R.HOOK_ASSUMPTION, hooks=hooks, what=assumption.what)

    def hook_state(self) -> Optional[tuple]:
        """What the hooks this backend evaluates read, now (`captured_state`); None when it evaluates none."""
        return captured_state(*self._stateful) if self._stateful else None

    def check_hook_state(self, state: Optional[tuple]) -> None:
        """Refuse a backward whose hooks would read other values than its forward's (B34.hook-changed)."""
        # what no stamp can watch (a dynamic hook's objects) is the documented limit: docs/mask_hooks.md
        if state is not None and not same_state(state, captured_state(*self._stateful), watched_only=True):
            hooks = " / ".join(h for h in (self.plan.mask_hook, self.plan.score_hook) if h)
            raise R.refuse(R.HOOK_CHANGED, hooks=hooks)

    def check_in_graph(self, a: CallArgs) -> None:
        """What a compiled graph checks when it runs: the proofs' assumptions, and that no tensor the hooks
        capture wants a gradient, which an op cannot hand back (B34)."""
        self.check_assumptions()
        if self.plan.mask_mod is None and self.plan.score_mod is None:
            return
        # Grad mode inside an op says nothing of the caller's, and a frozen model may still train the table.
        learned = learned_tensors(self.plan.mask_mod, self.plan.score_mod)
        if learned:
            raise R.refuse(R.LEARNED_COMPILE, learned=learned)

    def run(self, a: CallArgs) -> Output:
        """The call, eagerly, with the backend's own autograd."""
        call = self.kernel_call(a)
        if a.cu_q is None:
            return self.backend.dense(a.q, a.k, a.v, call)
        return self.backend.packed(a.q, a.k, a.v, a.cu_q, a.cu_kv, a.max_q, a.max_kv, call)

    def pair(self, a: CallArgs) -> Optional[KernelPair]:
        """The backend's kernel-level pair for this call, if it has one (compiled steps)."""
        return self.backend.kernel_pair(a, self.kernel_call(a), self.routes)

    def runner(self, call: KernelCall, dense: bool) -> Runner:
        """``call`` with only its tensors to give (the adapter's eager call, and the prepared-call cache):
        ``run(q, k, v, sink)``, packed ``run(q, k, v, cu_q, cu_kv, max_q, max_kv, sink)``.  Where the backend
        evaluates hooks, its outputs' gradients first check that what they read is what the forward read."""
        run = self.backend.bind_dense(call) if dense else self.backend.bind_packed(call)
        return functools.partial(_guarded, run, self) if self._stateful else run


def _guarded(run: Runner, target: PlanTarget, *args: Any) -> Output:
    """``run(*args)``, with a gradient hook on each output that refuses the backward if what the hooks read
    changed since this forward (the hook fires before the attention's own backward does)."""
    result = run(*args)
    outputs = result if isinstance(result, tuple) else (result,)
    if torch.is_grad_enabled() and any(t.requires_grad for t in outputs):
        state = target.hook_state()

        def check(grad: torch.Tensor) -> torch.Tensor:
            target.check_hook_state(state)
            return grad

        for t in outputs:
            if t.requires_grad:
                t.register_hook(check)
    return result


__all__ = ["PlanTarget"]
