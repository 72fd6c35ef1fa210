"""Context parallelism over 2 and 4 gloo processes, fed with megatron-core's own sequence split.

Each world runs megatron-core's parallel state at context-parallel size 2 or 4 and the CPU
fake of Primus-Turbo.  Every rank takes its part of the batch with megatron-core's
``get_batch_on_this_cp_rank``, which is load-balanced (of ``2 * CP`` chunks, rank r holds
chunks r and ``2 * CP - 1 - r``), and runs the layer forward and backward.  Its output and
q/k/v gradients must equal its rows of the float64 oracle of the whole sequence.  Both
paths are covered: the direct path, and the flex path on the reference, turbo and flex backends (flex over
the autograd stand-in of torch's flex_attention, and once forward through torch's own).
The layers are causal, windowed, full, with learned sinks, GQA, ALiBi, and mask hooks that
read the head index and absolute positions.  The sink's gradient, summed over the CP ranks
(as Megatron's gradient reduction does), must equal the oracle's.  One layer per path is
also compiled with ``torch.compile(fullgraph=True)``.

The CP-2 world also checks what is refused there: a packed call, an odd local length, a
mask that is not this rank's rows of the causal mask, a config whose
``context_parallel_size`` is not the group's.  It also checks that the fake's usp entries
(no longer called) still refuse what the real ones refuse.

Process groups use a 60 s timeout, so a collective that one rank skips fails instead of
hanging the suite.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fuzz import oracle as fuzz_oracle
from tests.megatron.conftest import gloo_world, spawn_ranks
from tests.megatron.cp_world import (BATCH, DIM, LAYERS, SEQ, build, heads, inputs, megatron_split, oracle, outcome,
                                     run, tp_part)


def refusals(cp: int, hq: int, hkv: int, part: dict) -> dict[str, tuple]:
    """What the CP layers refuse at the call and at build (every rank refuses alike, before any exchange)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    module = build(LAYERS["direct-causal"], cp, hq, hkv)
    q, k, v = (part[n].transpose(0, 1).contiguous() for n in "qkv")
    s_local = q.shape[0]
    bounds = torch.tensor([0, s_local], dtype=torch.int32)
    thd = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=s_local,
                          max_seqlen_kv=s_local)
    whole_mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).view(1, 1, SEQ, SEQ)
    full = build(LAYERS["direct-full"], cp, hq, hkv)
    return {
        "packed call": outcome(lambda: module(q[:, 0], k[:, 0], v[:, 0], None, packed_seq_params=thd)),
        "odd length": outcome(lambda: module(q[:-1], k[:-1], v[:-1], None)),
        "unsplit causal mask": outcome(lambda: module(q, k, v, whole_mask)),
        "rows of another rank": outcome(lambda: module(q, k, v, megatron_split_rows(whole_mask, 1 - rank_of()))),
        "mask on a full layer": outcome(lambda: full(q, k, v, megatron_split({"attention_mask": whole_mask})[
            "attention_mask"])),
        "config cp 1": outcome(lambda: build(LAYERS["direct-causal"], cp, hq, hkv, config_cp=1)),
    }


def rank_of() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_rank()


