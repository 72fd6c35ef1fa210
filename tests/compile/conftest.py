"""Fixtures for the torch.compile tests: the gloo world of the Megatron tests, and a clean Dynamo."""

from __future__ import annotations

import pytest
import torch

from tests.megatron.conftest import megatron_world  # noqa: F401  (session-wide gloo world + parallel state)


@pytest.fixture(autouse=True)
def fresh_state():
    """Every test starts and ends with empty Dynamo caches and counters, and leaves the
    process-wide BlockMask cache empty.

    Compiled closures defined in different tests share code objects, so without a
    reset one test's compilations would count as another's recompiles.  The Megatron
    modules share one BlockMask cache per process; later test modules assert on its
    contents, so the masks built here must not outlive the test.
    """
    from primus_ext.attention.block_mask_cache import shared_block_mask_cache

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    shared_block_mask_cache().clear()
