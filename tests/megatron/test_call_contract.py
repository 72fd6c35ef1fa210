"""B34, Megatron side: what core attention receives per call is honoured or refused.

Each case that used to run silently wrong has a regression here: a document mask handed
to a causal layer, ``qkv_format="bshd"`` read as sbhd, unknown formats, bottom-right vs
top-left alignment with q_len != kv_len, and a planned sink missing at the call.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType

from primus_ext.errors import UnsupportedInputError
from primus_ext.megatron import PrimusTurboLocalAttention
from primus_ext.testing import fake_primus_turbo
from tests import oracle
from tests.megatron import gpt
from tests.megatron.test_refusals import qkv_sbhd

PATHS = {
    "direct": gpt.settings(),
    "flex-reference": gpt.settings(use_turbo_flex_attention=True, turbo_flex_attention_backend="reference"),
    "flex-turbo": gpt.settings(use_turbo_flex_attention=True, turbo_flex_attention_backend="turbo"),
}
TOL = dict(atol=1e-5, rtol=1e-5)


def module(path: str, mask_type=AttnMaskType.causal, **cfg):
    return PrimusTurboLocalAttention(gpt.config(kv_channels=16, **cfg), 1, mask_type, "self", settings=PATHS[path])


def megatron_causal_mask(b: int, s: int) -> torch.Tensor:
    """What Megatron's get_ltor_masks_and_position_ids builds: True = masked."""
    return (torch.tril(torch.ones(b, 1, s, s)) < 0.5)


def document_mask(b: int, s: int, cut: int) -> torch.Tensor:
    mask = megatron_causal_mask(b, s).clone()
    mask[..., cut:, :cut] = True  # reset_attention_mask: no attention across the document boundary
    return mask


@pytest.mark.parametrize("path", sorted(PATHS))
def test_megatron_causal_mask_is_accepted_and_changes_nothing(path):
    q, k, v = qkv_sbhd()
    with fake_primus_turbo():
        layer = module(path)
        plain = layer(q, k, v, None)
        masked = layer(q, k, v, megatron_causal_mask(2, 16))
        again = layer(q, k, v, megatron_causal_mask(1, 16))  # [1, 1, S, S] broadcasts
    torch.testing.assert_close(masked, plain, **TOL)
    torch.testing.assert_close(again, plain, **TOL)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_document_mask_on_a_causal_layer_is_refused_not_ignored(path):
    q, k, v = qkv_sbhd()
    with fake_primus_turbo() as fake:
        layer = module(path)
        with pytest.raises(UnsupportedInputError, match="not Megatron's causal mask") as err:
            layer(q, k, v, document_mask(2, 16, 6))
    assert "attention_mask" in err.value.settings and "B34.mask-values" in err.value.codes
    assert fake.calls == []


@pytest.mark.parametrize("bad", ["float", "shape", "list"])
def test_masks_of_another_kind_are_refused(bad):
    q, k, v = qkv_sbhd()
    mask = {"float": megatron_causal_mask(2, 16).float(), "shape": megatron_causal_mask(2, 8),
            "list": [[True]]}[bad]
    with fake_primus_turbo():
        with pytest.raises(UnsupportedInputError, match="attention_mask"):
            module("flex-turbo")(q, k, v, mask)


def test_a_mask_on_a_non_causal_layer_is_refused():
    q, k, v = qkv_sbhd()
    with fake_primus_turbo():
        with pytest.raises(UnsupportedInputError, match="would be ignored"):
            module("flex-reference", AttnMaskType.no_mask)(q, k, v, megatron_causal_mask(2, 16))


def test_the_mask_is_checked_once_per_tensor_not_per_layer():
    """Every layer of a step gets the same mask object: one comparison per tensor, no host read."""
    from primus_ext.testing.counting import count_copies_and_syncs

    q, k, v = qkv_sbhd()
    mask = megatron_causal_mask(2, 16)
    with fake_primus_turbo():
        layer = module("flex-turbo")
        layer(q, k, v, mask)
        with count_copies_and_syncs() as counts:
            layer(q, k, v, mask)
        assert counts.syncs == 0, counts.summary()
        mask[0, 0, 3, 1] = True  # an in-place change is a new version: checked again, and refused
        with pytest.raises(UnsupportedInputError):
            layer(q, k, v, mask)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_bshd_means_bshd(path):
    q, k, v = qkv_sbhd()
    bq, bk, bv = (t.transpose(0, 1).contiguous() for t in (q, k, v))
    with fake_primus_turbo():
        layer = module(path)
        sbhd = layer(q, k, v, None)
        bshd = layer(bq, bk, bv, None, packed_seq_params=PackedSeqParams(qkv_format="bshd"))
    assert bshd.shape == (2, 16, 64)
    torch.testing.assert_close(bshd, sbhd.transpose(0, 1), **TOL)
    want = oracle.attention(bq, bk, bv, oracle.causal()).reshape(2, 16, 64)
    torch.testing.assert_close(bshd.double(), want, **TOL)


