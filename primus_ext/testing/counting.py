"""Count the tensor copies and host syncs a piece of code performs.

Attention wrappers are supposed to be thin: no copy the layout does not need and no
read of device data to the host (which stalls the GPU stream).  Timings on a CPU say
little about either; counting the operators that reach torch's dispatcher does, and
gives the same exact numbers on every machine::

    from primus_ext.testing.counting import count_copies_and_syncs, as_kernel

    with count_copies_and_syncs() as counts:
        out = attention(q, k, v, causal=True)
    assert counts.syncs == 0, counts.events

What is counted (eager mode; under ``torch.compile`` the graph is what it is):

* a *copy* is one of ``aten.copy_``, ``aten.clone`` (``Tensor.contiguous()`` on a
  non-contiguous tensor and ``reshape`` of a non-viewable layout dispatch it) and
  ``aten._to_copy`` (a dtype or device change, e.g. ``.float()`` of a bf16 tensor);
* a *host sync* is a read of tensor data by the host: ``aten._local_scalar_dense``
  (``item()``, ``int(t)``, ``bool(t)``), ``aten.equal``, ``aten.is_nonzero``, ops whose
  output shape depends on the data (``nonzero``, ``masked_select``, ``unique``), a copy
  from an accelerator to the CPU, and ``Tensor.tolist()`` / ``Tensor.numpy()``.  The
  last two dispatch nothing for a CPU tensor, so they are caught one level up, by a
  ``TorchFunctionMode``; on a GPU the same line would be a device-to-host copy.

Ops run by a kernel are often not the caller's to remove (the CPU fake of
Primus-Turbo, for example, copies ``cu_seqlens`` to the host exactly as the real
flex layer does).  Wrap such callables with `as_kernel`, or run them inside
``counts.kernel()``: their ops are then counted separately, as ``kernel_copies`` /
``kernel_syncs``, and ``copies`` / ``syncs`` hold only the caller's share.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, TypeVar

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

COPY_OPS = frozenset({aten.copy_.default, aten.clone.default, aten._to_copy.default})
"""Operator overloads counted as copies."""

SYNC_OPS = frozenset({
    aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default,
    aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
    aten.unique_consecutive.default,
})
"""Operator overloads counted as host syncs on any device."""

HOST_READ_METHODS = (torch.Tensor.tolist, torch.Tensor.numpy)
"""Tensor methods that read data on the host and dispatch nothing for CPU tensors."""

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Event:
    """One counted operation: ``kind`` is ``copy`` or ``sync``; ``kernel`` tells whose it was."""

    kind: str
    op: str
    kernel: bool


def _device_to_host(func: Any, args: tuple, kwargs: dict) -> bool:
    """True for a copy that moves data from an accelerator to the CPU (a sync there too)."""
    if func is aten._to_copy.default:
        src, dst = args[0], kwargs.get("device")
        return isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst is not None \
            and torch.device(dst).type == "cpu"
    if func is aten.copy_.default:
        dst, src = args[0], args[1]
        return isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst.device.type == "cpu"
    return False


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: "CopySyncCounter") -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = self.owner
        if not owner._quiet:
            if func in COPY_OPS:
                owner._record("copy", str(func))
                if _device_to_host(func, args, kwargs):
                    owner._record("sync", str(func))
            elif func in SYNC_OPS:
                owner._record("sync", str(func))
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, owner: "CopySyncCounter") -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = self.owner
        if func in HOST_READ_METHODS and not owner._quiet:
            owner._record("sync", f"Tensor.{func.__name__}")
            owner._quiet += 1  # its own device-to-host copy is the same sync
            try:
                return func(*args, **kwargs)
            finally:
                owner._quiet -= 1
        return func(*args, **kwargs)


_ACTIVE: list["CopySyncCounter"] = []


class CopySyncCounter:
    """Counts copies and host syncs while active (a context manager, reusable once)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._kernel_depth = 0
        self._quiet = 0
        self._stack: Optional[contextlib.ExitStack] = None

    # -- results -------------------------------------------------------------
    def _count(self, kind: str, kernel: bool) -> int:
        return sum(1 for e in self.events if e.kind == kind and e.kernel == kernel)

    @property
    def copies(self) -> int:
        """Copies outside kernels (the caller's share)."""
        return self._count("copy", False)

    @property
    def syncs(self) -> int:
        """Host syncs outside kernels (the caller's share)."""
        return self._count("sync", False)

    @property
    def kernel_copies(self) -> int:
        return self._count("copy", True)

    @property
    def kernel_syncs(self) -> int:
        return self._count("sync", True)

    def by_op(self, kind: Optional[str] = None, *, kernel: Optional[bool] = False) -> Counter:
        """``Counter`` of operator names; ``kernel=None`` merges both shares."""
        return Counter(e.op for e in self.events
                       if (kind is None or e.kind == kind) and (kernel is None or e.kernel == kernel))

    def summary(self) -> dict[str, Any]:
        return {"copies": self.copies, "syncs": self.syncs, "kernel_copies": self.kernel_copies,
                "kernel_syncs": self.kernel_syncs, "copy_ops": dict(self.by_op("copy")),
                "sync_ops": dict(self.by_op("sync")), "kernel_copy_ops": dict(self.by_op("copy", kernel=True)),
                "kernel_sync_ops": dict(self.by_op("sync", kernel=True))}

    def reset(self) -> None:
        self.events.clear()

    # -- attribution -----------------------------------------------------------
    @contextlib.contextmanager
    def kernel(self) -> Iterator[None]:
        """Ops run inside this block are the kernel's, counted apart from the caller's."""
        self._kernel_depth += 1
        try:
            yield
        finally:
            self._kernel_depth -= 1

    def _record(self, kind: str, op: str) -> None:
        self.events.append(Event(kind, op, self._kernel_depth > 0))

    # -- context manager -------------------------------------------------------
    def __enter__(self) -> "CopySyncCounter":
        stack = contextlib.ExitStack()
        stack.enter_context(_Function(self))
        stack.enter_context(_Dispatch(self))
        self._stack = stack
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.remove(self)
        stack, self._stack = self._stack, None
        assert stack is not None
        stack.close()


