"""reset_attention_mask inside (a stand-in of) Primus, with no code edit: Primus's lifecycle builds the
GPT through the patch, Megatron's batches keep their dense document mask, and training equals
megatron-core's own dense-mask model step by step (`tests/megatron/test_document_mask.py` holds the
layer itself to the same)."""

from __future__ import annotations

import pytest

from primus_ext.megatron import PrimusTurboLocalAttention
from primus_ext.testing import fake_primus_turbo
from tests.megatron import gpt
from tests.megatron.test_eod_packing import S, as_megatron_gives_it, assert_steps_match_megatron, dense_mask_gpt
from tests.megatron.test_primus_patch import MODULE, attention, launch

BACKENDS = ["reference", "turbo"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_eod_rows_train_as_megatrons_dense_mask_model_step_by_step(backend):
    with fake_primus_turbo() as fake:
        model = launch({**MODULE, "turbo_flex_attention_backend": backend, "reset_attention_mask": True}).double()
        assert all(isinstance(m, PrimusTurboLocalAttention) and m.core.plan.mask_documents for m in attention(model))
        dense = dense_mask_gpt(gpt.config())
        dense.load_state_dict(model.state_dict())
        assert_steps_match_megatron(model, dense, as_megatron_gives_it)  # Megatron's get_batch: the dense mask
    if backend == "turbo":
        assert {c.entry for c in fake.calls} == {"flash_attn_varlen_func"}
    assert S == gpt.SEQ
