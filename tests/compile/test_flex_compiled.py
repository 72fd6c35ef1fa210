"""The ``flex`` backend under ``torch.compile``: megatron-core blocks and layers compiled with ``fullgraph=True``.

A compiled layer calls attention through the ``primus_ext`` custom op (`primus_ext.call.ops`), whose
implementation runs eagerly below the dispatch keys of the compiled graph; torch's FlexAttention vmaps the
hook there (`primus_ext.backends.dispatch_keys` puts those keys back).  What is proved here, on CPU:

* packed micro-batches of 1 to 8 documents (20 document splits) and dense calls whose documents come
  in Megatron's mask (``reset_attention_mask``, 20 document counts): no graph break (``fullgraph``), at
  most one recompile, the same outputs as eager; forward through torch's real flex_attention, and
  forward and backward (input, weights, sinks) through the autograd stand-in with flex_attention's
  contract (torch has no CPU backward for flex_attention);
* a hook reading a captured document-id tensor: updated in place between compiled calls, the BlockMask is
  built again (counted) with no recompile, and the output follows the new ids;
* a layer compiled with inductor (not only ``aot_eager``) equals eager.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType
from torch._dynamo.backends.debugging import aot_eager
from torch._dynamo.testing import CompileCounter

import primus_ext.call.adapter as adapter_module
from primus_ext.backends import make_backend
from primus_ext.backends.flex import FlexBackend
from primus_ext.backends.flex_cache import BLOCK_MASKS
from primus_ext.errors import UnsupportedInputError
from primus_ext.megatron import PrimusTurboLocalAttention, get_gpt_layer_primus_turbo_local_spec

from .. import flex_hooks
from ..flex_standin import flex_standin
from ..megatron import gpt
from .test_compiled_layer import megatron_without_tp_group_warning  # noqa: F401  (fixture)
from .test_compiled_layer import (AotEager, assert_matches, breaks, hidden, micro_batches, packed_params, run_block,
                                  train_step)
from .test_document_mask import B, S, _masks

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
FLEX = dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="flex")


@pytest.fixture
def standin(monkeypatch):
    """Layers built now run the flex backend over the autograd stand-in (gradients on CPU)."""
    def backend(name: str):
        return FlexBackend(kernel=flex_standin) if name == "flex" else make_backend(name)
    monkeypatch.setattr(adapter_module, "make_backend", backend)


def _block(**keys):
    from megatron.core.transformer.transformer_block import TransformerBlock

    torch.manual_seed(0)
    spec = get_gpt_layer_primus_turbo_local_spec(gpt.settings(**keys))
    return TransformerBlock(gpt.config(num_layers=2), spec)


SINK_WINDOW = dict(use_sink_attention=True, sink_sliding_window=4, sink_window_even_layers_only=True)


@pytest.mark.parametrize("kernel", ["torch", "standin"])
def test_packed_document_splits_compile_once_and_match_eager(kernel, request, megatron_without_tp_group_warning):
    """20 packed rows of 48 tokens, 1 to 8 documents, two layers (sinks; one with a causal window)."""
    grads = kernel == "standin"
    if grads:
        request.getfixturevalue("standin")
    block = _block(**FLEX, **SINK_WINDOW)
    assert {layer.self_attention.core_attention.plan.backend for layer in block.layers} == {"flex"}
    reference = _block(**dict(FLEX, turbo_flex_attention_backend="reference"), **SINK_WINDOW)
    reference.load_state_dict(block.state_dict())
    x = hidden("thd")
    report = breaks(run_block(block), x, packed_params(micro_batches()[0]))
    assert (report.graph_break_count, report.graph_count) == (0, 1), report.break_reasons
    torch._dynamo.reset()
    backend = AotEager()
    compiled = torch.compile(run_block(block), fullgraph=True, backend=backend)
    for i, bounds in enumerate(micro_batches()):
        if grads:
            assert_matches(train_step(compiled, block, x, packed_params(bounds)),
                           train_step(run_block(reference), reference, x, packed_params(bounds)), f"row {i}")
        else:
            with torch.no_grad():
                got = compiled(x, packed_params(bounds))
                want = run_block(reference)(x, packed_params(bounds))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert backend.frame_count <= 2, f"{backend.frame_count - 1} recompiles over 20 document splits"
    assert backend.ops_in("forward") == {"primus_ext.varlen_attention.default": 2}


def _mask_layer(backend: str):
    torch.manual_seed(0)
    return PrimusTurboLocalAttention(gpt.config(kv_channels=16), 1, AttnMaskType.causal, "self",
                                     settings=gpt.settings(reset_attention_mask=True, use_sink_attention=True,
                                                           **dict(FLEX, turbo_flex_attention_backend=backend)))


@pytest.mark.parametrize("kernel", ["torch", "standin"])
def test_twenty_document_counts_in_megatrons_mask_compile_once(kernel, request):
    grads = kernel == "standin"
    if grads:
        request.getfixturevalue("standin")
    layer, reference = _mask_layer("flex"), _mask_layer("reference")
    assert layer.plan.backend == "flex" and layer.plan.mask_documents
    reference.load_state_dict(layer.state_dict())
    counter = CompileCounter()
    compiled = torch.compile(layer, backend=lambda gm, ex: (counter(gm, ex), aot_eager(gm, ex))[1], fullgraph=True)
    torch.manual_seed(2)
    for mask in _masks(20):
        q, k, v = (torch.randn(S, B, n, 16, requires_grad=grads) for n in (4, 2, 2))
        with torch.set_grad_enabled(grads):
            got = compiled(q, k, v, mask)
            want = reference(q, k, v, mask)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if grads:
            mine = torch.autograd.grad(got.sum(), (q, k, v, layer.softmax_offset))
            theirs = torch.autograd.grad(want.sum(), (q, k, v, reference.softmax_offset))
            for a, b in zip(mine, theirs):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1


def test_a_captured_tensor_updated_in_place_rebuilds_without_a_recompile():
    keys = dict(FLEX, turbo_flex_attention_mask_mod="tests.flex_hooks:document_ids")
    seq = len(flex_hooks.DOC_IDS)
    layers = [PrimusTurboLocalAttention(gpt.config(kv_channels=16), 1, AttnMaskType.causal, "self",
                                        settings=gpt.settings(**dict(keys, turbo_flex_attention_backend=b)))
              for b in ("flex", "reference")]
    assert [layer.plan.backend for layer in layers] == ["flex", "reference"]
    counter = CompileCounter()
    compiled = torch.compile(layers[0], backend=lambda gm, ex: (counter(gm, ex), aot_eager(gm, ex))[1],
                             fullgraph=True)
    q, k, v = (torch.randn(seq, 2, n, 16, generator=torch.Generator().manual_seed(n)) for n in (4, 2, 2))
    saved = flex_hooks.DOC_IDS.clone()
    BLOCK_MASKS.clear()
    builds = []
    try:
        with torch.no_grad():
            for step in range(4):
                if step == 2:
                    flex_hooks.DOC_IDS[:24] = torch.arange(24) // 6  # other documents, the same tensor
                got = compiled(q, k, v, None)
                builds.append(BLOCK_MASKS.builds)
                torch.testing.assert_close(got, layers[1](q, k, v, None), rtol=1e-5, atol=1e-5)
    finally:
        flex_hooks.DOC_IDS.copy_(saved)
        BLOCK_MASKS.clear()
    assert builds == [1, 1, 2, 2], builds
    assert counter.frame_count == 1


def test_a_layer_compiled_with_inductor_equals_eager():
    layer, reference = _mask_layer("flex"), _mask_layer("reference")
    reference.load_state_dict(layer.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = torch.compile(layer, fullgraph=True)
        with torch.no_grad():
            for mask in _masks(4):
                q, k, v = (torch.randn(S, B, n, 16) for n in (4, 2, 2))
                torch.testing.assert_close(compiled(q, k, v, mask), reference(q, k, v, mask), rtol=1e-5, atol=1e-5)


def test_a_compiled_cpu_backward_through_torchs_flex_attention_is_our_refusal():
    """The compiled forward runs (its op records no graph); the backward op's recompute needs flex_attention's
    CPU backward, which torch lacks: refused with our error, not torch's NotImplementedError."""
    layer = _mask_layer("flex")
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    q, k, v = (torch.randn(S, B, n, 16, requires_grad=True) for n in (4, 2, 2))
    out = compiled(q, k, v, _masks(3)[2])
    with pytest.raises(UnsupportedInputError) as err:
        out.sum().backward()
    assert "B34.flex-cpu-grad" in err.value.codes