def count_copies_and_syncs() -> CopySyncCounter:
    """A fresh `CopySyncCounter`; use it as ``with count_copies_and_syncs() as counts:``."""
    return CopySyncCounter()


def as_kernel(fn: F) -> F:
    """``fn`` whose ops count as a kernel's in every active counter.

    The wrapper keeps ``fn``'s name and signature (``inspect.signature`` sees the
    original parameters), so code that chooses keywords by signature treats it as
    ``fn`` itself.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with contextlib.ExitStack() as stack:
            for counter in list(_ACTIVE):
                stack.enter_context(counter.kernel())
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


@contextlib.contextmanager
def kernels_attributed(*namespaces: Any, names: Optional[tuple[str, ...]] = None) -> Iterator[None]:
    """Wrap the public callables of ``namespaces`` (modules or objects) with `as_kernel`.

    ``names`` limits which attributes; by default every public callable is wrapped.
    The originals are put back on exit.  Do this *before* building code that binds
    the callables (e.g. a backend that stores ``ops.flash_attn_func`` at construction).
    """
    saved: list[tuple[Any, str, Any, bool]] = []
    try:
        for ns in namespaces:
            for name in names or tuple(n for n in dir(ns) if not n.startswith("_")):
                value = getattr(ns, name, None)
                if callable(value) and not isinstance(value, type):
                    own = name in getattr(ns, "__dict__", {})  # else a class attribute (a method)
                    saved.append((ns, name, value, own))
                    setattr(ns, name, as_kernel(value))
        yield
    finally:
        for ns, name, value, own in reversed(saved):
            if own:
                setattr(ns, name, value)
            else:
                delattr(ns, name)


__all__ = ["COPY_OPS", "CopySyncCounter", "Event", "HOST_READ_METHODS", "SYNC_OPS", "as_kernel",
           "count_copies_and_syncs", "kernels_attributed"]
