"""A reset_attention_mask layer reading Megatron's dense mask under torch.compile: one graph for
every document count, no graph break, the same outputs and gradients as eager."""

from __future__ import annotations

import pytest
import torch
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids as megatron_ltor
from megatron.core.transformer.enums import AttnMaskType
from torch._dynamo.backends.debugging import aot_eager
from torch._dynamo.testing import CompileCounter

from primus_ext.errors import UnsupportedInputError
from primus_ext.megatron import PrimusTurboLocalAttention
from primus_ext.testing import fake_primus_turbo
from tests.megatron import gpt

S, B = 24, 2


def _masks(n: int):
    """Megatron's masks for micro-batches with 0 .. n - 1 EOD tokens (EOD = 0)."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for eods in range(n):
        tokens = torch.randint(1, 9, (B, S), generator=gen)
        tokens.view(-1)[torch.randperm(B * S, generator=gen)[:eods]] = 0
        out.append(torch.stack([megatron_ltor(row, 0, True, True, True, True)[0] for row in tokens]))
    return out


@pytest.mark.parametrize("path", ["flex-turbo", "flex-reference", "direct"])
def test_twenty_document_counts_compile_once_and_match_eager(path):
    keys = {"flex-turbo": dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="turbo"),
            "flex-reference": dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="reference"),
            "direct": dict(use_turbo_flex_attention=False)}[path]
    counter = CompileCounter()
    with fake_primus_turbo():
        layer = PrimusTurboLocalAttention(gpt.config(kv_channels=16), 1, AttnMaskType.causal, "self",
                                          settings=gpt.settings(reset_attention_mask=True, **keys))
        compiled = torch.compile(layer, backend=lambda gm, ex: (counter(gm, ex), aot_eager(gm, ex))[1],
                                 fullgraph=True)
        torch.manual_seed(2)
        for mask in _masks(20):
            q, k, v = (torch.randn(S, B, n, 16, requires_grad=True) for n in (4, 2, 2))
            got = compiled(q, k, v, mask)
            got.sum().backward()
            grads = [t.grad for t in (q, k, v)]
            for t in (q, k, v):
                t.grad = None
            want = layer(q, k, v, mask)
            want.sum().backward()
            torch.testing.assert_close(got, want)
            for g, t in zip(grads, (q, k, v)):
                torch.testing.assert_close(g, t.grad)
        assert counter.frame_count == 1
        bad = _masks(2)[1].clone()
        bad[0, 0, :3, :3] = False  # a bidirectional prefix: not block-causal
        with pytest.raises(UnsupportedInputError) as err:
            compiled(q, k, v, bad)
        assert "B25.mask-values" in err.value.codes
