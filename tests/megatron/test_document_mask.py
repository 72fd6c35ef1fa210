"""reset_attention_mask with no conversion: the layer reads the documents from Megatron's dense mask.

Held to megatron-core itself: the masks come from ``_get_ltor_masks_and_position_ids`` (the
function Megatron's datasets build them with), and a training step to the same GPT whose core
attention applies that dense mask with a float64 softmax written here (`DenseMaskAttention`).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType

from primus_ext.errors import UnsupportedConfigError, UnsupportedInputError
from primus_ext.megatron import PrimusTurboLocalAttention, document_mask, pack_eod_micro_batch
from primus_ext.plan import build_plan
from primus_ext.plan.facts import LayerFacts
from primus_ext.testing import fake_primus_turbo
from primus_ext.testing.counting import count_copies_and_syncs
from tests.megatron import gpt
from tests.megatron.test_eod_packing import (BATCHES, EOD, PATHS, as_megatron_gives_it, assert_steps_match_megatron,
                                            dense_mask_gpt, megatron_rows)

B, S = BATCHES[0].shape


def _dense_cfg(**overrides):
    return gpt.config(kv_channels=16, **overrides)  # packed_sequences unset: dense batches (or thd)


@pytest.mark.parametrize("tokens", BATCHES, ids=["docs-and-one-doc-row", "eod-edges"])
def test_boundaries_are_megatrons_documents(tokens):
    mask, _, _ = megatron_rows(tokens)
    cu = document_mask.document_boundaries(mask, B, S, S)
    want = pack_eod_micro_batch(tokens, eod_token=EOD, max_documents=B * S).packed_seq_params.cu_seqlens_q
    assert cu.dtype == torch.int32 and torch.equal(cu, want)


def test_the_derivation_and_check_read_nothing_on_the_host():
    mask, _, _ = megatron_rows(BATCHES[1])
    with count_copies_and_syncs() as counts:
        document_mask.document_boundaries(mask.clone(), B, S, S)
    assert counts.syncs == 0, counts.summary()


@pytest.mark.parametrize("declared", [None, False], ids=["packing-unset", "dense-only"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_training_on_the_dense_mask_equals_megatrons_dense_mask(path, declared):
    dense = dense_mask_gpt(_dense_cfg())
    with fake_primus_turbo() as fake:
        model = gpt.build_gpt(gpt.settings(reset_attention_mask=True, packed_sequences=declared, **PATHS[path]),
                              _dense_cfg(), seq=S).double()
        model.load_state_dict(dense.state_dict())
        assert_steps_match_megatron(model, dense, as_megatron_gives_it)
    assert all(m.core.plan.mask_documents for m in gpt.attention_modules(model))
    if path != "flex-reference":
        assert fake.calls and {c.entry for c in fake.calls} == {"flash_attn_varlen_func"}


def _layer(path="flex-turbo", cfg=None, **keys):
    return PrimusTurboLocalAttention(cfg or _dense_cfg(), 1, AttnMaskType.causal, "self",
                                     settings=gpt.settings(reset_attention_mask=True, **PATHS[path], **keys))


def _qkv(batch=B, seq=S):
    torch.manual_seed(1)
    return [torch.randn(seq, batch, n, 16) for n in (4, 2, 2)]


def test_a_document_bound_fixes_the_boundaries_and_more_documents_are_refused():
    mask, _, _ = megatron_rows(BATCHES[0])  # 4 documents: three in row 0, one in row 1
    cu = document_mask.document_boundaries(mask, B, S, S, max_documents=4)
    want = pack_eod_micro_batch(BATCHES[0], eod_token=EOD, max_documents=4).packed_seq_params.cu_seqlens_q
    assert torch.equal(cu, want)
    with fake_primus_turbo():
        layer, exact = _layer(reset_attention_mask_max_documents=5), _layer()
        q, k, v = _qkv()
        torch.testing.assert_close(layer(q, k, v, mask), exact(q, k, v, mask))
        with pytest.raises(UnsupportedInputError) as err:
            _layer(reset_attention_mask_max_documents=3)(q, k, v, mask)
    assert "B25.max-documents-mask" in err.value.codes and "reset_attention_mask_max_documents" in err.value.settings


def test_each_mask_tensor_is_derived_and_checked_once_for_every_layer():
    mask, _, _ = megatron_rows(BATCHES[0])
    with fake_primus_turbo():
        layers = [_layer() for _ in range(3)]
        with mock.patch.object(document_mask, "assert_on_device", wraps=document_mask.assert_on_device) as checks:
            for layer in layers:
                layer(*_qkv(), mask)
            assert checks.call_count == 1
            mask[1, 0, 5, 3] = True  # an in-place write: the next call derives and checks again
            with pytest.raises(UnsupportedInputError) as err:
                layers[0](*_qkv(), mask)
            assert checks.call_count == 2 and "B25.mask-values" in err.value.codes


def _causal(batch=B, seq=S):
    return torch.ones(seq, seq, dtype=torch.bool).triu(1).expand(batch, 1, seq, seq).clone()


@pytest.mark.parametrize("max_documents", [None, 4])
@pytest.mark.parametrize("path", ["flex-turbo", "flex-reference"])
def test_a_micro_batch_without_tokens_is_the_empty_result_not_a_refusal(path, max_documents):
    """Found by the long fuzz profile: with no token, the document count was held to a bound of 0 and refused."""
    cu = document_mask.document_boundaries(_causal(B, 0), B, 0, 0, max_documents)
    assert cu.dtype == torch.int32 and cu.tolist() == [0] * ((max_documents or B) + 1)
    with fake_primus_turbo():
        layer = _layer(path, reset_attention_mask_max_documents=max_documents)
        q, k, v = _qkv(seq=0)
        out = layer(q, k, v, _causal(B, 0))
    assert out.shape[0] == 0 and out.numel() == 0


@pytest.mark.parametrize("max_documents", [None, 4])
@pytest.mark.parametrize("path", ["flex-turbo", "flex-reference"])
def test_a_micro_batch_of_no_row_is_the_empty_result_not_a_refusal(path, max_documents):
    """Found by the long fuzz profile (batch size 0, sequence 1): the boundaries of no row were one entry, [0],
    which the varlen check refuses as a malformed cu_seqlens_q; no row is one empty document, [0, 0]."""
    cu = document_mask.document_boundaries(_causal(0, 1), 0, 1, 1, max_documents)
    assert cu.dtype == torch.int32 and cu.numel() >= 2 and not cu.any()
    with fake_primus_turbo():
        layer = _layer(path, reset_attention_mask_max_documents=max_documents)
        q, k, v = _qkv(batch=0, seq=1)
        out = layer(q, k, v, _causal(0, 1))
    assert out.shape == (1, 0, 64) and out.numel() == 0


def test_a_plain_causal_mask_is_one_document_per_row():
    with fake_primus_turbo():
        layer = _layer()
        ref = _layer("flex-reference")
        q, k, v = _qkv()
        torch.testing.assert_close(layer(q, k, v, _causal()), ref(q, k, v, _causal()))
        cu = document_mask.document_boundaries(_causal(), B, S, S)
        assert cu[:3].tolist() == [0, S, 2 * S] and (cu[3:] == B * S).all()


def _bidirectional_prefix():
    mask = _causal()
    mask[:, :, :4, :4] = False  # a prefix-LM: the first four tokens see each other
    return mask


def _padding():
    mask = _causal()
    mask[:, :, :, 12:] = True  # keys 12.. padded out, every query
    return mask


@pytest.mark.parametrize("make,code", [
    (lambda: None, "B25.no-mask"),
    (lambda: _causal().float(), "B25.mask-shape"),
    (lambda: _causal()[:, :, :, :8], "B25.mask-shape"),
    (lambda: _causal(batch=3), "B25.mask-shape"),
    (_bidirectional_prefix, "B25.mask-values"),
    (_padding, "B25.mask-values"),
    (lambda: torch.zeros(B, 1, S, S, dtype=torch.bool), "B25.mask-values"),
], ids=["missing", "float", "short", "batch", "prefix-lm", "padding", "no-mask-at-all"])
def test_anything_but_a_document_mask_is_refused_with_our_error(make, code):
    with fake_primus_turbo():
        layer = _layer()
        with pytest.raises(UnsupportedInputError) as err:
            layer(*_qkv(), make())
    assert code in err.value.codes
    assert "reset_attention_mask" in err.value.settings


def _facts(**overrides):
    base = dict(layer_number=1, num_heads=4, num_kv_heads=2, head_dim=16, head_dim_v=16, causal=True,
                turbo_module=True, megatron_mask=True)
    base.update(overrides)
    return LayerFacts(**base)


@pytest.mark.parametrize("keys,facts,code", [
    (dict(), dict(context_parallel_size=2), "B25"),
    (dict(turbo_flex_attention_mask_mod="primus_ext.attention.masks:causal",
          turbo_flex_attention_mask_mod_kwargs={}), dict(), "B25-layer"),
    (dict(), dict(causal=False, attn_mask_type="no_mask"), "B25-layer"),
    (dict(packed_equal_documents=True), dict(), "B25-layer"),
], ids=["context-parallel", "hook", "not-causal", "equal-documents"])
def test_where_the_mask_cannot_run_on_the_varlen_kernel_the_build_refuses(keys, facts, code):
    with fake_primus_turbo():
        with pytest.raises(UnsupportedConfigError) as err:
            build_plan(gpt.settings(reset_attention_mask=True, use_turbo_flex_attention=True,
                                    turbo_flex_attention_backend="turbo", **keys), _facts(**facts))
    assert code in err.value.codes and "reset_attention_mask" in err.value.settings


def test_the_plan_says_where_the_documents_come_from():
    with fake_primus_turbo():
        plan = _layer().core.plan
    assert plan.mask_documents and not plan.eod_documents
    assert "documents from attention_mask" in plan.describe()


def test_a_flash_style_dense_call_on_such_a_plan_is_refused_not_run_without_documents():
    from primus_ext.call import TurboFlexAttention

    with fake_primus_turbo():
        plan = build_plan(gpt.settings(reset_attention_mask=True, use_turbo_flex_attention=True,
                                       turbo_flex_attention_backend="turbo"), _facts())
        q = torch.randn(1, S, 4, 16)
        with pytest.raises(UnsupportedInputError) as err:
            TurboFlexAttention(plan)(q, q[:, :, :2], q[:, :, :2], causal=True)
    assert plan.mask_documents and "B25.no-mask" in err.value.codes


def test_a_thd_call_on_a_dense_only_document_mask_layer_is_refused():
    with fake_primus_turbo():
        layer = _layer(packed_sequences=False)
        q, k, v = (torch.randn(B * S, n, 16) for n in (4, 2, 2))
        cu = torch.tensor([0, S, B * S], dtype=torch.int32)
        with pytest.raises(UnsupportedInputError) as err:
            layer(q, k, v, None, packed_seq_params=gpt.thd_params(cu))
    assert "B34.packed-call" in err.value.codes
