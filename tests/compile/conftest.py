"""Fixtures for the torch.compile tests: the gloo world of the Megatron tests, and a clean Dynamo."""

from __future__ import annotations

import pytest
import torch

from tests.megatron.conftest import megatron_world  # noqa: F401  (session-wide gloo world + parallel state)


@pytest.fixture(autouse=True)
def fresh_state():
    """Every test starts and ends with empty Dynamo caches and counters.

    Compiled closures defined in different tests share code objects, so without a
    reset one test's compilations would count as another's recompiles.
    """
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
