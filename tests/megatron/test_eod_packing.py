"""reset_attention_mask through `pack_eod_micro_batch`: EOD documents in [B, S] micro-batches run as THD.

Held to Megatron's own definitions: positions and loss mask to
``megatron.core.datasets.gpt_dataset._get_ltor_masks_and_position_ids``, and a training step
to the same GPT whose core attention applies that function's dense document mask with a
dense float64 softmax written here.
"""

from __future__ import annotations

import math

import pytest
import torch
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids as megatron_ltor
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.module import MegatronModule

from primus_ext.errors import UnsupportedConfigError, UnsupportedInputError
from primus_ext.megatron import pack_eod_micro_batch, use_core_attention
from primus_ext.testing import fake_primus_turbo
from primus_ext.testing.counting import count_copies_and_syncs
from tests.megatron import gpt

EOD = 0
S, B = 16, 2
# Row 0: three documents (EOD at 4 and 9); row 1: one document with no EOD at all, then a
# batch whose row ends on an EOD and whose next row starts with one.
BATCHES = [
    torch.tensor([[3, 5, 7, 2, EOD, 4, 4, 6, 1, EOD, 8, 9, 2, 3, 5, 7],
                  [6, 2, 9, 9, 3, 1, 4, 8, 2, 6, 5, 3, 7, 1, 9, 4]]),
    torch.tensor([[EOD, 5, 7, 2, 2, 1, 3, 3, 6, 7, EOD, 8, 9, EOD, 5, EOD],
                  [EOD, EOD, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 7]]),
]


def megatron_rows(tokens: torch.Tensor):
    """Megatron's (mask [B,1,S,S] True = masked, loss mask, positions) for reset_attention_mask."""
    masks, losses, positions = [], [], []
    for row in tokens:
        mask, loss, pos = megatron_ltor(row, EOD, True, True, True, True)
        masks.append(mask)
        losses.append(loss)
        positions.append(pos)
    return torch.stack(masks), torch.stack(losses), torch.stack(positions)


@pytest.mark.parametrize("tokens", BATCHES, ids=["docs-and-one-doc-row", "eod-edges"])
def test_positions_and_loss_mask_equal_megatrons(tokens):
    packed = pack_eod_micro_batch(tokens, eod_token=EOD, max_documents=12, eod_mask_loss=True)
    _, loss, pos = megatron_rows(tokens)
    assert torch.equal(packed.position_ids.reshape(B, S), pos)
    assert torch.equal(packed.loss_mask.reshape(B, S), loss)
    cu = packed.packed_seq_params.cu_seqlens_q
    assert cu.dtype == torch.int32 and cu.shape == (13,) and int(cu[-1]) == B * S
    assert packed.packed_seq_params.max_seqlen_q == S


def test_more_documents_than_the_bound_are_refused_never_merged():
    with pytest.raises(UnsupportedInputError, match="max_documents=3") as err:
        pack_eod_micro_batch(BATCHES[0], eod_token=EOD, max_documents=3)
    assert "max_documents" in err.value.settings
    pack_eod_micro_batch(BATCHES[0], eod_token=EOD, max_documents=4)  # exactly 4 documents


def test_the_conversion_reads_nothing_on_the_host():
    tokens = BATCHES[1]
    with count_copies_and_syncs() as counts:
        pack_eod_micro_batch(tokens, eod_token=EOD, max_documents=12)
    assert counts.syncs == 0, counts.summary()