def test_an_unknown_qkv_format_is_refused():
    q, k, v = qkv_sbhd()
    with fake_primus_turbo():
        with pytest.raises(UnsupportedInputError, match="qkv_format='bhsd'"):
            module("direct")(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="bhsd"))


@pytest.mark.parametrize("path", sorted(PATHS))
def test_q_len_differing_from_kv_len_runs_only_where_the_alignment_is_right(path):
    """causal_bottom_right on the direct path, top-left causal on the reference; refused elsewhere."""
    q, _, _ = qkv_sbhd(s=8)
    _, k, v = qkv_sbhd(s=16)
    bq, bk, bv = (t.transpose(0, 1) for t in (q, k, v))
    with fake_primus_turbo():
        for mask_type, align in ((AttnMaskType.causal_bottom_right, 8), (AttnMaskType.causal, 0)):
            layer = module(path, mask_type)
            runs = (path == "direct") == (align == 8) and not (path == "flex-turbo")
            if not runs:
                with pytest.raises(UnsupportedInputError, match="q_len"):
                    layer(q, k, v, None)
                continue
            out = layer(q, k, v, None).transpose(0, 1).reshape(2, 8, 4, 16)
            want = oracle.attention(bq, bk, bv, lambda b, h, i, j: j <= i + align)
            torch.testing.assert_close(out.double(), want, **TOL)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_packed_documents_of_unequal_q_and_kv_lengths_follow_the_same_alignment_rule(path):
    """Per document, as for dense calls: the varlen kernel aligns bottom-right, a mask_mod top-left;
    a call whose q and kv boundaries differ runs only where the path computes the mask type asked."""
    q, _, _ = qkv_sbhd(s=4)
    _, k, v = qkv_sbhd(s=8)
    q, k, v = (t.reshape(8 if t is q else 16, *t.shape[2:]) for t in (q, k, v))  # two documents each
    cu_q, cu_kv = torch.tensor([0, 4, 8], dtype=torch.int32), torch.tensor([0, 8, 16], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=4,
                             max_seqlen_kv=8)
    with fake_primus_turbo():
        for mask_type, align in ((AttnMaskType.causal_bottom_right, 4), (AttnMaskType.causal, 0)):
            layer = module(path, mask_type)
            runs = (path == "direct") == (align == 4) and path != "flex-turbo"
            if not runs:
                with pytest.raises(UnsupportedInputError, match="cu_seqlens"):
                    layer(q, k, v, None, packed_seq_params=params)
                continue
            out = layer(q, k, v, None, packed_seq_params=params).reshape(8, 4, 16)
            want = oracle.attention(q[None], k[None], v[None],
                                    lambda b, h, i, j: (i // 4 == j // 8) & (j % 8 <= i % 4 + align))[0]
            torch.testing.assert_close(out.double(), want, **TOL)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_planned_sink_missing_at_the_call_is_refused(path):
    q, k, v = qkv_sbhd()
    settings = PATHS[path].replace(use_sink_attention=True)
    with fake_primus_turbo() as fake:
        layer = PrimusTurboLocalAttention(gpt.config(kv_channels=16), 1, AttnMaskType.causal, "self",
                                          settings=settings)
        with pytest.raises(UnsupportedInputError, match="planned with a learned sink"):
            layer.core.forward(q, k, v, None, sink=None)
        layer(q, k, v, None)  # the module passes its own sink
    assert all(c.args["sink"] is not None for c in fake.calls)



@pytest.mark.parametrize("path", sorted(PATHS))
def test_masks_made_in_inference_mode_are_checked_every_call(path):
    """Inference tensors have no version counter, so the mask proven for one call cannot be
    known unchanged at the next: it is checked each time, and a document mask still refused."""
    with fake_primus_turbo(), torch.inference_mode():
        q, k, v = qkv_sbhd()
        layer = module(path)
        mask = megatron_causal_mask(2, 16)
        for _ in range(2):
            layer(q, k, v, mask)
        with pytest.raises(UnsupportedInputError):
            layer(q, k, v, document_mask(2, 16, 5))