def megatron_split_rows(mask: torch.Tensor, rank: int) -> torch.Tensor:
    """Rows of ``mask`` that CP rank ``rank`` (of 2) holds, cut as get_batch_on_this_cp_rank cuts them."""
    chunks = mask.view(1, 1, 4, SEQ // 4, SEQ)
    return chunks[:, :, [rank, 3 - rank]].reshape(1, 1, SEQ // 2, SEQ)


def fake_usp(ops: Any, cp_group: Any, ring: Any) -> dict[str, tuple]:
    """How the fake's usp entries answer calls the real entries refuse (they raise before any collective)."""
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, SEQ // 2, 4, DIM, generator=gen) for _ in range(3))
    k1 = torch.randn(1, SEQ // 2, 1, DIM, generator=gen)
    usp, fp8 = ops.flash_attn_usp_func, ops.flash_attn_fp8_usp_func
    return {
        "ring None (WORLD)": outcome(lambda: usp(q, k, v, ulysses_group=cp_group, ring_group=None)),
        "ring WORLD": outcome(lambda: usp(q, k, v, ulysses_group=cp_group, ring_group=dist.group.WORLD)),
        "fp8 ring WORLD": outcome(lambda: fp8(q, k, v, ulysses_group=cp_group, ring_group=dist.group.WORLD)),
        "ulysses None": outcome(lambda: usp(q, k, v, ulysses_group=None, ring_group=ring)),
        "dropout": outcome(lambda: usp(q, k, v, dropout_p=0.1, ulysses_group=cp_group, ring_group=ring)),
        "kv heads 1": outcome(lambda: usp(q, k1, k1, ulysses_group=cp_group, ring_group=ring)),
        "sink": outcome(lambda: usp(q, k, v, sink=torch.zeros(4), ulysses_group=cp_group, ring_group=ring)),
    }


def run_world(cp: int, rank: int, port: int, out_dir: str) -> None:
    """One CP rank: gloo + parallel state at CP ``cp``, the fake, every layer of that size, the record."""
    import torch.distributed as dist

    from primus_ext.testing import fake_primus_turbo

    with gloo_world(rank, port, cp, cp=cp, timeout_s=60) as parallel_state:
        hq, hkv = heads(cp)
        whole = inputs(hq, hkv)
        part = megatron_split(whole)
        record: dict[str, Any] = dict(cp_rank=parallel_state.get_context_parallel_rank(), layers={})
        with fake_primus_turbo() as fake:
            for name, layer in LAYERS.items():
                if cp not in layer.sizes:
                    continue
                fake.reset()
                got = run(build(layer, cp, hq, hkv), part, compiled=layer.compiled)
                want = oracle(layer, whole, hq)
                rows = megatron_split({n: want[n] for n in ("out", "dq", "dk", "dv")})
                record["layers"][name] = dict(got=got, want=rows, want_dsink=want["dsink"],
                                              entries=sorted({c.entry for c in fake.calls}))
            if cp == 4:  # the same world again as tensor parallel 2 x context parallel 2
                record["tp2cp2"] = tensor_and_context_parallel(fake)
            if cp == 2:  # torch's own flex_attention under CP, forward only (it has no CPU backward)
                flex = LAYERS["flex-head-and-position-mask"]
                with torch.no_grad():
                    out = build(flex, cp, hq, hkv, flex_kernel=None)(
                        *(part[n].transpose(0, 1).contiguous() for n in "qkv"), None).transpose(0, 1)
                record["torch_flex"] = dict(got=out, want=megatron_split({"out": oracle(flex, whole, hq)["out"]})["out"])
                causal = LAYERS["direct-causal"]
                split_mask = megatron_split({"attention_mask": torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
                                             .view(1, 1, SEQ, SEQ)})["attention_mask"]
                record["with_mask"] = run(build(causal, cp, hq, hkv), part, split_mask)["out"]
                record["without_mask"] = run(build(causal, cp, hq, hkv), part)["out"]
                record["refusals"] = refusals(cp, hq, hkv, part)
                rings = [dist.new_group([r]) for r in range(cp)]  # collective: every rank makes every group
                record["fake_usp"] = fake_usp(fake.module, parallel_state.get_context_parallel_group(), rings[rank])
        torch.save(record, Path(out_dir) / f"rank{rank}.pt")


def _cp2(world: tuple) -> list:
    """The records of the CP-2 world (the checks that need only one world size)."""
    cp, records = world
    if cp != 2:
        pytest.skip("checked in the CP-2 world")
    return records


TP_LAYERS = ("direct-window-sink", "reference-window-sink", "turbo-causal-sink",
             # hooks reading the head index get the model's: tp_rank * 4 + cp_rank * 2 + local head
             "reference-alibi", "reference-head-and-position-mask")


def tensor_and_context_parallel(fake: Any) -> dict[str, Any]:
    """TP 2 x CP 2 (CP groups [0, 2] and [1, 3]): each rank's heads of the TP rank and rows of the CP rank."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(2, 1, context_parallel_size=2)
    hq, hkv = 8, 4
    whole = inputs(hq, hkv, seed=5)
    part = tp_part(megatron_split(whole), 2, hq)
    record: dict[str, Any] = dict(tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                                  cp_rank=parallel_state.get_context_parallel_rank(), layers={})
    for name in TP_LAYERS:
        layer = LAYERS[name]
        fake.reset()
        got = run(build(layer, 2, hq, hkv, tp=2), part)
        want = oracle(layer, whole, hq)
        rows = megatron_split({n: want[n] for n in ("out", "dq", "dk", "dv")})
        mine = tp_part(dict(q=rows["dq"], k=rows["dk"], v=rows["dv"], grad=rows["out"]), 2, hq)
        rows = dict(out=mine["grad"], dq=mine["q"], dk=mine["k"], dv=mine["v"])
        record["layers"][name] = dict(got=got, want=rows, want_dsink=want["dsink"])
    return record


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def world(request, tmp_path_factory):
    cp = request.param
    records = spawn_ranks(functools.partial(run_world, cp), cp, tmp_path_factory.mktemp(f"cp{cp}"))
    return cp, sorted(records, key=lambda r: r["cp_rank"])


def cases(cp: int) -> list[str]:
    return [name for name, layer in LAYERS.items() if cp in layer.sizes]


def test_every_rank_equals_its_rows_of_the_float64_oracle(world):
    cp, records = world
    assert [r["cp_rank"] for r in records] == list(range(cp))
    tol, grad_tol = fuzz_oracle.OUTPUT_TOL[torch.float32], fuzz_oracle.GRAD_TOL[torch.float32]
    for name in cases(cp):
        for record in records:
            got, want = record["layers"][name]["got"], record["layers"][name]["want"]
            assert got["out"].shape == (BATCH, SEQ // cp, heads(cp)[0] * DIM)
            for key in ("out", "dq", "dk", "dv"):
                why = fuzz_oracle.mismatch(got[key], want[key], tol if key == "out" else grad_tol)
                assert why is None, f"cp {cp}, {name}, rank {record['cp_rank']}, {key}: {why}"


def test_the_sink_gradients_of_the_cp_ranks_sum_to_the_oracles(world):
    """Each rank's sink gets the whole sequence's gradient of its own heads, and nothing for the others."""
    cp, records = world
    for name in cases(cp):
        if not LAYERS[name].sink:
            continue
        grads = [r["layers"][name]["got"]["dsink"] for r in records]
        want = records[0]["layers"][name]["want_dsink"]
        why = fuzz_oracle.mismatch(sum(grads), want, fuzz_oracle.GRAD_TOL[torch.float32])
        assert why is None, f"cp {cp}, {name}: {why}"
        per_rank = want.numel() // cp
        for rank, grad in enumerate(grads):
            others = torch.cat([grad[:rank * per_rank], grad[(rank + 1) * per_rank:]])
            assert (others == 0).all() and (grad[rank * per_rank:(rank + 1) * per_rank] != 0).all(), (name, rank)


def test_the_per_rank_kernels_run_not_the_usp_entries(world):
    cp, records = world
    for record in records:
        layers = record["layers"]
        for name in cases(cp):
            entries = layers[name]["entries"]
            if name.startswith(("direct", "turbo")):
                assert entries == ["flash_attn_func"], (name, entries)
            else:  # the reference backend: no Turbo call at all
                assert entries == [], (name, entries)


def test_tensor_parallel_2_by_context_parallel_2_equals_the_oracle(world):
    """Each rank holds its TP rank's heads and its CP rank's rows; the sinks of the two CP ranks of a
    TP rank sum to the oracle's gradient of that TP rank's heads."""
    cp, records = world
    if cp != 4:
        pytest.skip("checked in the 4-process world")
    parts = [r["tp2cp2"] for r in records]
    assert sorted((p["tp_rank"], p["cp_rank"]) for p in parts) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    tol, grad_tol = fuzz_oracle.OUTPUT_TOL[torch.float32], fuzz_oracle.GRAD_TOL[torch.float32]
    for name in TP_LAYERS:
        for p in parts:
            got, want = p["layers"][name]["got"], p["layers"][name]["want"]
            for key in ("out", "dq", "dk", "dv"):
                why = fuzz_oracle.mismatch(got[key], want[key], tol if key == "out" else grad_tol)
                assert why is None, f"{name}, tp {p['tp_rank']} cp {p['cp_rank']}, {key}: {why}"
        if not LAYERS[name].sink:
            continue
        for tp in (0, 1):
            summed = sum(p["layers"][name]["got"]["dsink"] for p in parts if p["tp_rank"] == tp)
            want = parts[0]["layers"][name]["want_dsink"][tp * 4:(tp + 1) * 4]
            why = fuzz_oracle.mismatch(summed, want, grad_tol)
            assert why is None, f"{name}, tp {tp} sink: {why}"


def test_a_compiled_cp_layer_is_one_graph_with_the_exchange_and_the_attention_op_inside(world):
    """torch.compile(fullgraph=True) of a CP layer, on both paths: the functional all-to-all and primus_ext's
    attention op are in the one graph Dynamo made (its outputs are held to the oracle above)."""
    records = _cp2(world)
    for name in ("direct-causal-sink-compiled", "reference-sink-compiled"):
        for record in records:
            (graph,) = record["layers"][name]["got"]["graphs"]
            assert "all_to_all_single" in graph and "primus_ext.dense_attention" in graph, name


def test_torchs_own_flex_attention_under_cp_equals_the_oracle_forward(world):
    """The flex layers above run over the autograd stand-in; here the head- and position-reading hook runs
    through torch's real flex_attention on each CP rank (forward: torch has no CPU backward)."""
    for record in _cp2(world):
        why = fuzz_oracle.mismatch(record["torch_flex"]["got"], record["torch_flex"]["want"],
                                   fuzz_oracle.OUTPUT_TOL[torch.float32])
        assert why is None, f"rank {record['cp_rank']}: {why}"


def test_megatrons_split_causal_mask_is_accepted_and_changes_nothing(world):
    for record in _cp2(world):
        torch.testing.assert_close(record["with_mask"], record["without_mask"], atol=0, rtol=0)


def test_what_context_parallel_refuses(world):
    for record in _cp2(world):
        got = record["refusals"]
        assert got["packed call"][:2] == ("UnsupportedInputError", ("cp-packed",)), got["packed call"]
        assert got["odd length"][:2] == ("UnsupportedInputError", ("B22",)), got["odd length"]
        assert "get_batch_on_this_cp_rank" in got["odd length"][2]
        for name, code in (("unsplit causal mask", "B34.cp-mask-shape"),
                           ("rows of another rank", "B34.cp-mask-values"),
                           ("mask on a full layer", "B34.cp-mask-on-layer")):
            assert got[name][:2] == ("UnsupportedInputError", (code,)), (name, got[name])
            assert "attention_mask" in got[name][2]
        kind, codes, text = got["config cp 1"]
        assert (kind, codes) == ("UnsupportedConfigError", ("B22",)) and "context_parallel_size=1" in text
        assert "only over this rank's chunks" in text


def test_fake_usp_entries_still_refuse_what_the_real_ones_refuse(world):
    """Not called any more (they join shards in rank order), but the fake stays no kinder than upstream."""
    for record in _cp2(world):
        got = record["fake_usp"]
        assert got["ring None (WORLD)"][0] == "RuntimeError" and "WORLD" in got["ring None (WORLD)"][2]
        assert got["ring WORLD"][0] == "NotImplementedError" and "2 ranks" in got["ring WORLD"][2]
        assert got["fp8 ring WORLD"][0] == "AssertionError" and "size 1" in got["fp8 ring WORLD"][2]
        assert got["ulysses None"][0] == "AttributeError" and "ulysses_group" in got["ulysses None"][2]
        assert got["dropout"][0] == "AssertionError" and "dropout_p" in got["dropout"][2]
        assert got["kv heads 1"][0] == "AssertionError" and "divide" in got["kv heads 1"][2]
        assert got["sink"][0] == "TypeError" and "sink" in got["sink"][2]
