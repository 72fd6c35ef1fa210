"""Every hook compiles on every backend: the docs' hooks, attn-gym's and torchtitan's factories, the project's
hook examples and its mask library, on ``reference``, ``flex`` and ``turbo`` (the CPU fake at gfx942 and
gfx950), under ``torch.compile(fullgraph=True)`` with ``aot_eager`` and ``inductor``.

For each (hook, backend) the layer builds, or is refused at build with our error (a hook a backend does not run:
turbo takes proven hooks only, flex no dynamic ones).  A built layer, compiled, equals the same layer eager,
forward and (where the CPU has a backward: not torch's flex_attention) backward; it compiles to one graph
(``fullgraph``: 0 graph breaks, counted) and 20 in-place changes of what its hook captures (or 20 document
splits of a packed call) cost at most one recompile, with the output following each change.  On turbo a
captured value a proof rested on that changes is refused at the compiled call, when the graph runs.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import pytest
import torch
from torch._dynamo.backends.debugging import aot_eager
from torch._inductor.compile_fx import compile_fx

from primus_ext.call.adapter import TurboFlexAttention
from primus_ext.errors import UnsupportedConfigError, UnsupportedInputError
from primus_ext.plan import LayerFacts, build_plan
from primus_ext.settings import TurboAttentionSettings
from primus_ext.testing import fake_primus_turbo

from .. import doc_hooks, flex_hooks, third_party_hooks

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

B, S, HQ, HKV, D = 2, 16, 4, 2, 16
DOCS = "tests.doc_hooks:"
GYM = "tests.third_party_hooks:"
LIB = "primus_ext.attention.masks:"
EXAMPLES = "tests.hook_examples:"

# (kind, "module:attr", factory kwargs or None)
HOOKS = [
    ("mask", DOCS + "window", None), ("mask", DOCS + "sliding", None), ("mask", DOCS + "typed", None),
    ("mask", DOCS + "guarded", None), ("mask", DOCS + "env", None), ("mask", DOCS + "aliased", None),
    ("mask", DOCS + "nested", None), ("score", DOCS + "alibi", None), ("mask", DOCS + "banded", {"width": 3}),
    ("score", EXAMPLES + "alibi", None), ("score", EXAMPLES + "symmetric_alibi", None),
    ("score", EXAMPLES + "softcap", None),
    ("mask", GYM + "gym_causal", {}), ("mask", GYM + "gym_sliding_window", {"window_size": 4}),
    ("mask", GYM + "gym_prefix_lm", {"prefix_length": 4}),
    ("mask", GYM + "gym_dilated_sliding_window", {"window_size": 4, "dilation": 2}),
    ("mask", GYM + "gym_global_sliding_window", {"window_size": 4}), ("score", GYM + "gym_alibi", {"num_heads": HQ}),
    ("score", GYM + "gym_softcap", {"soft_cap": 20}), ("mask", GYM + "titan_causal", {}),
    ("mask", GYM + "titan_sliding_window", {"window_size": 4}), ("mask", GYM + "titan_fixed_block", {"fixed_block_size": 4}),
    ("mask", GYM + "titan_document", {}),
    ("mask", GYM + "titan_sliding_window_and_blocks", {"window_size": 4, "fixed_block_size": 8}),
    ("mask", LIB + "causal", {}), ("mask", LIB + "full", {}), ("mask", LIB + "sliding_window", {"left": 4}),
    ("mask", LIB + "prefix_lm", {"prefix_length": 4}), ("mask", LIB + "chunked", {"chunk_size": 4}),
    ("mask", LIB + "packed_documents", {"cu_seqlens": [0, 6, 16]}),
    ("mask", "tests.flex_hooks:document_ids", None), ("mask", "tests.flex_hooks:per_head", None),
    ("score", "tests.flex_hooks:head_bias", None),
]
BACKENDS = ["reference", "flex", "turbo-gfx942", "turbo-gfx950"]
COMPILERS = {"aot_eager": aot_eager, "inductor": compile_fx}

CAPTURED = {DOCS + "alibi": lambda: doc_hooks.SLOPES, GYM + "titan_document": lambda: third_party_hooks.POSITIONS,
            "tests.flex_hooks:document_ids": lambda: flex_hooks.DOC_IDS,
            "tests.flex_hooks:head_bias": lambda: flex_hooks.HEAD_BIAS}
"""The tensor each of these hooks captures (changed in place between compiled calls)."""


class Counted:
    """A compiler backend that counts the graphs it is given (one per compile; a graph break makes two)."""

    def __init__(self, name: str) -> None:
        self.compile, self.graphs = COMPILERS[name], 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.graphs += 1
        return self.compile(gm, example_inputs)


def _layer(kind: str, spec: str, kwargs: Optional[dict], backend: str) -> TurboFlexAttention:
    name, _, arch = backend.partition("-")
    keys = {"use_turbo_attention": True, "use_turbo_flex_attention": True, "turbo_flex_attention_backend": name,
            f"turbo_flex_attention_{kind}_mod": spec, f"turbo_flex_attention_{kind}_mod_kwargs": kwargs}
    if arch:
        keys["turbo_arch"] = arch
    facts = LayerFacts(num_heads=HQ, num_kv_heads=HKV, head_dim=D, seq_length=S, dtype="bf16" if arch else "fp32")
    return TurboFlexAttention(build_plan(TurboAttentionSettings.from_dict(keys), facts))


def _installed(backend: str):
    arch = backend.partition("-")[2]
    return fake_primus_turbo(arch=arch) if arch else contextlib.nullcontext()


def _inputs(backend: str, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if backend.startswith("turbo") else torch.float32
    grad = backend != "flex"  # torch's flex_attention has no CPU backward
    return [torch.randn(B, S, h, D, generator=gen).to(dtype).requires_grad_(grad) for h in (HQ, HKV, HKV)]


def _step(fn, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The output and, where the inputs want them, their gradients for a fixed upstream gradient."""
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    if not leaves[0].requires_grad:
        with torch.no_grad():
            return [fn(*leaves)]
    out = fn(*leaves)
    grad = torch.linspace(-1, 1, out.numel()).view(out.shape).to(out.dtype)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad)]


