"""No-op Primus-Turbo entries with the real signatures, for measuring our own Python.

`stubbed_turbo()` installs the CPU fake of Primus-Turbo (so ``import primus_turbo``
works and the ``turbo`` backend is selected) and then replaces its attention entries
with functions that bind their arguments exactly like the real Python entries do
(same parameter list, generated from the fake's signatures) and return a
preallocated tensor.  What remains of a call is the caller's Python: the adapter's
checks and routing, or nothing at all for a direct call.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

import torch

from primus_ext.testing import fake_primus_turbo
from primus_ext.testing.fake_turbo import entry_signatures


class Outputs:
    """The tensors the stubs return: one dense (bshd) and one packed (thd) output."""

    def __init__(self) -> None:
        self.dense: Any = None
        self.packed: Any = None


def make_stub(name: str, signature: Any, outputs: Outputs) -> Any:
    """A function named ``name`` with ``signature`` that returns a preallocated output."""
    which = "packed" if "varlen" in name else "dense"
    namespace: dict[str, Any] = {"_outputs": outputs}
    exec(f"def {name}{signature}:\n    return _outputs.{which}\n", namespace)  # noqa: S102 - fixed text
    return namespace[name]


@contextlib.contextmanager
def stubbed_turbo(**build: Any) -> Iterator[tuple[Any, Outputs]]:
    """``(ops_module, outputs)``: the fake Primus-Turbo with no-op entries.

    Set ``outputs.dense`` / ``outputs.packed`` to the tensors the kernels should return.
    """
    outputs = Outputs()
    with fake_primus_turbo(**build) as fake:
        ops = sys.modules["primus_turbo.pytorch.ops"]
        for name, signature in entry_signatures(fake.options).items():
            if name == "create_block_mask":
                continue
            stub = make_stub(name, signature, outputs)
            setattr(ops, name, stub)
            setattr(fake.module, name, stub)
        yield ops, outputs


def dense_inputs(batch: int = 2, seq: int = 1024, heads: int = 8, kv_heads: int = 2, dim: int = 128,
                 dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, seq, heads, dim, generator=gen).to(dtype)
    k = torch.randn(batch, seq, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(batch, seq, kv_heads, dim, generator=gen).to(dtype)
    return q, k, v
