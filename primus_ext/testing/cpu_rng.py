"""megatron-core's RNG tracker on a machine without CUDA, for tests of dropout under TP and CP.

``model_parallel_cuda_manual_seed`` seeds CUDA generators, which a CPU build has not; the
tracker class below keeps CPU generator states instead and forks the CPU default generator
(where the CPU kernels draw), and is otherwise megatron-core's own ``CudaRNGStatesTracker``.
`seed_model_parallel` installs it and then calls megatron-core's own seeding, so the seeds
are megatron's (``seed + 2718 + tp_rank`` for the model-parallel state).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def _tracker_class() -> type:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """megatron-core's tracker over CPU generator states."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_ or name in self.states_:
                raise ValueError(f"rng state {name} (seed {seed}) already added")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise ValueError(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CpuRNGStatesTracker


def seed_model_parallel(seed: int) -> None:
    """megatron-core's ``model_parallel_cuda_manual_seed(seed)`` with a CPU tracker (after its parallel state)."""
    from megatron.core.tensor_parallel import random as mrandom

    if type(mrandom._CUDA_RNG_STATE_TRACKER).__name__ != "CpuRNGStatesTracker":  # reseeding keeps the tracker
        mrandom._CUDA_RNG_STATE_TRACKER = _tracker_class()()
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mrandom.model_parallel_cuda_manual_seed(seed)


def unseed_model_parallel() -> None:
    """Back to no tracker (megatron-core makes a fresh, unseeded one on the next request)."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.initialize_rng_tracker(force_reset=True)


__all__ = ["seed_model_parallel", "unseed_model_parallel"]