def _assert_equal(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for g, w, name in zip(got, want, ("out", "dq", "dk", "dv")):
        tol = dict(rtol=2e-2, atol=2e-2) if g.dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g, w, **tol, msg=lambda m: f"{what}: {name}: {m}")


BUILT: dict[str, set] = {}


@pytest.mark.parametrize("compiler", list(COMPILERS))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,spec,kwargs", HOOKS, ids=[h[1].partition(":")[2] for h in HOOKS])
def test_every_hook_compiles_to_one_graph_equal_to_eager(kind, spec, kwargs, backend, compiler):
    with _installed(backend):
        try:
            layer = _layer(kind, spec, kwargs, backend)
        except UnsupportedConfigError as err:  # a hook this backend does not run: refused at build, ours
            assert err.settings, err
            return
        BUILT.setdefault(backend, set()).add(spec)
        inputs = _inputs(backend)
        want = _step(layer, inputs)
        torch._dynamo.reset()
        counted = Counted(compiler)
        compiled = torch.compile(lambda q, k, v: layer(q, k, v), fullgraph=True, backend=counted)
        _assert_equal(_step(compiled, inputs), want, f"{spec} on {backend} with {compiler}")
        assert counted.graphs == 1, f"{counted.graphs} graphs: a graph break or a recompile"
        captured = CAPTURED.get(spec)
        if captured is None:
            return
        table = captured()
        saved = table.clone()
        try:
            for i in range(20):  # the data loader (or an optimizer) writes new values between steps
                with torch.no_grad():
                    table.copy_(saved.roll(i + 1) if table.dtype != torch.float32 else saved * (1 + 0.1 * (i + 1)))
                if backend.startswith("turbo"):  # the proof rested on the old values: refused when the graph runs
                    with pytest.raises(UnsupportedInputError, match="B31"):
                        compiled(*inputs)
                    return
                _assert_equal(_step(compiled, inputs), _step(layer, inputs), f"{spec} after change {i + 1}")
            assert counted.graphs <= 2, f"{counted.graphs - 1} recompiles over 20 changes of a captured tensor"
        finally:
            with torch.no_grad():
                table.copy_(saved)


def test_the_matrix_built_what_each_backend_runs():
    """Run after the matrix: reference built every hook that runs as torch calls it, turbo the proven ones."""
    if not BUILT:
        pytest.skip("the matrix did not run in this session")
    assert len(BUILT["reference"]) >= len(HOOKS) - 1  # doc_hooks.nested returns no mask where torch calls it
    for arch in ("turbo-gfx942", "turbo-gfx950"):
        assert {DOCS + "window", DOCS + "sliding", DOCS + "alibi", GYM + "gym_causal", LIB + "causal"} <= BUILT[arch]
    assert DOCS + "typed" not in BUILT["flex"] and DOCS + "window" in BUILT["flex"]


@pytest.mark.parametrize("compiler", list(COMPILERS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_twenty_document_splits_of_a_packed_call_compile_once(backend, compiler):
    keys = {"use_turbo_attention": True, "use_turbo_flex_attention": True,
            "turbo_flex_attention_backend": backend.partition("-")[0]}
    arch = backend.partition("-")[2]
    if arch:
        keys["turbo_arch"] = arch
    tokens = 48
    with _installed(backend):
        layer = TurboFlexAttention(build_plan(TurboAttentionSettings.from_dict(keys), LayerFacts(
            num_heads=HQ, num_kv_heads=HKV, head_dim=D, seq_length=tokens, dtype="bf16" if arch else "fp32",
            packed=True)))
        gen = torch.Generator().manual_seed(1)
        dtype = torch.bfloat16 if arch else torch.float32
        q, k, v = (torch.randn(tokens, h, D, generator=gen).to(dtype) for h in (HQ, HKV, HKV))
        torch._dynamo.reset()
        counted = Counted(compiler)
        compiled = torch.compile(lambda q, k, v, cu: layer.varlen(q, k, v, cu, cu, None, None), fullgraph=True,
                                 backend=counted)
        for docs in range(1, 21):
            cuts = sorted(torch.randperm(tokens - 1, generator=gen)[: docs - 1].add(1).tolist())
            cu = torch.tensor([0, *cuts, tokens], dtype=torch.int32)
            with torch.no_grad():
                _assert_equal([compiled(q, k, v, cu)], [layer.varlen(q, k, v, cu, cu, None, None)], f"{docs} docs")
        assert counted.graphs <= 2, f"{counted.graphs - 1} recompiles over 20 document splits"
