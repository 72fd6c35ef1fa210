"""A call refused on one rank of a layer's tensor-and-context-parallel group is refused on every rank,
before the first collective.

* CP 2, eager and compiled: a reset-attention (document) mask whose only EOD lies in rank 0's chunks:
  rank 0's rows are not causal, rank 1's are.  Rank 0 refuses (B34.cp-mask-values); rank 1 must refuse
  too (B34.rank, naming rank 0), not enter the all-to-all alone.  An accepted causal mask costs one
  all-reduce per call, a call without a mask none.
* TP 2, a ``reset_attention_mask`` layer: rank 0 is given a mask that is no document mask, rank 1 a
  document mask.  Without agreement rank 1 would go on to the row-parallel projection's all-reduce alone.
* TP 2 x CP 2 (4 processes): the CP 2 mask on every TP rank: the two ranks holding rank 0's chunks refuse
  with their own error, the other two with B34.rank.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from tests.megatron.conftest import gloo_world, spawn_ranks
from tests.megatron.cp_world import (DIRECT, LAYERS, SEQ, Layer, build, heads, inputs, megatron_split, outcome, run,
                                     tp_part)

EOD = 13  # in chunk 3 of 4: CP rank 0's second chunk


def document_mask() -> torch.Tensor:
    """Megatron's reset_attention_mask mask (True = masked) with one EOD at ``EOD``."""
    allowed = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    allowed[EOD + 1:, :EOD + 1] = False
    return (~allowed).view(1, 1, SEQ, SEQ)


def causal_mask() -> torch.Tensor:
    return torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).view(1, 1, SEQ, SEQ)


def counting_all_reduces() -> list:
    import primus_ext.megatron.rank_agreement as agreement

    reduces: list = []
    real = agreement.funcol.all_reduce
    agreement.funcol.all_reduce = lambda *a, **k: reduces.append(1) or real(*a, **k)
    return reduces


def run_cp(rank: int, port: int, out_dir: str, tp: int, compiled: bool) -> None:
    from primus_ext.testing import fake_primus_turbo

    reduces = counting_all_reduces()
    with gloo_world(rank, port, 2 * tp, tp=tp, cp=2, timeout_s=60) as ps, fake_primus_turbo():
        hq, hkv = 2 * tp * 2, tp * 2
        part = tp_part(megatron_split(inputs(hq, hkv)), tp, hq)
        q, k, v = (part[n].transpose(0, 1).contiguous() for n in "qkv")
        layer = build(LAYERS["direct-causal-sink-compiled" if compiled else "direct-causal"], 2, hq, hkv, tp=tp)
        mask = megatron_split({"attention_mask": document_mask()})["attention_mask"]
        causal = megatron_split({"attention_mask": causal_mask()})["attention_mask"]
        if compiled:
            record = dict(refused=outcome(lambda: run(layer, part, mask, compiled=True)),
                          accepted=outcome(lambda: run(layer, part, causal, compiled=True)))
        else:
            record = dict(refused=outcome(lambda: layer(q, k, v, mask)))
            before = len(reduces)
            with torch.no_grad():
                layer(q, k, v, causal)
                record["reduces with mask"] = len(reduces) - before
                layer(q, k, v, None)
                record["reduces without mask"] = len(reduces) - before - record["reduces with mask"]
        record["cp_rank"] = ps.get_context_parallel_rank()
        torch.save(record, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.parametrize("tp, compiled", [(1, False), (1, True), (2, False)], ids=["cp2", "cp2-compiled", "tp2xcp2"])
def test_a_refusal_on_one_rank_is_a_refusal_on_every_rank(tp, compiled, tmp_path):
    records = spawn_ranks(functools.partial(run_cp, tp=tp, compiled=compiled), 2 * tp, tmp_path)
    for record in records:
        kind, codes, message = record["refused"]
        assert kind == "UnsupportedInputError", record["refused"]
        if record["cp_rank"] == 0:  # its rows are not causal: its own error
            assert codes == ("B34.cp-mask-values",), record["refused"]
        else:
            assert codes == ("B34.rank",), record["refused"]
            assert "rank 0 of this layer's" in message or "rank 2 of this layer's" in message, message
            if not compiled:  # eagerly the refusing rank's rule is named (a compiled graph keeps constants only)
                assert "B34.cp-mask-values" in message
        if compiled:
            assert record["accepted"] == ("returned", (), ""), record["accepted"]
        else:
            assert record["reduces with mask"] == 1 and record["reduces without mask"] == 0


def run_tp_documents(rank: int, port: int, out_dir: str) -> None:
    from primus_ext.testing import fake_primus_turbo

    with gloo_world(rank, port, 2, tp=2, timeout_s=60), fake_primus_turbo():
        hq, hkv = heads(2)
        part = tp_part(inputs(hq, hkv), 2, hq)
        q, k, v = (part[n].transpose(0, 1).contiguous() for n in "qkv")
        layer = build(Layer({**DIRECT, "reset_attention_mask": True}), 1, hq, hkv, tp=2)
        garbled = causal_mask().clone()
        garbled[..., 5, 2] = True  # one masked key inside a document: no document mask
        mask = garbled if rank == 0 else document_mask()
        torch.save(dict(refused=outcome(lambda: layer(q, k, v, mask))), Path(out_dir) / f"rank{rank}.pt")


def test_tensor_parallel_ranks_agree_on_a_document_mask(tmp_path):
    first, second = spawn_ranks(run_tp_documents, 2, tmp_path)
    assert first["refused"][:2] == ("UnsupportedInputError", ("B25.mask-values",)), first["refused"]
    assert second["refused"][:2] == ("UnsupportedInputError", ("B34.rank",)), second["refused"]
    assert "B25.mask-values" in second["refused"][2]
