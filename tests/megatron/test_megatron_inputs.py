"""Megatron inputs that could run as another attention are refused, or computed as megatron-core does.

* ``TransformerConfig(window_size=(4, 4))`` on a causal layer: megatron-core's unfused attention
  applies the two-sided window instead of the causal mask, its fused path ignores the window,
  TransformerEngine caps it to right bound 0.  No one meaning: refused at build (B8).
* A window on a non-causal layer with ``q_len != kv_len``: megatron-core aligns it bottom-right
  (``get_sliding_window_causal_mask``), as the direct path's flash kernels do; the flex path
  aligns masks top-left, so it refuses the call.
* Boundaries given as Python lists instead of tensors: refused with our error.
* ``packed_sequences``: one key, read by the modules from the Turbo settings; a call of the
  other kind is refused (a dense call on a ``reset_attention_mask`` layer would attend across
  documents).
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType

from primus_ext.errors import UnsupportedConfigError, UnsupportedInputError
from primus_ext.megatron import PrimusTurboLocalAttention
from primus_ext.testing import fake_primus_turbo
from tests.fuzz import oracle
from tests.megatron import gpt
from tests.megatron.test_refusals import qkv_sbhd, qkv_thd

PATHS = {
    "direct": {},
    "flex-reference": dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="reference"),
    "flex-turbo": dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="turbo"),
}


def module(path: str, mask_type=AttnMaskType.causal, keys=None, **cfg):
    settings = gpt.settings(**PATHS[path], **(keys or {}))
    return PrimusTurboLocalAttention(gpt.config(kv_channels=16, **cfg), 1, mask_type, "self", settings=settings)


def expected(q, k, v, *, causal: bool, window=(-1, -1), align="bottom_right") -> torch.Tensor:
    """float64 attention of sbhd inputs, flattened to Megatron's [S, B, H * D]."""
    bshd = [t.double().transpose(0, 1) for t in (q, k, v)]
    mask = oracle.flash_mask(q.shape[0], k.shape[0], causal=causal, window=window, align=align)
    out, _ = oracle.attention(*bshd, mask)
    return out.transpose(0, 1).reshape(q.shape[0], q.shape[1], -1)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("window", [(4, 4), (4, -1), (-1, 3)])
def test_a_window_with_a_right_bound_on_a_causal_layer_is_refused_at_build(path, window):
    with fake_primus_turbo():
        with pytest.raises(UnsupportedConfigError) as err:
            module(path, window_size=window)
    assert "B8" in err.value.codes and "window_size" in err.value.settings


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_causal_sliding_window_still_runs(path):
    q, k, v = qkv_sbhd()
    with fake_primus_turbo():
        out = module(path, window_size=(4, 0))(q, k, v, None)
    torch.testing.assert_close(out.double(), expected(q, k, v, causal=True, window=(4, 0)), atol=1e-5, rtol=1e-5)


def test_a_non_causal_window_with_q_len_not_kv_len_runs_bottom_right_as_megatron_or_is_refused():
    q, _, _ = qkv_sbhd(s=10)
    _, k, v = qkv_sbhd(s=16, seed=1)
    window = (2, 3)
    with fake_primus_turbo():
        direct = module("direct", AttnMaskType.no_mask, window_size=window)(q, k, v, None)
        torch.testing.assert_close(direct.double(), expected(q, k, v, causal=False, window=window),
                                   atol=1e-5, rtol=1e-5)  # megatron-core's own alignment
        for path in ("flex-reference", "flex-turbo"):
            layer = module(path, AttnMaskType.no_mask, window_size=window)
            with pytest.raises(UnsupportedInputError, match="bottom-right"):
                layer(q, k, v, None)
            same = qkv_sbhd(s=16)  # equal lengths: one alignment, and both paths run it
            torch.testing.assert_close(layer(*same, None).double(), expected(*same, causal=False, window=window),
                                       atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("field", ["cu_seqlens_q_padded", "cu_seqlens_kv_padded"])
def test_boundaries_given_as_lists_are_refused_with_our_error(path, field):
    q, k, v = qkv_thd()
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7,
                             **{field: [0, 5, 12]})
    with fake_primus_turbo():
        with pytest.raises(UnsupportedInputError, match="not a tensor") as err:
            module(path)(q, k, v, None, packed_seq_params=params)
    assert field in err.value.settings


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_layer_declared_packed_refuses_dense_calls(path):
    q, k, v = qkv_sbhd()
    with fake_primus_turbo():
        packed = module(path, keys=dict(packed_sequences=True))
        assert packed.plan.packed is True
        with pytest.raises(UnsupportedInputError, match="packed_sequences: true") as err:
            packed(q, k, v, None)
        assert "B34.dense-call" in err.value.codes
        eod = module(path, keys=dict(packed_sequences=True, reset_attention_mask=True))
        assert eod.plan.eod_documents
        with pytest.raises(UnsupportedInputError, match="attend across them") as err:
            eod(q, k, v, None)  # what B25's own alternative used to invite: documents silently lost
        assert "B25.dense-call" in err.value.codes and "reset_attention_mask" in err.value.settings
        dense = module(path, keys=dict(packed_sequences=False))
        tq, tk, tv = qkv_thd()
        cu = torch.tensor([0, 5, 12], dtype=torch.int32)
        with pytest.raises(UnsupportedInputError, match="packed_sequences: false"):
            dense(tq, tk, tv, None, packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu,
                                                                        cu_seqlens_kv=cu))


def test_packed_sequences_from_the_config_and_the_settings_agree_or_are_refused():
    with fake_primus_turbo():
        cfg = gpt.config(kv_channels=16)
        cfg.packed_sequences = True
        layer = PrimusTurboLocalAttention(cfg, 1, AttnMaskType.causal, "self", settings=gpt.settings())
        assert layer.plan.packed is True
        with pytest.raises(UnsupportedConfigError, match="two sources") as err:
            PrimusTurboLocalAttention(cfg, 1, AttnMaskType.causal, "self",
                                      settings=gpt.settings(packed_sequences=False))
        assert "packed_sequences" in err.value.settings


@pytest.mark.parametrize("value", [0, 1, "false", [True]])
def test_a_packed_sequences_config_attribute_that_is_no_bool_is_refused_at_build(value):
    with fake_primus_turbo():
        cfg = gpt.config(kv_channels=16)
        cfg.packed_sequences = value
        with pytest.raises(UnsupportedConfigError, match="packed_sequences must be true, false or null") as err:
            PrimusTurboLocalAttention(cfg, 1, AttnMaskType.causal, "self", settings=gpt.settings())
        assert "packed_sequences" in err.value.settings
