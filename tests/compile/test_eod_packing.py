"""`pack_eod_micro_batch` under torch.compile: one graph for every document count, no break."""

from __future__ import annotations

import torch
from torch._dynamo.testing import CompileCounter

from primus_ext.megatron import pack_eod_micro_batch
from primus_ext.testing import fake_primus_turbo
from primus_ext.testing.counting import count_copies_and_syncs, kernels_attributed
from tests.helpers import adapter, facts, settings


def _micro_batches(n: int, batch: int = 2, seq: int = 32):
    """Micro-batches holding 1 .. n documents per row pair (EOD = 0)."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for docs in range(n):
        tokens = torch.randint(1, 9, (batch, seq), generator=gen)
        tokens.view(-1)[torch.randperm(batch * seq, generator=gen)[:docs]] = 0
        out.append(tokens)
    return out


def test_twenty_document_counts_compile_once_without_a_graph_break():
    counter = CompileCounter()

    @torch.compile(backend=counter, fullgraph=True)  # fullgraph: any graph break is an error
    def convert(tokens):
        packed = pack_eod_micro_batch(tokens, eod_token=0, max_documents=24, eod_mask_loss=True)
        return packed.packed_seq_params.cu_seqlens_q, packed.position_ids, packed.loss_mask

    for tokens in _micro_batches(20):
        cu, _, _ = convert(tokens)
        eager = pack_eod_micro_batch(tokens, eod_token=0, max_documents=24).packed_seq_params.cu_seqlens_q
        assert torch.equal(cu, eager)
    assert counter.frame_count == 1


def test_conversion_and_attention_call_have_no_host_sync_of_ours():
    tokens = _micro_batches(6)[-1]
    q = torch.randn(64, 4, 8, dtype=torch.float64)
    k = v = torch.randn(64, 2, 8, dtype=torch.float64)
    import sys

    with fake_primus_turbo() as fake, kernels_attributed(sys.modules["primus_turbo.pytorch.ops"], fake.module):
        run = adapter(settings(turbo_flex_attention_backend="turbo"), facts(packed=True))
        packed = pack_eod_micro_batch(tokens, eod_token=0, max_documents=24)
        p = packed.packed_seq_params
        run.varlen(q, k, v, causal=True, cu_seqlens_q=p.cu_seqlens_q, cu_seqlens_k=p.cu_seqlens_kv,
            max_seqlen_q=p.max_seqlen_q, max_seqlen_k=p.max_seqlen_kv)  # warm-up
        with count_copies_and_syncs() as counts:
            packed = pack_eod_micro_batch(tokens, eod_token=0, max_documents=24)
            p = packed.packed_seq_params
            run.varlen(q, k, v, causal=True, cu_seqlens_q=p.cu_seqlens_q, cu_seqlens_k=p.cu_seqlens_kv,
                max_seqlen_q=p.max_seqlen_q, max_seqlen_k=p.max_seqlen_kv)
    assert counts.syncs == 0, counts.summary()  # Turbo's own boundary reads are the kernel's
