"""reset_attention_mask inside (a stand-in of) Primus, with no code edit: Primus's lifecycle builds the
GPT through the patch, Megatron's batches keep their dense document mask, and training equals
megatron-core's own dense-mask model step by step (`tests/megatron/test_document_mask.py` holds the
layer itself to the same)."""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

from primus_ext.megatron import PrimusTurboLocalAttention, use_core_attention
from primus_ext.testing import fake_primus_turbo
from tests.megatron import gpt
from tests.megatron.test_eod_packing import BATCHES, S, DenseMaskAttention, _step, megatron_rows
from tests.megatron.test_primus_patch import MODULE, attention, launch

BACKENDS = ["reference", "turbo"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_eod_rows_train_as_megatrons_dense_mask_model_step_by_step(backend):
    with fake_primus_turbo() as fake:
        model = launch({**MODULE, "turbo_flex_attention_backend": backend, "reset_attention_mask": True}).double()
        assert all(isinstance(m, PrimusTurboLocalAttention) and m.core.plan.mask_documents for m in attention(model))
        torch.manual_seed(0)
        dense = GPTModel(config=gpt.config(), transformer_layer_spec=use_core_attention(
            get_gpt_layer_local_spec(), DenseMaskAttention), vocab_size=gpt.VOCAB,
            max_sequence_length=gpt.SEQ * 4, position_embedding_type="learned_absolute").double()
        dense.load_state_dict(model.state_dict())
        for tokens in BATCHES:
            labels = torch.roll(tokens, -1, dims=1)
            mask, loss_mask, pos = megatron_rows(tokens)  # Megatron's get_batch: the dense mask, as built
            want_loss, want_grads = _step(dense, tokens, pos, labels, loss_mask.double(), mask=mask)
            got_loss, got_grads = _step(model, tokens, pos, labels, loss_mask.double(), mask=mask)
            assert abs(got_loss - want_loss) <= 1e-10 * abs(want_loss), (got_loss, want_loss)
            for name, grad in want_grads.items():
                torch.testing.assert_close(got_grads[name], grad, rtol=1e-9, atol=1e-11, msg=name)
    if backend == "turbo":
        assert {c.entry for c in fake.calls} == {"flash_attn_varlen_func"}
    assert S == gpt.SEQ
