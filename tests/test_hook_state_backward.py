"""What a hook reads may not change between a call's forward and its backward (B34.hook-changed).

``reference`` and ``flex`` evaluate a user hook at the forward and again at the backward (the blockwise
backward, flex_attention's backward kernel, a compiled backward op's recompute).  Under pipeline parallelism a
data loader writes the next micro-batch's document ids before the previous micro-batch's backward: the gradient
would then be another attention's (dq off by 26.8, found by a hostile review).  So the forward's view of what
the hooks read is kept, and the backward refuses if it changed, eager and compiled; unchanged, the gradients are
the float64 oracle's.  (``turbo`` never calls a proven hook; its proofs' assumptions are re-checked per call.)
"""

from __future__ import annotations

import sys

import pytest
import torch

import primus_ext.call.adapter as adapter_module
from primus_ext.backends import make_backend
from primus_ext.backends.flex import FlexBackend
from primus_ext.errors import UnsupportedInputError

from . import hook_state_hooks as H
from .flex_standin import flex_standin
from .fuzz import oracle
from .helpers import adapter, facts, qkv, settings

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
CHANGES = {
    "a captured tensor written in place": lambda: H.DOC.copy_(torch.zeros(16, dtype=torch.long)),
    "a module global rebound": lambda: setattr(H, "WIDTH", 7),
    "a captured table scaled": lambda: H.SLOPES.mul_(3),
}
HOOKS = {"a captured tensor written in place": ("mask", "documents"), "a module global rebound": ("mask", "banded"),
         "a captured table scaled": ("score", "learned_free_alibi")}


@pytest.fixture
def restored():
    saved = H.DOC.clone(), H.WIDTH, H.SLOPES.clone()
    yield
    H.DOC.copy_(saved[0])
    H.WIDTH = saved[1]
    H.SLOPES.copy_(saved[2])


@pytest.fixture
def standin(monkeypatch):
    monkeypatch.setattr(adapter_module, "make_backend",
                        lambda name: FlexBackend(kernel=flex_standin) if name == "flex" else make_backend(name))


def _layer(backend: str, change: str):
    kind, name = HOOKS[change]
    return adapter(settings(turbo_flex_attention_backend=backend,
                            **{f"turbo_flex_attention_{kind}_mod": f"tests.hook_state_hooks:{name}"}), facts())


def _run(layer, compiled):
    if compiled is None:
        return layer
    torch._dynamo.reset()
    return torch.compile(lambda q, k, v: layer(q, k, v), fullgraph=True, backend=compiled)


@pytest.mark.parametrize("compiled", [None, "aot_eager", "inductor"])
@pytest.mark.parametrize("backend", ["reference", "flex"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_between_forward_and_backward_is_refused(change, backend, compiled, restored, standin):
    layer = _layer(backend, change)
    q, k, v = qkv(grad=True)
    out = _run(layer, compiled)(q, k, v)
    CHANGES[change]()  # the next micro-batch's loader, before this one's backward
    with pytest.raises(UnsupportedInputError) as err:
        out.sum().backward()
    assert err.value.codes == ("B34.hook-changed",)


@pytest.mark.parametrize("compiled", [None, "aot_eager"])
@pytest.mark.parametrize("backend", ["reference", "flex"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_unchanged_the_gradients_are_the_oracles_and_a_change_after_the_backward_is_the_next_steps(
        change, backend, compiled, restored, standin):
    layer = _layer(backend, change)
    kind, name = HOOKS[change]
    for step in range(2):
        q, k, v = qkv(grad=True, seed=step)
        out = _run(layer, compiled)(q, k, v)
        out.backward(torch.ones_like(out))
        refs = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        hook = getattr(H, name)
        mask = oracle.hook_mask(hook, 2, 4, 16, 16) if kind == "mask" else oracle.flash_mask(
            16, 16, causal=True, window=(-1, -1), align="top_left")
        want, _ = oracle.attention(*refs, mask, score_fn=hook if kind == "score" else None)
        want.backward(torch.ones_like(want))
        for got, ref in zip((q, k, v), refs):
            torch.testing.assert_close(got.grad, ref.grad, rtol=1e-7, atol=1e-7)
        CHANGES[change]()  # after the backward: the next step reads the new values


def test_a_compiled_forward_without_a_backward_keeps_no_hook_state(restored):
    """The stamp a compiled forward keeps for its backward (small captured tensors copied) goes with the
    forward's rng_state: inference calls keep nothing, and a step's entries go with its backward."""
    from primus_ext.call.ops import FORWARD_STATES

    layer = _layer("reference", "a captured tensor written in place")
    compiled = _run(layer, "aot_eager")
    before = len(FORWARD_STATES)
    with torch.no_grad():
        for _ in range(5):
            compiled(*qkv())
    assert len(FORWARD_STATES) == before
    q, k, v = qkv(grad=True)
    out = compiled(q, k, v)
    out.sum().backward()
    del out
    assert len(FORWARD_STATES) == before
