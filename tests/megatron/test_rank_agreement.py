"""A call refused on one rank of a context-parallel group is refused on every rank, before the all-to-all.

At CP 2 a reset-attention (document) mask whose only EOD lies in rank 0's chunks: rank 0's rows
are not causal, rank 1's are.  Rank 0 refuses (B34.cp-mask-values); rank 1 must refuse too
(B34.rank, naming rank 0), not enter the exchange alone.  An accepted causal mask costs one
all-reduce per call, a call without a mask none.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.megatron.conftest import gloo_world, spawn_ranks
from tests.megatron.cp_world import LAYERS, SEQ, build, heads, inputs, megatron_split, outcome

EOD = 13  # in chunk 3 of 4: rank 0's second chunk


def document_mask() -> torch.Tensor:
    """Megatron's reset_attention_mask mask (True = masked) with one EOD at ``EOD``."""
    allowed = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    allowed[EOD + 1:, :EOD + 1] = False
    return (~allowed).view(1, 1, SEQ, SEQ)


def run_rank(rank: int, port: int, out_dir: str) -> None:
    import primus_ext.megatron.rank_agreement as agreement
    from primus_ext.testing import fake_primus_turbo

    reduces = []
    real = agreement.funcol.all_reduce
    agreement.funcol.all_reduce = lambda *a, **k: reduces.append(1) or real(*a, **k)
    with gloo_world(rank, port, 2, cp=2, timeout_s=60), fake_primus_turbo():
        hq, hkv = heads(2)
        part = megatron_split(inputs(hq, hkv))
        q, k, v = (part[n].transpose(0, 1).contiguous() for n in "qkv")
        layer = build(LAYERS["direct-causal"], 2, hq, hkv)
        mask = megatron_split({"attention_mask": document_mask()})["attention_mask"]
        causal = megatron_split({"attention_mask": torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
                                 .view(1, 1, SEQ, SEQ)})["attention_mask"]
        record = dict(refused=outcome(lambda: layer(q, k, v, mask)))
        before = len(reduces)
        with torch.no_grad():
            layer(q, k, v, causal)
            record["reduces with mask"] = len(reduces) - before
            layer(q, k, v, None)
            record["reduces without mask"] = len(reduces) - before - record["reduces with mask"]
        torch.save(record, Path(out_dir) / f"rank{rank}.pt")


def test_a_refusal_on_one_rank_is_a_refusal_on_every_rank(tmp_path):
    first, second = spawn_ranks(run_rank, 2, tmp_path)
    assert first["refused"][:2] == ("UnsupportedInputError", ("B34.cp-mask-values",)), first["refused"]
    assert "rank 0 of 2" in first["refused"][2]
    assert second["refused"][:2] == ("UnsupportedInputError", ("B34.rank",)), second["refused"]
    assert "rank 0 of this layer's" in second["refused"][2] and "B34.cp-mask-values" in second["refused"][2]
    for record in (first, second):
        assert record["reduces with mask"] == 1 and record["reduces without mask"] == 0
