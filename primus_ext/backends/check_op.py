"""A value check inside a compiled graph that still refuses with the project's error.

Eagerly, an on-device assertion on CPU fails at once and the caller raises its refusal.  In a
graph traced by ``torch.compile`` the check has to be an op, and ``torch._assert_async`` there
fails as a bare ``RuntimeError``: a torch error escaping from inside, which the project never
lets happen.  So ``primus_ext::refuse_unless`` is an opaque op that, when the graph runs, raises
the registered refusal on CPU (our error type, as eager) and falls back to the device-side
assert elsewhere (no host sync: on a GPU the failure stays asynchronous, with the same text).

The op returns nothing, so it is registered as an ordered side effect: the compiler keeps it
in the graph, in program order, instead of dropping an op whose result nobody reads.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from ..errors import PrimusExtError
from .base import same_tensor

_REFUSALS: list[tuple[str, Callable[[], PrimusExtError]]] = []
"""``(why, refusal)`` of each check traced so far; the op carries the index (a graph constant)."""
_BY_TEXT: dict[str, int] = {}
_MAX = 4096  # distinct checks a process traces; beyond it the oldest texts are reused, never grown


@torch.compiler.assume_constant_result  # run for real while a graph is traced: the op needs the entry then
def refusal_id(why: str, refusal: Callable[[], PrimusExtError]) -> int:
    """The index the op carries for this check (one per distinct text)."""
    found = _BY_TEXT.get(why)
    if found is not None:
        _REFUSALS[found] = (why, refusal)
        return found
    if len(_REFUSALS) >= _MAX:
        _BY_TEXT.clear()
        _REFUSALS.clear()
    _REFUSALS.append((why, refusal))
    _BY_TEXT[why] = len(_REFUSALS) - 1
    return _BY_TEXT[why]


@torch.library.custom_op("primus_ext::refuse_unless", mutates_args=())
def refuse_unless(ok: Tensor, check: int) -> None:
    why, refusal = _REFUSALS[check]
    if ok.device.type == "cpu":
        if not bool(ok):
            raise refusal()
        return
    torch._assert_async(ok, why)


@refuse_unless.register_fake
def _(ok: Tensor, check: int) -> None:
    return None


def _keep_in_graph() -> bool:
    try:  # torch's own mechanism for ops run for their effect (as its print op uses)
        from torch._higher_order_ops.effects import _EffectType, _register_effectful_op
    except ImportError:
        return False
    _register_effectful_op(torch.ops.primus_ext.refuse_unless.default, _EffectType.ORDERED)
    return True


KEPT_IN_GRAPH = _keep_in_graph()
"""False on a torch without effect registration: compiled checks then use the device-side assert."""

DEFERRED: list[list[tuple[Tensor, str, Callable[[], PrimusExtError]]]] = []
"""Open collections of value checks (`primus_ext.megatron.rank_agreement`): while one is open, a
check is recorded there and asserted only after the ranks of a group have agreed, so that a
device-side assert never leaves one rank alone in a collective.  On CPU, eagerly, a failing
check still raises at once: nothing after it runs on the refused values."""



def assert_on_device(ok: Tensor, why: str, refusal: Callable[[], PrimusExtError]) -> None:
    """A value check without a host sync: an on-device assertion of ``ok``.

    On CPU it fails at once and ``refusal()`` is raised instead (our error type); on a GPU
    it fails later as a device-side assert with ``why``.  Inside a compiled graph the check
    is the op `check_op.refuse_unless`, which does the same when the graph runs.  While a
    collection is open (`DEFERRED`) the check is recorded there instead.
    """
    if DEFERRED:
        DEFERRED[-1].append((ok, why, refusal))
        if not torch.compiler.is_compiling() and ok.device.type == "cpu" and not bool(ok):
            raise refusal()
        return
    if torch.compiler.is_compiling():
        if KEPT_IN_GRAPH:
            torch.ops.primus_ext.refuse_unless(ok, refusal_id(why, refusal))
        else:
            torch._assert_async(ok, why)
        return
    try:
        torch._assert_async(ok, why)
    except RuntimeError:  # CPU: the assertion fails at once
        raise refusal() from None


def check_same_boundaries(cu_q: Tensor, cu_kv: Tensor, refusal: Callable[[], PrimusExtError],
                          why: str = "primus_ext: cu_seqlens_q and cu_seqlens_kv differ") -> None:
    """Refuse a packed call whose q and kv documents differ where the path aligns masks other
    than the caller asked for (bottom-right vs top-left inside each document).

    One tensor for both sides (Megatron's case) is never read; two distinct tensors are
    compared on the host, or on device inside a compiled graph (where their storage is no value
    Dynamo can compare: two views of one memory are compared by value there too), failing there
    with ``why`` (one text per call site: it keys the refusal the graph raises).
    """
    if cu_q is cu_kv:
        return
    if torch.compiler.is_compiling():
        if cu_q.shape != cu_kv.shape:
            raise refusal()
        assert_on_device((cu_q == cu_kv.to(cu_q.device)).all(), why, refusal)  # refusal() raises while traced
        return
    if same_tensor(cu_q, cu_kv):
        return
    if cu_q.shape != cu_kv.shape or not torch.equal(cu_q, cu_kv.to(cu_q.device)):
        raise refusal()


def tensor_version(t: Tensor) -> Optional[int]:
    """``t``'s in-place version counter, or None for an inference tensor, which has none (its
    values are then checked at every call: there is no way to know they did not change)."""
    try:
        return t._version
    except RuntimeError:
        return None

__all__ = ["DEFERRED", "KEPT_IN_GRAPH", "assert_on_device", "check_same_boundaries", "refusal_id", "refuse_unless", "tensor_version"]
