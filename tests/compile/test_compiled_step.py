"""A compiled GPT training step runs attention's forward once per layer and micro-batch.

megatron-core's ``GPTModel`` (two layers: one with a causal window, one fully causal,
both with learned sinks) in bf16 is trained for a few micro-batches on the CPU fake of
Primus-Turbo with the gfx942 dispatch modelled, eagerly and under ``torch.compile``.
Every call that reaches the fake is recorded, so the number of attention forward
kernel calls is counted, not inferred:

* eager: ``flash_attn_func`` once per layer and micro-batch, its native backward;
* compiled: AITER's kernel-level forward once per layer and micro-batch and its
  backward once, with no forward in the backward (`primus_ext.backends.turbo_kernels`);
* the control, with no arch known (so no kernel route to bind): the backward op
  recomputes the forward through ``flash_attn_func``, twice the forward calls.

Compiled losses and gradients equal eager ones exactly (both sides read the output as the
kernel stored it, in bf16).  The reference backend gets the
same split with its blockwise math (`primus_ext.backends.blockwise`), or for plain
causal attention aten's CPU flash forward/backward pair, checked in float64 against eager.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Optional

import pytest
import torch

from primus_ext.testing import fake_primus_turbo

from ..megatron import gpt
from .test_compiled_layer import AotEager, megatron_without_tp_group_warning  # noqa: F401

LAYERS, MICRO_BATCHES = 2, 3
FORWARD_ENTRIES = {"flash_attn_func", "flash_attn_varlen_func", "attention_aiter_forward_impl",
                   "attention_aiter_varlen_forward_impl"}
PATHS = {
    "flex-turbo": dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="turbo"),
    "direct": dict(use_turbo_flex_attention=False),
}


def model_on(path_keys: dict, arch: Optional[str], dtype: torch.dtype, sink: bool = True, **cfg_over: Any) -> Any:
    extra = dict(use_sink_attention=True, sink_sliding_window=4, sink_window_even_layers_only=True) if sink else {}
    keys = dict(path_keys, turbo_arch=arch or "auto", **extra)
    cfg = gpt.config(num_layers=LAYERS, params_dtype=dtype, bf16=dtype == torch.bfloat16, **cfg_over)
    cfg.packed_sequences = False  # dense batches only: a sink has no varlen kernel on gfx942 (B33)
    model = gpt.build_gpt(gpt.settings(**keys), cfg)
    return model.to(dtype)  # as the demo does: Megatron's Float16Module is a training-loop wrapper


def steps(model: Any, fn: Any) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Forward + backward of every micro-batch, gradients accumulated (no optimizer step)."""
    model.zero_grad(set_to_none=True)
    losses = []
    for tokens in gpt.batches(MICRO_BATCHES):
        loss = fn(tokens, gpt.positions(tokens), None, labels=tokens).float().mean()
        loss.backward()
        losses.append(loss.detach())
    return losses, {name: p.grad.float().clone() for name, p in model.named_parameters()}


def counted(fake: Any) -> Counter:
    return Counter(c.entry for c in fake.calls)


RNG_STATES: list = []
"""The ``rng_state`` each recorded AITER backward call got, from the latest `run`."""


SHAPES = {"gqa2-d16": {}, "gqa8-d64": dict(hidden_size=512, num_attention_heads=8, num_query_groups=1, kv_channels=64)}
"""The small default, and the acceptance shape: 8 query heads per key/value head, head dim 64."""


def run(path: str, arch: Optional[str], compiled: bool, shape: str = "gqa2-d16") -> tuple[Counter, Any]:
    with fake_primus_turbo(build="main", arch=arch) as fake:
        model = model_on(PATHS[path], arch, torch.bfloat16, **SHAPES[shape])
        fn = torch.compile(model, backend="aot_eager") if compiled else model
        result = steps(model, fn)
        RNG_STATES[:] = [c.args["rng_state"] for c in fake.calls_to("attention_aiter_backward_impl")]
        return counted(fake), result


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("path", sorted(PATHS))
def test_compiled_step_runs_one_attention_forward_per_layer_and_micro_batch(path, shape,
                                                                            megatron_without_tp_group_warning):
    eager_calls, (eager_losses, eager_grads) = run(path, "gfx942", compiled=False, shape=shape)
    assert eager_calls == {"flash_attn_func": LAYERS * MICRO_BATCHES}, eager_calls

    torch._dynamo.reset()
    calls, (losses, grads) = run(path, "gfx942", compiled=True, shape=shape)
    forwards = sum(n for entry, n in calls.items() if entry in FORWARD_ENTRIES)
    assert forwards == LAYERS * MICRO_BATCHES, calls
    assert calls == {"attention_aiter_forward_impl": LAYERS * MICRO_BATCHES,
                     "attention_aiter_backward_impl": LAYERS * MICRO_BATCHES}, calls
    # The sink path's Triton backward asserts the forward's own rng_state: CPU int64 [2]
    # (docs/fidelity.md, fact `aiter-rng-sink`), handed from the forward op to the backward op through the graph.
    assert RNG_STATES and all(isinstance(r, torch.Tensor) and r.device.type == "cpu" and r.dtype == torch.int64
                              and tuple(r.shape) == (2,) for r in RNG_STATES), RNG_STATES

    # The same kernel math from the same saved (bf16) output, as a flash kernel saves it:
    # compiled equals eager exactly.
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager_losses), rtol=0, atol=0)
    for name, g in grads.items():
        torch.testing.assert_close(g, eager_grads[name], rtol=0, atol=0, msg=lambda m, n=name: f"{path} {n}: {m}")


