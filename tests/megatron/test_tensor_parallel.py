"""Tensor parallel 2 over two gloo processes: the flex path with learned sinks trains like TP=1.

Two processes are spawned, each with its own gloo process group on a free port and
megatron-core's parallel state at tensor-parallel size 2.  Both build the same tiny
GPTModel (flex path, reference backend, ``use_sink_attention``), record the sink
parameter of every layer and their initial weight shards, and train five SGD steps
on the same data.  The pytest process itself is the TP=1 world of the conftest
fixture and trains the same model there.

``use_cpu_initialization=True`` makes megatron-core initialise each full (master)
weight from the CPU generator and keep this rank's slice, so under the same seed the
TP=2 shards are the TP=1 weights cut in two; the test checks that first, so a loss
mismatch could not come from initialisation.  ``model_parallel_cuda_manual_seed`` is
not called (it needs CUDA); nothing here draws from the CUDA RNG tracker.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.megatron import gpt
from tests.megatron.conftest import gloo_world, spawn_ranks

TP = 2
STEPS = 5
HEADS = 4
FLEX_SINK = dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="reference", use_sink_attention=True)


def turbo_settings():
    return gpt.settings(**FLEX_SINK)


def shards(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Every parameter of this rank, with how megatron-core says it is split."""
    return {
        name: dict(value=p.detach().clone(), parallel=bool(getattr(p, "tensor_model_parallel", False)),
                   dim=getattr(p, "partition_dim", None))
        for name, p in model.named_parameters()
    }


def run_rank(rank: int, port: int, out_dir: str) -> None:
    """One TP rank: gloo + parallel state, build, record, train, write the record."""
    with gloo_world(rank, port, TP, tp=TP) as parallel_state:
        model = gpt.build_gpt(turbo_settings(), gpt.config(tensor_model_parallel_size=TP))
        sinks = []
        for module in gpt.attention_modules(model):
            sink = module.softmax_offset
            sinks.append(dict(shape=tuple(sink.shape), parallel=sink.tensor_model_parallel,
                              dim=sink.partition_dim, is_param=isinstance(sink, torch.nn.Parameter)))
        initial = shards(model)
        losses = gpt.train(model, gpt.batches(STEPS))
        trained = [m.softmax_offset.detach().clone() for m in gpt.attention_modules(model)]
        torch.save(dict(rank=rank, tp_rank=parallel_state.get_tensor_model_parallel_rank(), sinks=sinks,
                        initial=initial, losses=losses, trained_sinks=trained),
                   Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def tp2_records(tmp_path_factory):
    records = spawn_ranks(run_rank, TP, tmp_path_factory.mktemp("tp2"))
    return sorted(records, key=lambda r: r["tp_rank"])


@pytest.fixture(scope="module")
def tp1_run():
    model = gpt.build_gpt(turbo_settings())
    initial = shards(model)
    losses = gpt.train(model, gpt.batches(STEPS))
    trained = [m.softmax_offset.detach().clone() for m in gpt.attention_modules(model)]
    return dict(initial=initial, losses=losses, trained_sinks=trained)


def test_each_rank_has_a_sink_entry_per_local_head(tp2_records):
    assert [r["tp_rank"] for r in tp2_records] == [0, 1]
    for record in tp2_records:
        assert record["sinks"] == [dict(shape=(HEADS // TP,), parallel=True, dim=0, is_param=True)] * 2


def test_cpu_initialised_weights_are_the_tp1_weights_split(tp2_records, tp1_run):
    full = tp1_run["initial"]
    assert set(tp2_records[0]["initial"]) == set(full)
    for name, want in full.items():
        parts = [r["initial"][name] for r in tp2_records]
        if parts[0]["parallel"]:
            got = torch.cat([p["value"] for p in parts], dim=parts[0]["dim"])
        else:
            assert torch.equal(parts[0]["value"], parts[1]["value"]), name
            got = parts[0]["value"]
        assert torch.equal(got, want["value"]), name


def test_tp2_flex_training_matches_tp1(tp2_records, tp1_run):
    want = tp1_run["losses"]
    assert len(want) == STEPS and want[-1] < want[0]
    for record in tp2_records:
        assert record["losses"] == pytest.approx(want, abs=1e-5, rel=1e-5)
    # The sinks moved away from their zero start (values ~1e-5 after five small SGD steps, so
    # compare relatively), and rank r's slice is the TP=1 sink of its own heads 2r, 2r+1.
    for layer, sink in enumerate(tp1_run["trained_sinks"]):
        assert (sink != 0).all()
        got = torch.cat([r["trained_sinks"][layer] for r in tp2_records])
        torch.testing.assert_close(got, sink, atol=1e-9, rtol=1e-3)
