"""End to end with real megatron-core on CPU: a tiny GPTModel (learned absolute positions,
local spec through `PrimusTurboLocalSpecProvider`) trained on the flex and direct paths.

The direct path and the ``turbo`` flex backend run on the CPU fake of Primus-Turbo,
which records every kernel call; the ``reference`` flex backend is exact torch math.
Besides comparing numbers, every test checks *which* code ran (recorded kernel
entries and spies on the adapter / direct runner / backends), so two paths can never
agree only because both silently ran the same thing.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import pytest
import torch

from primus_ext.call.adapter import TurboFlexAttention
from primus_ext.backends.direct import DirectRunner
from primus_ext.backends.reference import ReferenceBackend
from primus_ext.backends.turbo import TurboBackend
from primus_ext.errors import UnsupportedConfigError
from primus_ext.testing.fake_turbo import fake_primus_turbo

from . import gpt

STEPS = 5
LAYERS = 2
HEADS = 4  # gpt.config(): 4 query heads, 2 query groups, head dim 16
WINDOW = 4
REL = 1e-5

DIRECT = dict(use_turbo_flex_attention=False)
FLEX_REFERENCE = dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="reference")
FLEX_TURBO = dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="turbo")
SINKS = dict(use_sink_attention=True, sink_sliding_window=WINDOW, sink_window_even_layers_only=True)


class Spy:
    """Counts (and keeps the arguments of) calls into the project's attention code."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []
        for cls, method, label in ((TurboFlexAttention, "__call__", "adapter"),
                                   (TurboFlexAttention, "varlen", "adapter-packed"),
                                   (DirectRunner, "run", "direct"),
                                   (ReferenceBackend, "dense", "reference"),
                                   (ReferenceBackend, "packed", "reference-packed")):
            monkeypatch.setattr(cls, method, self._wrap(getattr(cls, method), label))
        # The turbo backend runs every call through a bound runner (the adapter keeps one
        # for equal calls): each run of one counts.
        for method, label in (("bind_dense", "turbo"), ("bind_packed", "turbo-packed")):
            monkeypatch.setattr(TurboBackend, method, self._wrap_runner(getattr(TurboBackend, method), label))

    def _wrap(self, original: Callable[..., Any], label: str) -> Callable[..., Any]:
        calls = self.calls

        def spied(obj: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append((label, args, kwargs))
            return original(obj, *args, **kwargs)

        return spied

    def _wrap_runner(self, bind: Callable[..., Any], label: str) -> Callable[..., Any]:
        calls = self.calls

        def bound(obj: Any, call: Any) -> Any:
            runner = bind(obj, call)

            def spied(*args: Any) -> Any:
                calls.append((label, args, {}))
                return runner(*args)

            return spied

        return bound

    def count(self, label: str) -> int:
        return sum(1 for name, _, _ in self.calls if name == label)

    def of(self, label: str) -> list[tuple[tuple, dict]]:
        return [(a, k) for name, a, k in self.calls if name == label]

    def clear(self) -> None:
        self.calls.clear()


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Spy:
    return Spy(monkeypatch)


def entries(fake: Any) -> list[str]:
    return [c.entry for c in fake.calls]


def kernel_kwargs(call: Any) -> dict:
    """A recorded call's arguments without the tensors q/k/v (and flex's query/key/value)."""
    return {k: v for k, v in call.args.items() if k not in ("q", "k", "v", "query", "key", "value")}


def run(keys: dict, data: list[torch.Tensor], *, cfg: Optional[dict] = None, bf16: bool = False):
    """Build a same-seed model inside a fresh fake Turbo, train it; return (losses, model, fake)."""
    with fake_primus_turbo() as fake:
        model = gpt.build_gpt(gpt.settings(**keys), gpt.config(**(cfg or {})))
        if bf16:
            model = model.bfloat16()
        losses = gpt.train(model, data)
    return losses, model, fake


def assert_trained(losses: list[float]) -> None:
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))
    assert len(set(losses)) == STEPS, f"the loss never moved: {losses}"


