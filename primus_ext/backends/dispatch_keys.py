"""Autograd's dispatch keys, lifted inside a custom op's implementation.

A ``torch.library`` custom op runs its implementation below the Autograd dispatch keys (they are in
the thread-local exclude set).  Two things need them back there: a backward op that differentiates a
recompute of the forward (`primus_ext.call.ops`), and torch's FlexAttention, whose ``vmap`` over a hook
turns ``tensor[index]`` into an ``autograd.Function`` that has no kernel below Autograd.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def autograd_keys_lifted() -> Iterator[None]:
    """Run the block with the dispatch keys an op implementation runs below (Autograd's; at a compiled
    graph's run also functorch's and the wrappers') back in force, as in eager code; Autocast stays
    excluded and grad mode is left as it is.  The inputs there are plain tensors, so nothing the lifted
    keys handle reaches them unasked."""
    exclude = torch._C._dispatch_tls_local_exclude_set() - _LIFTED
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
        yield


def _lifted() -> "torch._C.DispatchKeySet":
    """Every dispatch key but Autocast's, as one set (built once: the op's forward lifts it at every call)."""
    keys = None
    for name, key in torch._C.DispatchKey.__members__.items():
        if name.startswith("Autocast") or name == "Undefined":
            continue
        try:
            one = torch._C.DispatchKeySet(key)
        except RuntimeError:  # an alias or marker key, never in a thread-local set
            continue
        keys = one if keys is None else keys | one
    return keys


_LIFTED = _lifted()

__all__ = ["autograd_keys_lifted"]
