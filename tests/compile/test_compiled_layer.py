"""A real megatron-core block stack with Turbo core attention under ``torch.compile``.

The model is megatron-core's own ``TransformerBlock`` of two GPT layers built from
`get_gpt_layer_primus_turbo_local_spec` (learned sinks, a causal window on one layer
and full causal attention on the other), on three paths: flex with the reference
backend, flex with the turbo backend over the CPU fake of Primus-Turbo, and the direct
path (``use_turbo_flex_attention: false``, also over the fake).  Each is compiled with
``fullgraph=True`` and the ``aot_eager`` backend, dense (sbhd) and packed (thd).

What is proved, per path and layout:

* with megatron-core untouched: our core-attention module alone compiles with
  ``fullgraph=True``, and every graph break in megatron-core's attention module is one
  of megatron-core's own (none has a frame in primus_ext);
* with megatron-core's own blocker worked around (below), ``torch._dynamo.explain``
  reports 0 graph breaks for the block and the compiled block's outputs and gradients
  (input, weights, sink) match eager, also with attention dropout;
* the attention call is the ``primus_ext`` custom op in the compiled forward graph and
  its backward op in the compiled backward graph, and the (fake) Turbo kernels run;
* 20 packed micro-batches of 48 tokens with 1 to 8 documents of varying lengths cost
  at most one recompile after the first compile;
* under selective activation checkpointing with `selective_checkpoint_context`, the
  attention op runs once per layer per training step; plain checkpointing runs it twice.

megatron-core 0.16.1 limitation (not ours): ``RowParallelLinear.forward`` always passes
``tp_group=None`` down to ``get_tensor_model_parallel_group_if_none``, which calls
``warnings.warn(..., DeprecationWarning, stacklevel=2)`` on rank 0.  Dynamo cannot
trace that call (adding ``warnings.warn`` to ``reorderable_logging_functions`` does not
help: a warning category argument is not reorderable), so every ``linear_proj`` breaks
the graph; ``pg_collection`` does not help either, the ``None`` is hard-coded.  Because
that ``linear_proj`` call sits inside ``with off_interface(...)`` (fine-grained
activation offloading) in ``megatron/core/transformer/attention.py``, Dynamo also
reports ``step_unsupported`` there: it cannot resume a graph inside a user context
manager.  The fixture `megatron_without_tp_group_warning` replaces that one name in
``megatron.core.tensor_parallel.layers`` by the same function minus the warning;
nothing else in megatron-core needs patching (the ``off_interface`` break disappears
with it).  Megatron calls core attention inside another ``with off_interface(...)``, so
a break in primus_ext would be reported as ``step_unsupported`` at that megatron-core
line, without our frames: the unpatched test therefore accepts only the two known
megatron-core breaks, and compiles our module alone as well.
"""

from __future__ import annotations

import collections
import contextlib
import linecache
import random
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
import torch
from torch._dynamo.backends.debugging import aot_eager, boxed_nop
from torch._dynamo.testing import CompileCounter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import primus_ext
from primus_ext.compile import selective_checkpoint_context
from primus_ext.megatron import get_gpt_layer_primus_turbo_local_spec
from primus_ext.testing import fake_primus_turbo

from ..megatron import gpt

LAYERS = 2
SEQ, BATCH, HIDDEN = 16, 2, 64
TOKENS = 48
MICRO_BATCHES = 20
PRIMUS_EXT_DIR = str(Path(primus_ext.__file__).resolve().parent)

DENSE = "primus_ext.dense_attention.default"
DENSE_BW = "primus_ext.dense_attention_backward.default"
VARLEN = "primus_ext.varlen_attention.default"
VARLEN_BW = "primus_ext.varlen_attention_backward.default"

PATHS = {
    "flex-reference": dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="reference"),
    "flex-turbo": dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="turbo"),
    "direct": dict(use_turbo_flex_attention=False),
}
# The Primus-Turbo entries each path must reach from the compiled graph (None: no Turbo).
KERNELS = {
    ("flex-reference", "sbhd"): None,
    ("flex-reference", "thd"): None,
    ("flex-turbo", "sbhd"): {"flash_attn_func"},  # the window layer and the causal one
    ("flex-turbo", "thd"): {"flash_attn_varlen_func"},
    ("direct", "sbhd"): {"flash_attn_func"},
    ("direct", "thd"): {"flash_attn_varlen_func"},
}


