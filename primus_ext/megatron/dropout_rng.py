"""Attention dropout drawn as megatron-core draws it: from the model-parallel RNG tracker.

Megatron seeds the default generator alike on every tensor-parallel rank, and gives each
tensor-parallel rank a generator of its own in ``tensor_parallel.get_cuda_rng_tracker()``
(``model_parallel_cuda_manual_seed``: ``seed + 2718 + tp_rank``).  Its ``DotProductAttention``
drops attention probabilities inside ``tracker.fork()``, and TransformerEngine's attention forks
the tracker whenever it is initialised; so do these layers, around the kernel call (the backward
op replays the forward's generator state, `primus_ext.call.op_rng`, so it draws the same mask).

Context parallelism runs as Ulysses: after the all-to-all each context-parallel rank holds its
own heads of the whole sequence, but the tracker gives the context-parallel ranks of one
tensor-parallel rank one seed.  So under the fork this rank draws one number from the tracker
(the same draw on those ranks, and the tracker moves on as it would for any dropout) and runs
the kernel under a generator seeded from that number and its context-parallel rank: every
global head drops its own positions, and a run is reproducible from Megatron's seeds.

Under ``torch.compile`` the fork (a host-side swap of generator states) cannot be traced: a
compiled training call with dropout draws from the default generator where the layer is alone
(tensor and context parallel size 1), and is refused otherwise (``B30.compiled``).
Without a seeded tracker, a layer with dropout at tensor or context parallel size > 1 is
refused when it is built (plan rule ``B30-rng``): its ranks would draw alike.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch

from .. import refusals as R

_MIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9)  # odd 64-bit constants: distinct ranks, distinct seeds


def model_parallel_tracker() -> Optional[Any]:
    """megatron-core's RNG tracker, where its model-parallel state has been added (else None).

    ``is_initialized()`` alone is not enough: ``add`` sets it before it reads the CUDA state,
    so a failed ``model_parallel_cuda_manual_seed`` (no CUDA) leaves a tracker without states."""
    try:
        from megatron.core.tensor_parallel import random as mrandom
    except ImportError:  # megatron-core absent: nothing to fork
        return None
    tracker = mrandom.get_cuda_rng_tracker()
    name = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME
    return tracker if tracker.is_initialized() and name in tracker.get_states() else None


class LayerDropoutRng:
    """Where one layer's dropout draws from: the tracker's model-parallel generator (where seeded), and
    under context parallelism one of its own per context-parallel rank."""

    def __init__(self, ranks: int, cp_rank: int, cp_size: int) -> None:
        self.ranks, self.cp_rank, self.cp_size = ranks, cp_rank, cp_size

    @contextlib.contextmanager
    def drawing(self, dropout_p: float, device: torch.device) -> Iterator[None]:
        """The block (this call's kernel) under the generator its dropout draws from."""
        if dropout_p > 0.0 and torch.compiler.is_compiling():
            if self.ranks > 1:  # the tracker's fork cannot be traced; the default generator is alike on the ranks
                raise R.refuse(R.DROPOUT_COMPILED, "Megatron core attention", dropout=dropout_p, ranks=self.ranks)
            yield  # one rank: the default generator is this run's own (it is traced into the op's state)
            return
        tracker = model_parallel_tracker() if dropout_p > 0.0 else None  # per call: it may be reseeded anew
        if tracker is None:
            if dropout_p > 0.0 and self.ranks > 1:  # seeded at build (B30-rng), reset since
                raise R.refuse(R.DROPOUT_TRACKER_GONE, "Megatron core attention", dropout=dropout_p,
                               ranks=self.ranks)
            yield
            return
        from megatron.core.tensor_parallel import random as mrandom

        with tracker.fork(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if self.cp_size == 1:
                yield
                return
            seed = _rank_seed(_draw(device), self.cp_rank)
            devices = [device] if device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices, device_type="cuda"):
                _generator(device).manual_seed(seed)
                yield


def _draw(device: torch.device) -> int:
    """One number from the forked generator of ``device``, with no host sync: on a GPU its Philox
    seed and offset (the offset then moves on, as a kernel's draw moves it), on CPU one draw."""
    if device.type == "cuda":
        gen = _generator(device)
        offset = gen.get_offset()
        gen.set_offset(offset + 4)  # Philox offsets advance in fours
        return (gen.initial_seed() * _MIX[0] + offset) % 2 ** 63
    return int(torch.randint(0, 2 ** 62, (1,)).item())


def _rank_seed(drawn: int, cp_rank: int) -> int:
    return (drawn * _MIX[1] + (cp_rank + 1) * _MIX[0]) % 2 ** 63


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else
                                             torch.cuda.current_device()]
    return torch.default_generator


__all__ = ["LayerDropoutRng", "model_parallel_tracker"]
