"""THD packing through a real megatron-core GPTModel on CPU (B16, B18, B19, B30).

Megatron 0.16.1 takes a packed batch as ``input_ids [1, T]`` with ``position_ids
[1, T]`` restarting at 0 in every document and ``packed_seq_params=PackedSeqParams(
qkv_format="thd", cu_seqlens_q/kv=int32 boundaries, max_seqlen_q/kv=...)``; its
attention squeezes the batch dim so core attention sees ``[T, H, D]``.  Logits come
back ``[1, T, V]``.  A packed row must give each document exactly the logits it
gets alone.
"""

from __future__ import annotations

import pytest
import torch

from primus_ext.errors import UnsupportedInputError
from primus_ext.testing.fake_turbo import fake_primus_turbo

from . import gpt

LENGTHS = (5, 11, 7)
LAYERS = 2
HEADS = 4

PATHS = {
    "flex-reference": (dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="reference"), None),
    "flex-turbo": (dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="turbo"),
                   "flash_attn_varlen_func"),
    "direct": (dict(use_turbo_flex_attention=False), "flash_attn_varlen_func"),
}


def packed_batch():
    docs = gpt.documents(LENGTHS)
    tokens, pos, cu, _ = gpt.pack(docs)
    return docs, tokens, pos, cu


def separately(model, docs) -> torch.Tensor:
    return torch.cat([gpt.logits(model, doc) for doc in docs], dim=1)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_packed_documents_give_the_logits_of_separate_runs(path):
    keys, entry = PATHS[path]
    docs, tokens, pos, cu = packed_batch()
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 5, 16, 23]
    with fake_primus_turbo() as fake:
        model = gpt.build_gpt(gpt.settings(**keys))
        packed = gpt.logits(model, tokens, pos, gpt.thd_params(cu))
        packed_calls = list(fake.calls)
        alone = separately(model, docs)
        fake.reset()
        # Without the boundaries the same row is one long causal sequence.
        unpacked = gpt.logits(model, tokens, pos)

    assert packed.shape == (1, sum(LENGTHS), gpt.VOCAB)
    diff = (packed - alone).abs().max().item()
    assert diff < 1e-5, f"packed vs separate documents differ by {diff}"
    first = LENGTHS[0]
    assert (unpacked[:, first:] - alone[:, first:]).abs().max() > 1e-3, \
        "the document boundaries made no difference; the test would prove nothing"

    if entry is None:
        assert packed_calls == []
        return
    assert [c.entry for c in packed_calls] == [entry] * LAYERS
    for call in packed_calls:
        assert call.args["cu_seqlens_q"] is cu and call.args["cu_seqlens_k"] is cu
        assert (call.args["max_seqlen_q"], call.args["max_seqlen_k"]) == (max(LENGTHS), max(LENGTHS))
        assert call.args["causal"] is True and tuple(call.args["window_size"]) == (-1, -1)
        q = call.args.get("q", call.args.get("query"))
        assert q.shape == (sum(LENGTHS), HEADS, 16)  # thd


@pytest.mark.parametrize("path", ["flex-turbo", "direct"])
def test_packed_training_step_has_the_gradients_of_separate_documents(path):
    keys, entry = PATHS[path]
    docs, tokens, pos, cu = packed_batch()
    with fake_primus_turbo() as fake:
        model = gpt.build_gpt(gpt.settings(**keys))
        model.train()
        model(tokens, pos, None, labels=tokens, packed_seq_params=gpt.thd_params(cu)).sum().backward()
        packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        assert [c.entry for c in fake.calls] == [entry] * LAYERS
        model.zero_grad()
        for doc in docs:
            model(doc, gpt.positions(doc), None, labels=doc).sum().backward()
    for name, param in model.named_parameters():
        # Bias gradients sum over every token (|grad| ~ 8 here): one batch vs one call per document
        # sums in another order, ~2e-7 relative in float32.
        torch.testing.assert_close(packed_grads[name], param.grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("which", ["q", "kv"])
def test_padded_boundaries_that_differ_are_refused(path, which):
    """B19: the kernels take one pair of boundaries; per-document padding would be attended."""
    keys, _ = PATHS[path]
    docs = gpt.documents(LENGTHS)
    tokens, pos, cu, cu_padded = gpt.pack(docs, pad_to=4)
    assert cu.tolist() == [0, 5, 16, 23] and cu_padded.tolist() == [0, 8, 20, 28]
    name = f"cu_seqlens_{which}_padded"
    with fake_primus_turbo() as fake:
        model = gpt.build_gpt(gpt.settings(**keys))
        # Real-token boundaries plus the padded offsets of the row on one side.
        params = gpt.thd_params(cu, **{name: cu_padded})
        with pytest.raises(UnsupportedInputError) as info:
            gpt.logits(model, tokens, pos, params)
    assert name in info.value.settings and name in str(info.value)
    assert fake.calls == [], "a kernel ran before the refusal"


@pytest.mark.parametrize("path", sorted(PATHS))
def test_padded_boundaries_equal_to_unpadded_are_accepted(path):
    keys, _ = PATHS[path]
    docs, tokens, pos, cu = packed_batch()
    with fake_primus_turbo():
        model = gpt.build_gpt(gpt.settings(**keys))
        plain = gpt.logits(model, tokens, pos, gpt.thd_params(cu))
        padded = gpt.logits(model, tokens, pos, gpt.thd_params(
            cu, cu_seqlens_q_padded=cu.clone(), cu_seqlens_kv_padded=cu.clone()))
    assert torch.equal(plain, padded)


@pytest.mark.parametrize("path", ["flex-turbo", "direct"])
def test_packed_attention_dropout_in_training_only(path):
    """B30 on the packed entries: 0.1 reaches the kernel in training, 0.0 in eval."""
    keys, entry = PATHS[path]
    _, tokens, pos, cu = packed_batch()
    with fake_primus_turbo() as fake:
        model = gpt.build_gpt(gpt.settings(**keys), gpt.config(attention_dropout=0.1))
        model.train()
        model(tokens, pos, None, labels=tokens, packed_seq_params=gpt.thd_params(cu)).sum().backward()
        assert [(c.entry, c.args["dropout_p"]) for c in fake.calls] == [(entry, 0.1)] * LAYERS
        fake.reset()
        gpt.logits(model, tokens, pos, gpt.thd_params(cu))
        assert [(c.entry, c.args["dropout_p"]) for c in fake.calls] == [(entry, 0.0)] * LAYERS


def test_direct_packed_on_a_build_whose_varlen_entry_lacks_sink():
    """Without a sink the keyword is omitted, so an older varlen entry is not a TypeError."""
    docs, tokens, pos, cu = packed_batch()
    with fake_primus_turbo(varlen_sink=False) as fake:
        model = gpt.build_gpt(gpt.settings(use_turbo_flex_attention=False))
        packed = gpt.logits(model, tokens, pos, gpt.thd_params(cu))
        calls = list(fake.calls)
        alone = separately(model, docs)
    assert [c.entry for c in calls] == ["flash_attn_varlen_func"] * LAYERS
    assert all("sink" not in c.args for c in calls)
    assert (packed - alone).abs().max().item() < 1e-5
