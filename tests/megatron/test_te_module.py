"""The TransformerEngine-based `PrimusTurboAttention` passes the local module's core tests.

TransformerEngine cannot be installed on this CPU machine, so every test here runs with
the stand-in ``transformer_engine`` of `tests.megatron.te_stub` injected into
``sys.modules`` (and removed afterwards).  The stand-in is only TE's module shell; the
computation is the shared Turbo core, so the TE module must behave exactly like
`PrimusTurboLocalAttention`: same outputs and gradients on the flex (reference) and
direct (fake Turbo) paths, dense sbhd and packed thd; same refusals, word for word;
same sink parameter.  Also: ``primus_ext`` imports without TE, and a GPTModel whose
layer spec uses the TE core attention trains.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnMaskType

from primus_ext.errors import UnsupportedConfigError, UnsupportedInputError
from primus_ext.megatron import PrimusTurboLocalAttention, primus_turbo_te_core_attention, use_core_attention
from primus_ext.megatron.te import te_attention_class
from primus_ext.testing.fake_turbo import fake_primus_turbo
from tests import oracle
from tests.megatron import gpt, te_stub
from tests.megatron.test_refusals import CASES, FLEX, Case, qkv_sbhd, qkv_thd, thd_params

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def te():
    """The stand-in ``transformer_engine.pytorch`` in sys.modules for one test."""
    before = {k: v for k, v in sys.modules.items() if k.startswith("transformer_engine")}
    with te_stub.installed_te_stub() as module:
        yield module
    assert {k: v for k, v in sys.modules.items() if k.startswith("transformer_engine")} == before


def maybe_fake(on: bool):
    return fake_primus_turbo() if on else contextlib.nullcontext()


def build_pair(settings, cfg=None, *, layer_number: int = 1, mask_type=AttnMaskType.causal, **kw: Any):
    """The local and the TE module, built the way Megatron's SelfAttention builds core attention."""
    cfg = cfg or gpt.config()
    common = dict(config=cfg, layer_number=layer_number, attn_mask_type=mask_type, attention_type="self", **kw)
    return (PrimusTurboLocalAttention(settings=settings, **common),
            primus_turbo_te_core_attention(settings)(**common))


def refusal(build: Callable[[], Any], error: type = UnsupportedConfigError) -> Exception:
    with pytest.raises(error) as info:
        build()
    return info.value


# ------------------------------------------------------------------------- identity
def test_the_te_module_is_a_subclass_of_te_dot_product_attention(te):
    cls = te_attention_class()
    assert issubclass(cls, te.DotProductAttention) and issubclass(cls, te_stub.DotProductAttention)
    import primus_ext.megatron as pm

    assert pm.PrimusTurboAttention is cls  # the lazily resolved package attribute is the same class


def test_te_base_receives_te_keywords_with_global_heads(te, seeded_rng_tracker):
    cfg = gpt.config(attention_dropout=0.1, tensor_model_parallel_size=2)
    _, module = build_pair(gpt.settings(**FLEX), cfg, layer_number=2, softmax_scale=0.5)
    assert module.te_kwargs == dict(
        num_attention_heads=4, kv_channels=16, num_gqa_groups=2, attention_dropout=0.1, qkv_format="sbhd",
        attn_mask_type="causal", tp_size=2, tp_group=None, layer_number=2, attention_type="self",
        softmax_scale=0.5,
    )
    assert module.core.local_heads == 2  # TE divides by tp_size itself; the Turbo core sees local heads