# ----------------------------------------------------------------------------------------
# 1. flex (reference, fake turbo) == direct (fake flash_attn_func), and who ran
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("window", [None, (WINDOW, 0)], ids=["causal", "config-window"])
def test_flex_paths_train_to_the_direct_path_losses(window, spy):
    data = gpt.batches(STEPS)
    cfg = dict(window_size=window)
    calls_per_run = STEPS * LAYERS
    expected_window = window or (-1, -1)

    direct, direct_model, direct_fake = run(DIRECT, data, cfg=cfg)
    assert_trained(direct)
    assert entries(direct_fake) == ["flash_attn_func"] * calls_per_run
    assert all(kernel_kwargs(c)["causal"] is True and tuple(c.args["window_size"]) == expected_window
               for c in direct_fake.calls)
    assert spy.count("direct") == calls_per_run and spy.count("adapter") == 0
    for module in gpt.attention_modules(direct_model):
        assert module.plan.path == "direct" and module.core.adapter is None

    spy.clear()
    reference, ref_model, ref_fake = run(FLEX_REFERENCE, data, cfg=cfg)
    assert ref_fake.calls == [], "the reference backend must not call any Turbo entry"
    assert spy.count("adapter") == spy.count("reference") == calls_per_run
    assert spy.count("direct") == spy.count("turbo") == 0
    for module in gpt.attention_modules(ref_model):
        assert module.plan.path == "flex" and module.plan.backend == "reference"
        assert module.plan.window == expected_window and module.core.runner is None

    spy.clear()
    turbo, turbo_model, turbo_fake = run(FLEX_TURBO, data, cfg=cfg)
    assert spy.count("adapter") == spy.count("turbo") == calls_per_run
    assert spy.count("direct") == spy.count("reference") == 0
    for module in gpt.attention_modules(turbo_model):
        assert module.plan.path == "flex" and module.plan.backend == "turbo"
    # B6/B7: causal and windows run the very kernel the direct path runs, with the same arguments.
    assert entries(turbo_fake) == ["flash_attn_func"] * calls_per_run
    assert [kernel_kwargs(c) for c in turbo_fake.calls] == [kernel_kwargs(c) for c in direct_fake.calls]

    torch.testing.assert_close(reference, direct, rtol=REL, atol=0)
    torch.testing.assert_close(turbo, direct, rtol=REL, atol=0)


# ----------------------------------------------------------------------------------------
# 2. sinks + sink_sliding_window on odd Megatron layers only (B12, B14, B15)
# ----------------------------------------------------------------------------------------
def test_sinks_with_even_layers_window_match_between_flex_and_direct(spy):
    data = gpt.batches(STEPS)
    direct, direct_model, direct_fake = run({**DIRECT, **SINKS}, data)
    reference, ref_model, ref_fake = run({**FLEX_REFERENCE, **SINKS}, data)
    turbo, turbo_model, turbo_fake = run({**FLEX_TURBO, **SINKS}, data)
    assert_trained(direct)

    # B14: layer 1 (1-indexed, odd) has the window, layer 2 has none.
    for model in (direct_model, ref_model, turbo_model):
        first, second = gpt.attention_modules(model)
        assert (first.plan.layer_number, second.plan.layer_number) == (1, 2)
        assert first.plan.window == (WINDOW, 0) and first.plan.pattern.kind == "window"
        assert second.plan.window == (-1, -1) and second.plan.pattern.kind == "causal"
        for module in (first, second):
            assert module.plan.sink
            sink = module.softmax_offset
            assert isinstance(sink, torch.nn.Parameter) and sink.shape == (HEADS,)  # B15 (TP=1)
            assert sink.abs().sum() > 0, "the zero-initialised sink never got a gradient step"

    # Calls alternate layer 1, layer 2 in every forward (backward runs through autograd).
    assert entries(direct_fake) == ["flash_attn_func"] * (STEPS * LAYERS)
    assert {tuple(c.args["window_size"]) for c in direct_fake.calls[0::2]} == {(WINDOW, 0)}
    assert {tuple(c.args["window_size"]) for c in direct_fake.calls[1::2]} == {(-1, -1)}
    assert entries(turbo_fake) == ["flash_attn_func"] * (STEPS * LAYERS)
    assert {tuple(c.args["window_size"]) for c in turbo_fake.calls[0::2]} == {(WINDOW, 0)}
    assert {tuple(c.args["window_size"]) for c in turbo_fake.calls[1::2]} == {(-1, -1)}
    for call in direct_fake.calls + turbo_fake.calls:
        assert call.args["sink"] is not None and call.args["sink"].shape == (HEADS,)
    assert ref_fake.calls == []

    torch.testing.assert_close(reference, direct, rtol=REL, atol=0)
    torch.testing.assert_close(turbo, direct, rtol=REL, atol=0)

    # The sink changes the model: same window, no sink -> another loss from step 1 on.
    no_sink, _, _ = run({**FLEX_REFERENCE, **SINKS, "use_sink_attention": False}, data[:1])
    assert abs(no_sink[0] - reference[0]) > 1e-4