# -- megatron-core's own blocker ----------------------------------------------------------
def _tp_group_without_warning(tp_group: Any, is_expert: bool = False, check_initialized: bool = True) -> Any:
    """``megatron.core.utils.get_tensor_model_parallel_group_if_none`` without its warning."""
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        return None
    if tp_group is not None or not parallel_state.is_initialized():
        return tp_group
    if is_expert:
        return parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
    return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)


@pytest.fixture
def megatron_without_tp_group_warning(monkeypatch):
    """See the module docstring: megatron-core 0.16.1's untraceable DeprecationWarning."""
    import megatron.core.tensor_parallel.layers as layers

    monkeypatch.setattr(layers, "get_tensor_model_parallel_group_if_none", _tp_group_without_warning)


# -- model and data -----------------------------------------------------------------------
@contextlib.contextmanager
def block_on(path: str, layers: int = LAYERS, **config: Any) -> Iterator[tuple[torch.nn.Module, Any]]:
    """The block of ``path`` inside the fake Primus-Turbo; yields ``(block, fake)``.

    With ``sink_window_even_layers_only`` one of two layers has the causal window and
    the other full causal attention.  Both run the same primus_ext code under Dynamo,
    so the tests that only count compiles or graph breaks build one layer to halve
    their compile time.
    """
    from megatron.core.transformer.transformer_block import TransformerBlock

    keys = dict(PATHS[path], use_sink_attention=True, sink_sliding_window=4, sink_window_even_layers_only=True)
    with fake_primus_turbo() as fake:
        torch.manual_seed(0)
        spec = get_gpt_layer_primus_turbo_local_spec(gpt.settings(**keys))
        block = TransformerBlock(gpt.config(num_layers=layers, **config), spec)
        if layers == 2:
            windows = [layer.self_attention.core_attention.plan.window for layer in block.layers]
            assert sorted(left for left, _ in windows) == [-1, 4], windows
        yield block, fake


def hidden(layout: str, seed: int = 1) -> torch.Tensor:
    shape = (SEQ, BATCH, HIDDEN) if layout == "sbhd" else (TOKENS, 1, HIDDEN)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def micro_batches(n: int = MICRO_BATCHES, seed: int = 0) -> list[list[int]]:
    """Document boundaries of ``n`` packed rows of TOKENS tokens, 1 to 8 documents each."""
    gen = random.Random(seed)
    rows = []
    for _ in range(n):
        cuts = sorted(gen.sample(range(1, TOKENS), gen.randint(0, 7)))
        rows.append([0, *cuts, TOKENS])
    return rows


def packed_params(bounds: Optional[list[int]], *, with_max: bool = True) -> Any:
    """Megatron's PackedSeqParams for one row, ``max_seqlen_*`` set from the row as Megatron does."""
    if bounds is None:
        return None
    cu = torch.tensor(bounds, dtype=torch.int32)
    params = gpt.thd_params(cu)
    if not with_max:
        params.max_seqlen_q = params.max_seqlen_kv = None
    return params


def documents(bounds: list[int]) -> int:
    return len(bounds) - 1


def longest(bounds: list[int]) -> int:
    return max(b - a for a, b in zip(bounds, bounds[1:]))


# -- running and comparing ----------------------------------------------------------------
def run_block(block: torch.nn.Module) -> Callable[..., torch.Tensor]:
    def step(x: torch.Tensor, params: Any = None) -> torch.Tensor:
        return block(x, None, packed_seq_params=params)

    return step


def checkpointed(block: torch.nn.Module, context_fn: Optional[Callable[[], Any]]) -> Callable[..., torch.Tensor]:
    kwargs = {} if context_fn is None else {"context_fn": context_fn}

    def step(x: torch.Tensor, params: Any = None) -> torch.Tensor:
        return checkpoint(block, x, None, packed_seq_params=params, use_reentrant=False, **kwargs)

    return step


