"""The contract between the attention adapter and a backend.

A backend runs one attention call that the plan has already approved.  It gets the
tensors in the caller's layout (dense bshd ``[B, S, H, D]`` or packed thd
``[T, H, D]``) and a `KernelCall` describing the mask and numerics; it returns
``out`` in the same layout (``(out, lse)`` with ``return_lse``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional, Protocol, Tuple, Union

import torch
from torch import Tensor

from ..attention.pattern import MaskMod, Pattern, ScoreMod

Output = Union[Tensor, Tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class KernelCall:
    """Everything except the tensors q/k/v that decides what one call computes.

    ``pattern`` is the recognised mask; ``None`` means a custom ``mask_mod`` that
    only a backend with ``runs_any_mask`` may run.  ``flash_args`` holds the
    caller's own ``causal``/``window_size`` when the pattern came from them (and
    not from a hook), so a backend can forward them unchanged.
    """

    pattern: Optional[Pattern]
    mask_mod: Optional[MaskMod] = None
    score_mod: Optional[ScoreMod] = None
    scale: Optional[float] = None
    dropout_p: float = 0.0
    sink: Optional[Tensor] = None
    alibi_slopes: Optional[Tensor] = None
    bias: Optional[Tensor] = None
    deterministic: bool = False
    return_lse: bool = False
    flash_args: Optional[Tuple[bool, Tuple[int, int]]] = None


HOOKS_EVALUATED = "evaluated"
"""A backend that calls a user hook itself, as torch calls it, on every call (exact for any hook)."""
HOOKS_TRACED = "traced"
"""A backend that traces a user hook into its kernel (torch's FlexAttention): any admitted hook, not a dynamic one."""
HOOKS_PROVEN = "proven"
"""Fixed kernels: a user hook runs only when proven equal, for every batch, head and position, to a mask they
compute (the plan's hook rules refuse any other)."""
TURBO_DISPATCH = "primus-turbo"
"""Primus-Turbo's dispatch model (`primus_ext.backends.dispatch`): which kernel takes a call, per arch."""


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can run, declared as data; the plan's rules read it at build time and the call path at
    every call (no rule compares a backend's name).

    Entry names are those of the installed kernels (``None`` when absent).
    """

    name: str
    hooks: str
    """How the backend computes a user hook: `HOOKS_EVALUATED`, `HOOKS_TRACED` or `HOOKS_PROVEN`."""
    softcap: bool
    dense_entry: Optional[str] = None
    packed_entry: Optional[str] = None
    direct_entry: Optional[str] = None
    sink_dense: bool = True
    sink_packed: bool = True
    deterministic_dense: bool = True
    deterministic_packed: bool = True
    dropout: bool = True
    """It draws attention dropout."""
    alibi: bool = False
    """Its fixed kernels take ALiBi slopes (``alibi_slopes``); a backend that runs any mask computes ALiBi itself."""
    bias: bool = False
    """Its fixed kernels take a dense ``bias`` tensor."""
    deterministic_backward: bool = True
    """Its backward is shown deterministic where ``deterministic`` is asked (an entry may still lack the flag)."""
    learned_tables: bool = True
    """Autograd reaches the tensors a hook captures (a learned bias table trains)."""
    dispatch: Optional[str] = None
    """The dispatch model that routes its calls to kernels per arch (`TURBO_DISPATCH`), or None: the plan then
    checks the routes of that model at build (B33) and lays tensors out for its kernels."""
    tree_mask: bool = False
    """Computes a shared-prefix row's tree mask itself, in one call (``tree``: torch's FlexAttention); else the row
    runs as two kernel-pair calls merged through their LSEs (B37)."""
    notes: Tuple[str, ...] = field(default=())

    @property
    def runs_any_mask(self) -> bool:
        """It computes every mask exactly, a hook's included (it evaluates or traces hooks itself)."""
        return self.hooks != HOOKS_PROVEN


class AttentionBackend(Protocol):
    """A way to run attention: ``reference`` (exact torch math) or ``turbo`` (Primus-Turbo).

    Everything the call path asks of a backend is declared here; a backend subclasses this
    Protocol to get the defaults of the optional methods (`bind_dense`, `bind_packed`,
    `kernel_pair`) and writes `capabilities`, `dense` and `packed`.  Tensors come in the
    caller's layout (dense bshd ``[B, S, H, D]``, packed thd ``[T, H, D]``), the mask and
    numerics in a `KernelCall`, already approved by the plan and checked by the call path.
    """

    name: str

    def capabilities(self) -> BackendCapabilities:
        """What this backend runs, read by the plan's rules at build time and by the call path
        (``runs_any_mask``: it evaluates hooks itself and computes every mask exactly)."""
        ...

    def dense(self, q: Tensor, k: Tensor, v: Tensor, call: KernelCall) -> Output:
        """One dense call: ``out`` ``[B, Sq, Hq, Dv]``, ``(out, lse [B, Hq, Sq])`` with ``return_lse``."""
        ...

    def packed(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_kv: Tensor,
               max_seqlen_q: Any, max_seqlen_kv: Any, call: KernelCall) -> Output:
        """One packed call: ``out`` ``[T, Hq, Dv]``, ``(out, lse [Hq, T])`` with ``return_lse``."""
        ...

    def bind_dense(self, call: KernelCall) -> Callable[..., Output]:
        """``run(q, k, v, sink)`` making ``call`` again with new tensors (the prepared-call cache keeps
        it for equal calls); a backend overrides it to prepare its kernel's arguments once."""
        def run(q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor]) -> Output:
            return self.dense(q, k, v, call if sink is call.sink else dataclasses.replace(call, sink=sink))
        return run

    def bind_packed(self, call: KernelCall) -> Callable[..., Output]:
        """``run(q, k, v, cu_q, cu_kv, max_q, max_kv, sink)``, as `bind_dense` for packed calls."""
        def run(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_kv: Tensor, max_q: Any, max_kv: Any,
                sink: Optional[Tensor]) -> Output:
            same = call if sink is call.sink else dataclasses.replace(call, sink=sink)
            return self.packed(q, k, v, cu_q, cu_kv, max_q, max_kv, same)
        return run

    def kernel_pair(self, a: "CallArgs", call: KernelCall, routes: Any) -> Optional["KernelPair"]:
        """The kernel-level forward / backward of a compiled step for this call, or None: then the
        backward op differentiates a recompute of `dense` / `packed`.  ``routes``: the layer's
        `~primus_ext.backends.call_route.CallRoutes` on a known arch, else None."""
        return None