@pytest.mark.parametrize("keys", [DIRECT, FLEX_TURBO, FLEX_REFERENCE], ids=["direct", "flex-turbo", "flex-reference"])
def test_bf16_sink_parameter_gets_a_gradient_through_an_fp32_cast(keys):
    """B12: model-wide ``.bfloat16()`` makes the sink bf16; the kernel still sees fp32 and
    the parameter still receives a (nonzero) gradient.  ``.bfloat16()`` is the cast that
    works on CPU: ``params_dtype=bf16, bf16=True`` without Megatron's Float16Module
    wrapper feeds fp32 activations into bf16 weights."""
    losses, model, fake = run({**keys, **SINKS}, gpt.batches(2), bf16=True)
    assert all(torch.isfinite(torch.tensor(losses)))
    for module in gpt.attention_modules(model):
        sink = module.softmax_offset
        assert sink.dtype == torch.bfloat16 and sink.shape == (HEADS,)
        assert sink.grad is not None and sink.grad.dtype == torch.bfloat16
        assert sink.grad.abs().sum() > 0
    if keys is FLEX_REFERENCE:
        assert fake.calls == []
        return
    assert len(fake.calls) == 2 * LAYERS
    for call in fake.calls:
        q = call.args.get("q", call.args.get("query"))
        assert q.dtype == torch.bfloat16, "the model did not run in bf16"
        recorded = call.args["sink"]
        assert recorded.dtype == torch.float32 and recorded.shape == (HEADS,)
        assert recorded.grad_fn is not None, "the fp32 cast must stay on the autograd graph"


# ----------------------------------------------------------------------------------------
# 4. config.window_size == a hand-written sliding-window mask hook, bit for bit (B9, B11)
# ----------------------------------------------------------------------------------------
HOOK_MODULE = "e2e_sliding_window_hook"


