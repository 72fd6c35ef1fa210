"""A single-process gloo world with megatron-core's parallel state, for CPU model tests."""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_ranks(run_rank: Callable[..., None], nprocs: int, out_dir: Path) -> list[Any]:
    """Run ``run_rank(rank, port, out_dir)`` in ``nprocs`` gloo processes; each saves
    ``rank{rank}.pt`` there, and the records come back in rank order."""
    for attempt in range(2):  # the free port may be taken between probing and binding: retry that only
        try:
            mp.spawn(run_rank, args=(free_port(), str(out_dir)), nprocs=nprocs, join=True)
            break
        except mp.ProcessRaisedException as exc:
            if attempt or "address already in use" not in str(exc).lower():
                raise
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(nprocs)]


@contextlib.contextmanager
def gloo_world(rank: int, port: int, world_size: int, *, tp: int = 1, cp: int = 1,
               timeout_s: Optional[int] = None) -> Iterator[Any]:
    """A spawned rank's gloo group and megatron-core's parallel state at ``tp`` x ``cp``, torn down after;
    yields ``parallel_state``."""
    import warnings

    from megatron.core import parallel_state

    warnings.simplefilter("ignore")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    timeout = {} if timeout_s is None else dict(timeout=datetime.timedelta(seconds=timeout_s))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size, **timeout)
    try:
        parallel_state.initialize_model_parallel(tp, 1, context_parallel_size=cp)
        yield parallel_state
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


class FakeGroup:
    """What megatron-core and the layers ask of a process group without a world: its size and this rank."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.fixture(scope="session", autouse=True)
def megatron_world():
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(free_port())
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    yield


@pytest.fixture(autouse=True)
def primus_container(request) -> Iterator[None]:
    """Primus's ROCm container holds Primus-Turbo, and Primus installs its spec provider only where
    ``primus_turbo`` imports: the Primus tests (modules ``test_primus_*``) run with the CPU fake
    installed.  A test of the environment without it uses the ``no_primus_turbo`` marker."""
    name = request.module.__name__.rsplit(".", 1)[-1]
    if not name.startswith("test_primus_") or request.node.get_closest_marker("no_primus_turbo"):
        yield
        return
    from primus_ext.testing import fake_primus_turbo

    with fake_primus_turbo():
        yield


@pytest.fixture
def seeded_rng_tracker() -> Iterator[None]:
    """megatron-core's RNG tracker seeded as Megatron's initialisation seeds it (over CPU generators)."""
    from primus_ext.testing.cpu_rng import seed_model_parallel, unseed_model_parallel

    seed_model_parallel(1234)
    try:
        yield
    finally:
        unseed_model_parallel()