class CallArgs(NamedTuple):
    """One call as the ops see it (``cu_q`` None for a dense call)."""

    q: Tensor
    k: Tensor
    v: Tensor
    cu_q: Optional[Tensor]
    cu_kv: Optional[Tensor]
    max_q: int
    max_kv: int
    sink: Optional[Tensor]
    alibi: Optional[Tensor]
    bias: Optional[Tensor]
    causal: bool
    window: tuple[int, int]
    scale: Optional[float]
    dropout_p: float
    deterministic: bool
    return_lse: bool = False
    """Whether the caller asked for lse: the reference picks its math by it (forward and backward alike)."""


class KernelPair(Protocol):
    """A kernel-level forward and its backward for one call, decided from metadata only."""

    def forward(self, a: CallArgs) -> tuple[Tensor, Tensor, Tensor]:
        """``(out, lse, rng_state)`` in the op's layouts; ``rng_state`` as the kernel returns it, with
        `kernel_rng`'s metadata (AITER's sink path asserts its own CPU int64 ``[2]`` in the backward)."""
        ...

    def backward(self, a: CallArgs, grad_out: Tensor, out: Tensor, lse: Tensor, rng_state: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        """``(dq, dk, dv, dsink, dalibi, dbias)`` from the forward's ``out``, ``lse`` and ``rng_state``."""
        ...


def kernel_rng(a: CallArgs, *, fake: bool = False) -> Tensor:
    """The forward op's ``rng_state`` of a call without dropout: int64 ``[2]`` as AITER's kernels
    return it (on the CPU from the dense sink path's Triton forward, on the device from CK), so a
    kernel pair's own state crosses the graph unchanged; zeros where no kernel gave one."""
    device = torch.device("cpu") if a.cu_q is None and a.sink is not None else a.q.device
    return (torch.empty if fake else torch.zeros)(2, dtype=torch.int64, device=device)


def fp32_sink(sink: Optional[Tensor]) -> Optional[Tensor]:
    """The sink as the kernels take it: fp32, cast differentiably so a bf16 parameter
    still receives its gradient (B12)."""
    if sink is None or sink.dtype == torch.float32:
        return sink
    return sink.float()


def same_tensor(a: Tensor, b: Tensor) -> bool:
    """The same boundaries without reading them: one tensor, or two views of the same memory."""
    return a is b or (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape
                      and a.stride() == b.stride() and a.data_ptr() == b.data_ptr())


__all__ = ["AttentionBackend", "BackendCapabilities", "CallArgs", "KernelCall", "KernelPair", "kernel_rng", "Output", "fp32_sink", "same_tensor"]
