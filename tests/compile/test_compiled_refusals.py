"""Value checks inside a compiled graph refuse with the project's error, as in eager.

Eagerly, a check of tensor values fails on CPU at once and raises our refusal.  In a graph it is
the op ``primus_ext::refuse_unless`` (`primus_ext.backends.check_op`), kept in the graph as an
ordered side effect, which raises the same refusal when the graph runs on CPU (on a GPU it is the
device-side assert with the same text, so no host sync).
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType

from primus_ext.backends.check_op import KEPT_IN_GRAPH
from primus_ext.errors import UnsupportedInputError
from primus_ext.megatron import PrimusTurboLocalAttention
from primus_ext.testing import fake_primus_turbo
from tests.megatron import gpt
from tests.megatron.test_refusals import qkv_sbhd


def document_mask(b: int, s: int, cut: int) -> torch.Tensor:
    mask = torch.tril(torch.ones(b, 1, s, s)) < 0.5
    mask[..., cut:, :cut] = True
    return mask


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_document_mask_in_a_compiled_layer_is_our_refusal(backend):
    assert KEPT_IN_GRAPH
    q, k, v = qkv_sbhd()
    layer = PrimusTurboLocalAttention(gpt.config(kv_channels=16), 1, AttnMaskType.causal, "self",
                                      settings=gpt.settings(use_turbo_flex_attention=True,
                                                            turbo_flex_attention_backend="reference"))
    run = torch.compile(lambda q, k, v, mask: layer(q, k, v, mask), backend=backend, fullgraph=True)
    causal = torch.tril(torch.ones(2, 1, 16, 16)) < 0.5
    run(q, k, v, causal)  # Megatron's own causal mask: accepted
    with pytest.raises(UnsupportedInputError, match="not Megatron's causal mask"):
        run(q, k, v, document_mask(2, 16, 5))


def test_distinct_padded_boundaries_in_a_compiled_layer_are_our_refusal():
    from megatron.core.packed_seq_params import PackedSeqParams

    from tests.megatron.test_refusals import qkv_thd

    q, k, v = qkv_thd()
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    with fake_primus_turbo():
        layer = PrimusTurboLocalAttention(gpt.config(kv_channels=16), 1, AttnMaskType.causal, "self",
                                          settings=gpt.settings())
        run = torch.compile(lambda q, k, v, p: layer(q, k, v, None, packed_seq_params=p), backend="aot_eager",
                            fullgraph=True)
        same = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7,
                               cu_seqlens_q_padded=cu.clone(), cu_seqlens_kv_padded=cu.clone())
        run(q, k, v, same)
        padded = torch.tensor([0, 6, 12], dtype=torch.int32)
        other = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7,
                                cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded)
        with pytest.raises(UnsupportedInputError, match="cu_seqlens_q_padded differ"):
            run(q, k, v, other)