class DenseMaskAttention(MegatronModule):
    """Core attention applying Megatron's dense mask: float64 softmax, written here."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        q, k, v = (t.permute(1, 2, 0, 3).double() for t in (query, key, value))  # [B, H, S, D]
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(attention_mask, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1).to(query.dtype)


def _cfg():
    cfg = gpt.config(kv_channels=16)
    cfg.packed_sequences = True  # read by the plan: batches arrive packed (THD)
    return cfg


def _step(model, tokens, positions, labels, loss_mask, mask=None, params=None):
    model.zero_grad(set_to_none=True)
    per_token = model(tokens, positions, mask, labels=labels, packed_seq_params=params)
    loss = (per_token.double() * loss_mask).sum() / loss_mask.sum()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


PATHS = {
    "flex-reference": dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="reference"),
    "flex-turbo": dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="turbo"),
    "direct": dict(use_turbo_flex_attention=False),
}


def dense_mask_gpt(cfg) -> GPTModel:
    """The float64 GPT whose core attention applies Megatron's dense mask (`DenseMaskAttention`)."""
    torch.manual_seed(0)
    return GPTModel(config=cfg, transformer_layer_spec=use_core_attention(get_gpt_layer_local_spec(),
                                                                         DenseMaskAttention),
                    vocab_size=gpt.VOCAB, max_sequence_length=S * 4,
                    position_embedding_type="learned_absolute").double()


def assert_steps_match_megatron(model, dense, feed) -> None:
    """For every batch of `BATCHES`: one step of ``model`` on what ``feed(tokens, labels, loss_mask,
    positions, mask)`` gives (``(tokens, positions, labels, loss_mask, mask, params)``) has the loss
    and gradients of one step of ``dense`` on Megatron's own rows and dense mask."""
    for tokens in BATCHES:
        labels = torch.roll(tokens, -1, dims=1)
        mask, loss_mask, pos = megatron_rows(tokens)
        want_loss, want_grads = _step(dense, tokens, pos, labels, loss_mask.double(), mask=mask)
        t, p, lab, weights, m, params = feed(tokens, labels, loss_mask, pos, mask)
        got_loss, got_grads = _step(model, t, p, lab, weights.double(), mask=m, params=params)
        assert abs(got_loss - want_loss) <= 1e-10 * abs(want_loss), (got_loss, want_loss)
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=1e-9, atol=1e-11, msg=name)


def _converted(tokens, labels, loss_mask, positions, mask):
    batch = pack_eod_micro_batch(tokens, eod_token=EOD, max_documents=12, labels=labels, loss_mask=loss_mask)
    return batch.tokens, batch.position_ids, batch.labels, batch.loss_mask, None, batch.packed_seq_params


def as_megatron_gives_it(tokens, labels, loss_mask, positions, mask):
    """The rows as Megatron's get_batch hands them over, dense mask and all (no conversion)."""
    return tokens, positions, labels, loss_mask, mask, None


@pytest.mark.parametrize("path", sorted(PATHS))
def test_training_through_the_conversion_equals_megatrons_dense_mask(path):
    dense = dense_mask_gpt(_cfg())
    with fake_primus_turbo() as fake:
        packed_model = gpt.build_gpt(gpt.settings(reset_attention_mask=True, **PATHS[path]), _cfg(), seq=S).double()
        packed_model.load_state_dict(dense.state_dict())
        assert_steps_match_megatron(packed_model, dense, _converted)
    if path != "flex-reference":
        assert {c.entry for c in fake.calls} == {"flash_attn_varlen_func"}


def test_reset_attention_mask_takes_converted_or_dense_batches_as_declared():
    from primus_ext.megatron import PrimusTurboLocalAttention
    from megatron.core.transformer.enums import AttnMaskType

    with fake_primus_turbo():
        dense = PrimusTurboLocalAttention(gpt.config(kv_channels=16), 1, AttnMaskType.causal, "self",
                                          settings=gpt.settings(reset_attention_mask=True))
        layer = PrimusTurboLocalAttention(_cfg(), 1, AttnMaskType.causal, "self",
                                          settings=gpt.settings(reset_attention_mask=True))
    assert layer.core.plan.eod_documents and not layer.core.plan.mask_documents
    assert dense.core.plan.mask_documents and not dense.core.plan.eod_documents  # tests/megatron/test_document_mask.py