def train_step(fn: Callable[..., torch.Tensor], block: torch.nn.Module, x: torch.Tensor,
               params: Any = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward + backward; the output and every gradient (input, weights, sink)."""
    block.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = fn(x, params)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)))
    grads = {"input": x.grad}
    grads.update({name: p.grad.clone() for name, p in block.named_parameters()})
    return out.detach(), grads


def assert_matches(compiled: tuple, eager: tuple, what: str) -> None:
    (out, grads), (ref, ref_grads) = compiled, eager
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what} output: {m}")
    assert grads.keys() == ref_grads.keys()
    assert any(name.endswith("softmax_offset") for name in grads), "the sink is not among the parameters"
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-5,
                                   msg=lambda m, name=name: f"{what} grad {name}: {m}")


class _Dispatches(TorchDispatchMode):
    def __init__(self, counts: collections.Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "primus_ext":
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


class AotEager:
    """The ``aot_eager`` backend, keeping its graphs and counting the ops they run.

    ``frame_count`` counts compilations like ``torch._dynamo.testing.CompileCounter``.
    Dynamo refuses to compile while a user ``TorchDispatchMode`` is active, so the
    counter is entered inside the compiled forward and backward graphs, where every op
    they run (also a checkpoint's recompute in backward) is dispatched through it.
    """

    def __init__(self) -> None:
        self.frame_count = 0
        self.graphs: dict[str, list[torch.fx.GraphModule]] = {"forward": [], "backward": []}
        self.dispatches: collections.Counter = collections.Counter()

    def _compiler(self, kind: str):
        def compile_graph(gm: torch.fx.GraphModule, example_inputs):
            self.graphs[kind].append(gm)
            run = boxed_nop(gm, example_inputs)

            def counted(args):
                with _Dispatches(self.dispatches):
                    return run(args)

            counted._boxed_call = True  # type: ignore[attr-defined]
            return counted

        return compile_graph

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.frame_count += 1
        return aot_eager(gm, example_inputs, fw_compiler=self._compiler("forward"),
                         bw_compiler=self._compiler("backward"))

    def ops_in(self, kind: str) -> collections.Counter:
        """primus_ext op nodes in the latest compiled graph of ``kind``."""
        graph = self.graphs[kind][-1].graph
        return collections.Counter(str(n.target) for n in graph.nodes if str(n.target).startswith("primus_ext."))


def breaks(fn: Callable[..., Any], *args: Any):
    return torch._dynamo.explain(fn)(*args)


def kernel_entries(fake: Any) -> set[str]:
    return {c.entry for c in fake.calls}


# -- tests ---------------------------------------------------------------------------------
def megatrons_own_break(reason: Any) -> bool:
    """One of megatron-core 0.16.1's two breaks on this path (module docstring): the
    ``warnings.warn`` in ``get_tensor_model_parallel_group_if_none``, or the
    ``step_unsupported`` it causes at ``with off_interface(..., "attn_proj")``.

    Megatron also calls core attention inside ``with off_interface(..., "core_attn")``;
    a break in primus_ext would surface there as ``step_unsupported`` with no primus_ext
    frame in its stack, so that site is deliberately not on this list."""
    inner = reason.user_stack[-1]
    if inner.name == "get_tensor_model_parallel_group_if_none" and "warn" in reason.reason:
        return True
    line = linecache.getline(inner.filename, inner.lineno)
    return "step_unsupported" in reason.reason and "off_interface(" in line and '"attn_proj"' in line


@pytest.mark.parametrize("layout", ["sbhd", "thd"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_every_graph_break_is_megatrons_with_megatron_untouched(path, layout):
    """Without any patch: every graph break is one of megatron-core's own, and none has
    a frame in primus_ext.

    Traced module: megatron-core's ``SelfAttention`` of a layer (``linear_qkv``, our core
    attention, ``linear_proj``), which holds all the code primus_ext runs in a layer;
    the MLP and norms around it only repeat megatron-core's ``linear_fc2`` break and
    would triple the tracing time."""
    bounds = micro_batches()[0] if layout == "thd" else None
    with block_on(path, layers=1) as (block, _):
        attention = block.layers[0].self_attention

        def attend(x: torch.Tensor, params: Any = None) -> torch.Tensor:
            return attention(x, None, packed_seq_params=params)[0]

        report = breaks(attend, hidden(layout), packed_params(bounds))
    for reason in report.break_reasons:
        frames = [frame.filename for frame in reason.user_stack]
        assert frames, f"a break without a user stack cannot be attributed: {reason.reason}"
        ours = [f for f in frames if str(Path(f).resolve()).startswith(PRIMUS_EXT_DIR)]
        assert not ours, f"graph break in primus_ext: {reason.reason}\n{ours}"
        inner = reason.user_stack[-1]
        assert megatrons_own_break(reason), f"unexpected break at {inner.filename}:{inner.lineno}: {reason.reason}"


@pytest.mark.parametrize("layout", ["sbhd", "thd"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_core_attention_alone_has_no_graph_break(path, layout):
    """Without any patch: our Megatron core-attention module, called as megatron-core's
    attention calls it (sbhd, or thd with PackedSeqParams), compiles with
    ``fullgraph=True`` into one graph.  (``fullgraph`` rather than ``explain``: a break
    right at the start of a nested call leaves no extra graph, and ``explain`` then
    reports none.)"""
    bounds = micro_batches()[0] if layout == "thd" else None
    gen = torch.Generator().manual_seed(4)
    lead = (SEQ, BATCH) if layout == "sbhd" else (TOKENS,)
    q = torch.randn(*lead, 4, 16, generator=gen)
    k, v = (torch.randn(*lead, 2, 16, generator=gen) for _ in range(2))
    with block_on(path, layers=1) as (block, fake):
        core = block.layers[0].self_attention.core_attention
        counter = CompileCounter()
        compiled = torch.compile(lambda q, k, v, params: core(q, k, v, None, packed_seq_params=params),
                                 fullgraph=True, backend=counter)
        compiled(q, k, v, packed_params(bounds))
    assert counter.frame_count == 1
    if KERNELS[(path, layout)]:
        assert kernel_entries(fake) <= KERNELS[(path, layout)] and fake.calls


@pytest.mark.parametrize("path", sorted(PATHS))
def test_compiled_block_matches_eager(path, megatron_without_tp_group_warning):
    with block_on(path) as (block, fake):
        x = hidden("sbhd")
        report = breaks(run_block(block), x)
        assert (report.graph_break_count, report.graph_count) == (0, 1), report.break_reasons
        torch._dynamo.reset()

        eager = train_step(run_block(block), block, x)
        fake.reset()
        backend = AotEager()
        compiled = torch.compile(run_block(block), fullgraph=True, backend=backend)
        result = train_step(compiled, block, x)
        kernels = kernel_entries(fake)

    assert_matches(result, eager, path)
    assert backend.frame_count == 1
    assert backend.ops_in("forward") == {DENSE: LAYERS}
    assert backend.ops_in("backward") == {DENSE_BW: LAYERS}
    assert backend.dispatches == {DENSE: LAYERS, DENSE_BW: LAYERS}
    expected = KERNELS[(path, "sbhd")]
    assert kernels == (expected or set()), kernels


@pytest.mark.parametrize("path", sorted(PATHS))
def test_packed_micro_batches_recompile_at_most_once(path, megatron_without_tp_group_warning):
    """20 rows of 48 tokens, 1 to 8 documents each.  Dynamo compiles for the first row;
    at the first change it recompiles with the changed inputs dynamic (the boundaries'
    length and the ``max_seqlen_*`` ints), then never again.  In this data both change
    at once (row 0 -> 1); see `test_max_seqlen_changing_later_than_the_document_count`."""
    rows = micro_batches()
    assert len({documents(b) for b in rows}) >= 5 and len({longest(b) for b in rows}) >= 10
    assert documents(rows[0]) != documents(rows[1]) and longest(rows[0]) != longest(rows[1])
    x = hidden("thd")
    with block_on(path) as (block, fake):
        report = breaks(run_block(block), x, packed_params(rows[0]))
        assert (report.graph_break_count, report.graph_count) == (0, 1), report.break_reasons
        torch._dynamo.reset()

        backend = AotEager()
        compiled = torch.compile(run_block(block), fullgraph=True, backend=backend)
        for i, bounds in enumerate(rows):
            eager = train_step(run_block(block), block, x, packed_params(bounds))
            fake.reset()
            backend.dispatches.clear()
            result = train_step(compiled, block, x, packed_params(bounds))
            assert_matches(result, eager, f"{path} micro-batch {i} {bounds}")
            assert backend.dispatches == {VARLEN: LAYERS, VARLEN_BW: LAYERS}, (i, backend.dispatches)
            assert kernel_entries(fake) == (KERNELS[(path, "thd")] or set())
            if i == 0:
                assert backend.frame_count == 1

    assert backend.frame_count <= 2, f"{backend.frame_count - 1} recompiles over {len(rows)} micro-batches"
    assert backend.ops_in("forward") == {VARLEN: LAYERS}
    assert backend.ops_in("backward") == {VARLEN_BW: LAYERS}


# Rows whose document count changes at row 1 but whose longest document only at row 2.
STAGGERED = [[0, 20, 30, 48], [0, 5, 25, 30, 48], [0, 24, 36, 48], [0, 10, 20, 30, 40, 48], [0, 48]]


def _frames_over(rows: list[list[int]], *, with_max: bool) -> int:
    x = hidden("thd")
    with block_on("flex-reference", layers=1) as (block, _):
        backend = AotEager()
        compiled = torch.compile(run_block(block), fullgraph=True, backend=backend)
        for bounds in rows:
            compiled(x, packed_params(bounds, with_max=with_max)).sum().backward()
    return backend.frame_count


def test_max_seqlen_changing_later_than_the_document_count(megatron_without_tp_group_warning):
    """Automatic dynamic promotes an input when *it* first changes: if the document
    count and the longest document first change in different micro-batches, that is
    two recompiles.  Without ``max_seqlen_*`` (bounded by the token count inside
    primus_ext) only the boundaries' length is left, so one recompile whatever the order."""
    assert [documents(b) for b in STAGGERED[:3]] == [3, 4, 3]
    assert [longest(b) for b in STAGGERED[:3]] == [20, 20, 24]
    assert _frames_over(STAGGERED, with_max=True) == 3
    torch._dynamo.reset()
    assert _frames_over(STAGGERED, with_max=False) == 2


def test_dynamic_sources_remove_the_recompile(megatron_without_tp_group_warning):
    """Declaring the packed inputs dynamic up front (``torch.compiler.config.dynamic_sources``,
    names as Dynamo sees the compiled function's arguments) leaves a single compile."""
    sources = ",".join(f"L['params'].{name}" for name in
                       ("cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q", "max_seqlen_kv"))
    with torch.compiler.config.patch(dynamic_sources=sources):
        assert _frames_over(STAGGERED, with_max=True) == 1


@pytest.mark.parametrize("layout", ["sbhd", "thd"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_selective_checkpointing_runs_attention_once_per_layer(path, layout, megatron_without_tp_group_warning):
    """One training step of the checkpointed block, compiled: with the save policy the
    forward op runs once per layer (forward only); plain checkpointing recomputes it in
    backward, twice per layer.  Both give eager's gradients."""
    bounds = micro_batches()[1] if layout == "thd" else None
    forward, backward = (VARLEN, VARLEN_BW) if layout == "thd" else (DENSE, DENSE_BW)
    x = hidden(layout)
    counts, results = {}, {}
    with block_on(path) as (block, _):
        eager = train_step(run_block(block), block, x, packed_params(bounds))
        for name, context_fn in (("policy", selective_checkpoint_context), ("plain", None)):
            torch._dynamo.reset()
            backend = AotEager()
            compiled = torch.compile(checkpointed(block, context_fn), fullgraph=True, backend=backend)
            results[name] = train_step(compiled, block, x, packed_params(bounds))
            counts[name] = backend.dispatches
            assert backend.ops_in("forward") == {forward: LAYERS}

    assert counts["policy"] == {forward: LAYERS, backward: LAYERS}, counts
    assert counts["plain"] == {forward: 2 * LAYERS, backward: LAYERS}, counts
    for name, result in results.items():
        assert_matches(result, eager, f"{path} {layout} {name} checkpoint")


@pytest.mark.parametrize("layout", ["sbhd", "thd"])
def test_compiled_attention_dropout_matches_eager_with_the_same_seed(layout, megatron_without_tp_group_warning):
    """Attention dropout 0.3 in training: seeded alike, the compiled block (op forward,
    backward op replaying the saved generator state) gives eager's output and gradients."""
    bounds = micro_batches()[1] if layout == "thd" else None
    x = hidden(layout)
    with block_on("flex-reference", attention_dropout=0.3) as (block, _):
        compiled = torch.compile(run_block(block), fullgraph=True, backend="aot_eager")
        results = {}
        for name, fn in (("eager", run_block(block)), ("compiled", compiled), ("eager-other-seed", run_block(block))):
            torch.manual_seed(11 if name != "eager-other-seed" else 12)
            results[name] = train_step(fn, block, x, packed_params(bounds))
        torch.manual_seed(11)
        block.eval()
        no_dropout = run_block(block)(x, packed_params(bounds)).detach()
    assert_matches(results["compiled"], results["eager"], f"dropout {layout}")
    assert (results["eager"][0] - no_dropout).abs().max() > 1e-3, "dropout had no effect"
    assert (results["eager"][0] - results["eager-other-seed"][0]).abs().max() > 1e-3


def test_eager_selective_checkpointing_recomputes_attention():
    """Out of scope, pinned so the docs stay true: eager calls run the kernels directly,
    not the op, so the save policy never sees attention.  Eager checkpointing with the
    policy gives eager's gradients and runs each layer's Turbo kernel twice."""
    x = hidden("sbhd")
    with block_on("flex-turbo") as (block, fake):
        eager = train_step(run_block(block), block, x)
        assert len(fake.calls) == LAYERS  # the fake's native autograd: no kernel call in backward
        fake.reset()
        result = train_step(checkpointed(block, selective_checkpoint_context), block, x)
        calls = len(fake.calls)
    assert_matches(result, eager, "eager selective checkpoint")
    assert calls == 2 * LAYERS