@pytest.mark.parametrize("tp", [1, 2])
def test_sink_parameter_has_one_entry_per_local_head(te, tp):
    cfg = gpt.config(tensor_model_parallel_size=tp)
    local, module = build_pair(gpt.settings(**FLEX, use_sink_attention=True), cfg)
    for m in (local, module):
        sink = dict(m.named_parameters())["softmax_offset"]
        assert sink.shape == (4 // tp,)
        assert sink.tensor_model_parallel is True and sink.partition_dim == 0
    local_sd = local.sharded_state_dict(prefix="attn.")
    te_sd = module.sharded_state_dict(prefix="attn.")
    assert local_sd.keys() == te_sd.keys() == {"attn.softmax_offset"}
    assert local_sd["attn.softmax_offset"].global_shape == te_sd["attn.softmax_offset"].global_shape


# ---------------------------------------------------------------------- same outputs
PATHS = {"flex-reference": (FLEX, False), "direct-fake-turbo": ({}, True)}
VARIANTS = {"plain": {}, "sink-window": {"use_sink_attention": True, "sink_sliding_window": 3}}


def run(module: torch.nn.Module, layout: str, sink_values: torch.Tensor | None):
    if sink_values is not None:
        with torch.no_grad():
            module.softmax_offset.copy_(sink_values)
    if layout == "sbhd":
        q, k, v = qkv_sbhd(seed=3)
        params = None
    else:
        q, k, v = qkv_thd(seed=3)
        params = thd_params()
    for t in (q, k, v):
        t.requires_grad_(True)
    out = module(q, k, v, None, AttnMaskType.causal, attention_bias=None, packed_seq_params=params)
    out.square().sum().backward()
    grads = [t.grad for t in (q, k, v)]
    if sink_values is not None:
        grads.append(module.softmax_offset.grad)
    return (q, k, v), out.detach(), grads


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layout", ["sbhd", "thd"])
@pytest.mark.parametrize("path", PATHS)
def test_same_outputs_and_gradients_as_the_local_module(te, path, layout, variant):
    keys, fake = PATHS[path]
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0]) if variant == "sink-window" else None
    with maybe_fake(fake) as turbo:
        local, module = build_pair(gpt.settings(**keys, **VARIANTS[variant]))
        (q, k, v), want, want_grads = run(local, layout, sink)
        local_calls = list(turbo.calls) if turbo is not None else []
        if turbo is not None:
            turbo.reset()
        _, got, got_grads = run(module, layout, sink)
        if turbo is not None:  # the same kernel got the same arguments
            assert [c.entry for c in turbo.calls] == [c.entry for c in local_calls]
            for mine, theirs in zip(turbo.calls, local_calls):
                assert {n: a for n, a in mine.args.items() if not isinstance(a, torch.Tensor)} == \
                       {n: a for n, a in theirs.args.items() if not isinstance(a, torch.Tensor)}
    assert torch.equal(got, want)
    for g, w in zip(got_grads, want_grads):
        assert torch.equal(g, w)
    # ...and both are the attention they claim to be (window (3, 0) on layer 1 for the sink variant).
    left = 3 if variant == "sink-window" else -1
    sink_list = sink.tolist() if sink is not None else None
    if layout == "sbhd":
        ref = oracle.attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), oracle.window(left, 0),
                               sink=sink_list).transpose(0, 1).reshape(want.shape)
    else:
        ref = oracle.packed_attention(q, k, v, [0, 5, 12], left, 0, sink=sink_list).reshape(want.shape)
    torch.testing.assert_close(want.double(), ref, atol=1e-5, rtol=1e-5)


# -------------------------------------------------------------------- same refusals
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_same_build_time_refusals_with_the_same_wording(te, case: Case):
    common = dict(config=case.config(), layer_number=1, attn_mask_type=case.mask_type, attention_type="self")
    with maybe_fake(case.fake):
        local = refusal(lambda: PrimusTurboLocalAttention(settings=case.settings(), **common))
        module = refusal(lambda: primus_turbo_te_core_attention(case.settings())(**common))
    assert str(module) == str(local)
    assert module.settings == local.settings


