"""A 24-layer megatron-core GPT on the ``flex`` backend builds one BlockMask per forward step per hook.

Every layer's core attention reaches the process's shared cache (`primus_ext.backends.flex_cache.BLOCK_MASKS`)
with the same key (the hook, B, H, Sq, Skv, device): the first layer of the first step builds the mask and
the other 23 take it; a later step with nothing changed builds none; a step after the captured document-id
tensor the hook reads is updated in place builds exactly one more.  Packed (THD) batches alike: one document
BlockMask per step, one more for a new boundary tensor and one more when it is changed in place.  Forward only (torch's flex_attention
has no CPU backward), under ``torch.no_grad()``; the logits equal those of the same model on ``reference``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from primus_ext.backends.flex_cache import BLOCK_MASKS

from .. import flex_hooks
from . import gpt

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

LAYERS = 24
SEQ = len(flex_hooks.DOC_IDS)  # the hook indexes its captured ids by position: 48 tokens
HOOK = {"use_turbo_flex_attention": True, "turbo_flex_attention_mask_mod": "tests.flex_hooks:document_ids"}


def model(backend: str):
    cfg = gpt.config(num_layers=LAYERS, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8)
    return gpt.build_gpt(gpt.settings(turbo_flex_attention_backend=backend, **HOOK), cfg, seq=SEQ)


def test_24_layers_build_one_block_mask_per_step_and_rebuild_on_an_in_place_update():
    flex, reference = model("flex"), model("reference")
    assert [m.plan.backend for m in gpt.attention_modules(flex)] == ["flex"] * LAYERS
    assert [m.plan.backend for m in gpt.attention_modules(reference)] == ["reference"] * LAYERS
    tokens = gpt.batches(1, batch=2, seq=SEQ)[0]
    saved = flex_hooks.DOC_IDS.clone()
    BLOCK_MASKS.clear()
    counts = []
    try:
        for step in range(4):
            if step == 2:
                flex_hooks.DOC_IDS[:24] = torch.arange(24) // 6  # other documents, the same tensor
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = gpt.logits(flex, tokens)
            counts.append((BLOCK_MASKS.builds, BLOCK_MASKS.hits))
            if step in (0, 2):  # the documents as they are now
                torch.testing.assert_close(got, gpt.logits(reference, tokens), rtol=1e-5, atol=1e-5)
    finally:
        flex_hooks.DOC_IDS.copy_(saved)
        BLOCK_MASKS.clear()
    per_step = LAYERS - 1
    assert counts == [(1, per_step), (1, per_step + LAYERS), (2, 2 * per_step + LAYERS),
                      (2, 2 * per_step + 2 * LAYERS)], counts


def test_24_packed_layers_build_one_document_block_mask_per_step_and_rebuild_on_new_boundaries():
    """Packed (THD) batches: the document BlockMask follows the boundary tensor (identity and version)."""
    def packed_model(backend: str):
        cfg = gpt.config(num_layers=LAYERS, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8)
        keys = dict(use_turbo_flex_attention=True, turbo_flex_attention_backend=backend, packed_sequences=True)
        return gpt.build_gpt(gpt.settings(**keys), cfg, seq=SEQ)

    flex, reference = packed_model("flex"), packed_model("reference")
    tokens, positions, cu, _ = gpt.pack(gpt.documents([10, 20, 18]))
    other = torch.tensor([0, 24, 48], dtype=torch.int32)
    BLOCK_MASKS.clear()
    counts = []
    try:
        for step, bounds in enumerate([cu, cu, other, other]):
            if step == 3:
                other[1] = 30  # the same tensor, changed in place
            params = gpt.thd_params(bounds)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = gpt.logits(flex, tokens, positions, params)
            counts.append(BLOCK_MASKS.builds)
            torch.testing.assert_close(got, gpt.logits(reference, tokens, positions, params), rtol=1e-5, atol=1e-5)
    finally:
        BLOCK_MASKS.clear()
    assert counts == [1, 1, 2, 3], counts


def test_auto_on_a_cpu_builds_reference_layers_even_with_a_gpu_turbo_arch():
    """turbo_arch names the cluster's GPU (as `check --arch` plans it); built here on a CPU, the layers run the
    reference, which trains (flex would refuse the first backward)."""
    from megatron.core.transformer.enums import AttnMaskType

    from primus_ext.megatron import PrimusTurboLocalAttention
    from primus_ext.testing import fake_primus_turbo

    with fake_primus_turbo(build="main"):
        layer = PrimusTurboLocalAttention(gpt.config(kv_channels=16), 1, AttnMaskType.causal, "self",
                                          settings=gpt.settings(**HOOK, turbo_flex_attention_backend="auto",
                                                                turbo_arch="gfx942"))
    assert layer.plan.backend == "reference" and "no GPU here" in layer.plan.backend_reason