@pytest.fixture
def window_hook(tmp_path, monkeypatch) -> str:
    (tmp_path / f"{HOOK_MODULE}.py").write_text(
        f"W = {WINDOW}\n\n\n"
        "def mask(b, h, q, kv):\n"
        "    return (kv <= q) & (q - kv <= W)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, HOOK_MODULE, raising=False)
    return f"{HOOK_MODULE}:mask"


def test_config_window_equals_sliding_window_hook_bit_for_bit(window_hook):
    data = gpt.batches(STEPS)
    with fake_primus_turbo() as fake:
        windowed = gpt.build_gpt(gpt.settings(**FLEX_REFERENCE), gpt.config(window_size=(WINDOW, 0)))
        # B11: the hook run sets no window of its own (config.window_size stays None).
        hooked = gpt.build_gpt(gpt.settings(**FLEX_REFERENCE, turbo_flex_attention_mask_mod=window_hook))
        causal = gpt.build_gpt(gpt.settings(**FLEX_REFERENCE))
        for module in gpt.attention_modules(windowed):
            assert module.plan.window == (WINDOW, 0) and module.plan.mask_hook is None
        for module in gpt.attention_modules(hooked):
            assert module.plan.window == (-1, -1) and module.plan.mask_hook == window_hook
            assert module.plan.pattern == gpt.attention_modules(windowed)[0].plan.pattern
        # Same seed -> same start, also with a hook (probing it must not consume the RNG).
        start_w, start_h = gpt.parameters(windowed), gpt.parameters(hooked)
        assert start_w.keys() == start_h.keys()
        assert all(torch.equal(start_w[n], start_h[n]) for n in start_w)

        losses_w = torch.tensor(gpt.train(windowed, data))
        losses_h = torch.tensor(gpt.train(hooked, data))
        losses_c = torch.tensor(gpt.train(causal, data))
    assert fake.calls == []
    assert_trained(losses_w.tolist())
    assert torch.equal(losses_w, losses_h), (losses_w, losses_h)
    end_w, end_h = gpt.parameters(windowed), gpt.parameters(hooked)
    changed = [n for n in end_w if not torch.equal(end_w[n], start_w[n])]
    assert changed, "training did not change any parameter"
    unequal = [n for n in end_w if not torch.equal(end_w[n], end_h[n])]
    assert not unequal, f"parameters differ after {STEPS} steps: {unequal}"
    # The window really bites: plain causal attention trains differently.
    assert (losses_c - losses_w).abs().max() > 1e-4


@pytest.mark.parametrize("cfg, keys", [
    (dict(window_size=(WINDOW, 0)), {}),
    ({}, dict(sink_sliding_window=WINDOW)),
], ids=["config-window", "sink-window"])
def test_hook_together_with_a_window_is_refused_at_build(window_hook, cfg, keys):
    with fake_primus_turbo() as fake:
        with pytest.raises(UnsupportedConfigError) as info:
            gpt.build_gpt(gpt.settings(**FLEX_REFERENCE, turbo_flex_attention_mask_mod=window_hook, **keys),
                          gpt.config(**cfg))
    assert fake.calls == []
    assert "turbo_flex_attention_mask_mod" in info.value.settings
    assert ("window_size" if cfg else "sink_sliding_window") in str(info.value)


# ----------------------------------------------------------------------------------------
# 5. attention_dropout reaches the kernel in training, 0 in eval (B30)
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("keys, window, entry", [
    (FLEX_TURBO, None, "flash_attn_func"),
    (FLEX_TURBO, (WINDOW, 0), "flash_attn_func"),
    (DIRECT, None, "flash_attn_func"),
    (DIRECT, (WINDOW, 0), "flash_attn_func"),
], ids=["flex-turbo-causal", "flex-turbo-window", "direct-causal", "direct-window"])
def test_attention_dropout_reaches_the_kernel_only_in_training(keys, window, entry):
    tokens = gpt.batches(1)[0]
    with fake_primus_turbo() as fake:
        model = gpt.build_gpt(gpt.settings(**keys), gpt.config(attention_dropout=0.1, window_size=window))
        model.train()
        first = model(tokens, gpt.positions(tokens), None, labels=tokens).float().mean()
        first.backward()
        second = model(tokens, gpt.positions(tokens), None, labels=tokens).float().mean()
        assert entries(fake) == [entry] * (2 * LAYERS)
        assert [c.args["dropout_p"] for c in fake.calls] == [0.1] * (2 * LAYERS)
        assert first.item() != second.item(), "dropout 0.1 in training left the loss unchanged"

        fake.reset()
        model.eval()
        out_a, out_b = gpt.logits(model, tokens), gpt.logits(model, tokens)
        assert entries(fake) == [entry] * (2 * LAYERS)
        assert [c.args["dropout_p"] for c in fake.calls] == [0.0] * (2 * LAYERS)
        assert torch.equal(out_a, out_b)


def test_attention_dropout_on_the_reference_backend(spy):
    """The reference backend has no fake to record it; the spy reads its KernelCall."""
    tokens = gpt.batches(1)[0]
    model = gpt.build_gpt(gpt.settings(**FLEX_REFERENCE), gpt.config(attention_dropout=0.1))
    model.train()
    model(tokens, gpt.positions(tokens), None, labels=tokens)
    assert [args[3].dropout_p for args, _ in spy.of("reference")] == [0.1] * LAYERS
    spy.clear()
    gpt.logits(model, tokens)
    assert [args[3].dropout_p for args, _ in spy.of("reference")] == [0.0] * LAYERS


# ----------------------------------------------------------------------------------------
# 6. flex off (the default): today's flash_attn_func call, unchanged (B1)
# ----------------------------------------------------------------------------------------
def test_direct_default_causal_calls_flash_attn_func_with_todays_arguments():
    tokens = gpt.batches(1)[0]
    turbo = gpt.settings()  # use_turbo_attention only; use_turbo_flex_attention keeps its default
    assert turbo.use_turbo_flex_attention is False
    with fake_primus_turbo() as fake:
        model = gpt.build_gpt(turbo)
        model.train()
        model(tokens, gpt.positions(tokens), None, labels=tokens).float().mean().backward()
    for module in gpt.attention_modules(model):
        assert module.plan.path == "direct" and module.core.adapter is None
        assert not hasattr(module, "softmax_offset"), "no sink parameter without use_sink_attention"
    assert entries(fake) == ["flash_attn_func"] * LAYERS
    batch, seq = tokens.shape
    for call in fake.calls:
        assert kernel_kwargs(call) == dict(
            dropout_p=0.0, softmax_scale=None, causal=True, window_size=(-1, -1), bias=None,
            alibi_slopes=None, deterministic=False, return_lse=False, return_attn_probs=False,
            sink=None,  # flash_attn_func takes `sink`, so None is forwarded, never a TypeError
        )
        assert call.args["q"].shape == (batch, seq, HEADS, 16)  # bshd views of Megatron's sbhd
        assert call.args["k"].shape == call.args["v"].shape == (batch, seq, 2, 16)