def _call_refusals():
    """(id, settings keys, fake?, call) for each call-time refusal; call(module) must raise."""
    def bias(m):
        q, k, v = qkv_sbhd()
        return m(q, k, v, None, AttnMaskType.causal, attention_bias=torch.zeros(1, 4, 16, 16))

    def sbhd_with_bounds(m):
        q, k, v = qkv_sbhd()
        return m(q, k, v, None, packed_seq_params=thd_params(bounds=(0, 10, 32), fmt="sbhd"))

    def padded(m):
        q, k, v = qkv_thd()
        return m(q, k, v, None, packed_seq_params=thd_params(padded=(0, 6, 12)))

    def packed(m):
        q, k, v = gpt.fp8_tensors(*qkv_thd())
        return m(q, k, v, None, packed_seq_params=thd_params())

    return [
        ("B27-bias-flex", FLEX, False, bias),
        ("B27-bias-direct", {}, True, bias),
        ("B21-sbhd-with-cu-seqlens", FLEX, False, sbhd_with_bounds),
        ("B19-padded-flex", FLEX, False, padded),
        ("B19-padded-direct", {}, True, padded),
        ("packed-on-fp8-direct", {"enable_turbo_attention_float8": True}, True, packed),
    ]


CALL_REFUSALS = _call_refusals()


@pytest.mark.parametrize("keys, fake, call", [c[1:] for c in CALL_REFUSALS], ids=[c[0] for c in CALL_REFUSALS])
def test_same_call_time_refusals_with_the_same_wording(te, keys, fake, call):
    with maybe_fake(fake):
        # fp8 attention builds on bf16 layers with head dims of 32 and more only (docs/refusals.md: fp8-*)
        local, module = build_pair(gpt.settings(**keys), gpt.fp8_config() if keys.get("enable_turbo_attention_float8")
                                   else None)
        want = refusal(lambda: call(local), UnsupportedInputError)
        got = refusal(lambda: call(module), UnsupportedInputError)
    assert str(got) == str(want)
    assert got.settings == want.settings


# ------------------------------------------------------------------ import and model
def test_primus_ext_imports_without_transformer_engine():
    """In a fresh interpreter where TE cannot be imported, the package and its Megatron part load."""
    script = textwrap.dedent("""
        import sys, warnings
        warnings.simplefilter("ignore")

        class NoTransformerEngine:
            def find_spec(self, name, path=None, target=None):
                if name == "transformer_engine" or name.startswith("transformer_engine."):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, NoTransformerEngine())
        import primus_ext, primus_ext.megatron
        assert primus_ext.megatron.PrimusTurboLocalAttention is not None
        leaked = sorted(k for k in sys.modules if k.startswith("transformer_engine"))
        assert not leaked, leaked
        try:
            primus_ext.megatron.PrimusTurboAttention
        except ModuleNotFoundError as exc:
            assert exc.name == "transformer_engine", exc
        else:
            raise AssertionError("PrimusTurboAttention resolved without TransformerEngine")
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")


def build_gpt_with_spec(layer_spec: Any, *, seed: int = 0) -> GPTModel:
    torch.manual_seed(seed)
    return GPTModel(config=gpt.config(), transformer_layer_spec=layer_spec, vocab_size=gpt.VOCAB,
                    max_sequence_length=gpt.SEQ * 4, position_embedding_type="learned_absolute")


def test_gpt_model_with_te_core_attention_trains_like_the_local_one(te):
    turbo = gpt.settings(**FLEX, use_sink_attention=True, sink_sliding_window=4, sink_window_even_layers_only=True)
    spec = use_core_attention(get_gpt_layer_local_spec(), primus_turbo_te_core_attention(turbo))
    model = build_gpt_with_spec(spec)
    modules = gpt.attention_modules(model)
    assert all(isinstance(m, te.DotProductAttention) for m in modules)
    assert [m.plan.window for m in modules] == [(4, 0), (-1, -1)]
    data = gpt.batches(2)
    losses = gpt.train(model, data)
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert all(m.softmax_offset.grad is not None and m.softmax_offset.grad.abs().sum() > 0 for m in modules)

    reference = gpt.train(gpt.build_gpt(turbo), data)  # same seed, local module
    assert losses == reference