def test_without_a_known_route_the_compiled_backward_recomputes_the_forward(megatron_without_tp_group_warning):
    """The control: with no arch the kernel backend of a call is unknown, nothing is bound,
    and the backward op runs ``flash_attn_func`` again (what the pair removes)."""
    calls, _ = run("flex-turbo", None, compiled=True)
    assert calls == {"flash_attn_func": 2 * LAYERS * MICRO_BATCHES}, calls


@pytest.mark.parametrize("sink", [True, False], ids=["sinks-blockwise", "causal-sdpa"])
def test_reference_compiled_step_splits_forward_and_backward(sink, megatron_without_tp_group_warning):
    """The reference backend: the compiled backward op runs the backward kernel from the saved
    (out, lse), never the forward; with sinks that is the blockwise pair, for plain causal
    multi-head attention (what eager sends to SDPA) aten's CPU flash pair.  Gradients equal eager in
    float64."""
    from primus_ext.backends import reference

    keys = dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="reference")
    pair = reference.BlockwisePair if sink else reference.SdpaCpuPair
    calls: Counter = Counter()
    original = pair.forward

    def counting(self: Any, a: Any) -> Any:
        calls["forward"] += 1
        return original(self, a)

    # aten's CPU pair takes MHA only (eager SDPA sums a GQA group's gradients its own way)
    model = model_on(keys, None, torch.float64, sink=sink, **({} if sink else {"num_query_groups": 4}))
    eager_losses, eager_grads = steps(model, model)
    pair.forward = counting
    try:
        losses, grads = steps(model, torch.compile(model, backend="aot_eager"))
    finally:
        pair.forward = original
    assert calls["forward"] == LAYERS * MICRO_BATCHES, calls
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager_losses), rtol=1e-10, atol=1e-10)
    for name, g in grads.items():
        torch.testing.assert_close(g, eager_grads[name], rtol=1e-9, atol=1e-9)


def test_compiled_reference_trains_alibi_slopes_like_eager():
    """The op's backward returns the slopes' gradient (the blockwise pair computes it)."""
    from ..helpers import adapter, qkv, settings

    run = adapter(settings(sink_sliding_window=3))  # the plan's window (3, 0), as the calls pass it
    q, k, v = qkv(grad=True)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64, requires_grad=True)
    grads = []
    for fn in (run, torch.compile(lambda *a, **kw: run(*a, **kw), backend="aot_eager", fullgraph=True)):
        out = fn(q, k, v, causal=True, window_size=(3, 0), alibi_slopes=slopes)
        grads.append(torch.autograd.grad(out.pow(2).sum(), [q, slopes]))
    for eager, compiled in zip(*grads):
        torch.testing.assert_close(compiled, eager, rtol=1e-10, atol=1e-10)


def test_compiled_packed_refusals_are_ours_on_cpu():
    """Under torch.compile the varlen op checks the boundaries itself when it runs, so on CPU a
    bad boundary is refused with the project's error, as in eager."""
    from primus_ext.errors import UnsupportedInputError

    from ..helpers import adapter, facts, packed_qkv, settings

    run = adapter(settings(), facts(packed=True))
    fn = torch.compile(lambda q, k, v, cu, m: run.varlen(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                  max_seqlen_q=m, max_seqlen_k=m), backend="aot_eager")
    q, k, v = packed_qkv(11)
    fn(q, k, v, torch.tensor([0, 4, 11], dtype=torch.int32), 7)
    with pytest.raises(UnsupportedInputError, match="max_seqlen"):
        fn(q, k, v, torch.tensor([0, 2, 11], dtype=torch.int32), 7)


def test_a_tensor_max_seqlen_under_compile_is_refused_by_us():
    from primus_ext.errors import UnsupportedInputError

    from ..helpers import adapter, facts, packed_qkv, settings

    run = adapter(settings(), facts(packed=True))
    fn = torch.compile(lambda q, k, v, cu, m: run.varlen(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                  max_seqlen_q=m, max_seqlen_k=m), backend="aot_eager")
    q, k, v = packed_qkv(11)
    with pytest.raises(UnsupportedInputError, match="max_seqlen"):
        fn(q, k, v, torch.tensor([0, 4, 11], dtype=torch.int32), torch.tensor(7))
