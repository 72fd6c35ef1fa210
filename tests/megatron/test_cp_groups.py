"""Context parallel 2 over two gloo processes, fed with megatron-core's own sequence split.

Two processes are spawned (as in ``test_tensor_parallel``), each with megatron-core's parallel
state at context-parallel size 2 and the CPU fake of Primus-Turbo installed.  Each rank takes
its part of the batch with megatron-core's ``get_batch_on_this_cp_rank``, which is
load-balanced: of 2 * CP chunks of the sequence, rank r holds chunks r and 2 * CP - 1 - r.
Primus-Turbo's Ulysses all-to-all joins the shards in rank order (upstream_facts.md §4), so
the gathered sequence is a permutation of the tokens:

* a non-causal layer without a window does not depend on the token order: the direct path
  at CP 2 (``cp_comm_type`` a2a, then p2p) runs, and its outputs and q/k/v gradients equal
  the float64 oracle's rows of this rank's chunks;
* a causal or windowed layer would attend to the wrong keys: it is refused at build
  (``cp-causal``), and the fake's usp entry, called on the same split, shows why (its
  causal rows differ from the oracle's).

The record written per rank also holds the groups the fake's ``flash_attn_usp_func``
received, how the fake's usp entries answer what the real ones refuse in a world of two
(``ring_group=None`` is the WORLD group, a ring larger than 1, ``ulysses_group=None``,
dropout, heads not divisible by the Ulysses size), and the varlen usp entry's result over
global ``cu_seqlens`` against ``flash_attn_varlen_func``.

The process groups are created with a 60 s timeout, so a collective that one rank skips fails
instead of hanging the suite.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from tests.megatron import gpt
from tests.megatron.conftest import spawn_ranks

CP = 2
SEQ, BATCH, HEADS, GROUPS, DIM = 16, 2, 4, 2, 16
COMMS = ("a2a", "p2p")


def inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """Whole-sequence bshd q, k, v and an upstream gradient ``[B, S, H * D]``, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return dict(q=torch.randn(BATCH, SEQ, HEADS, DIM, generator=gen),
                k=torch.randn(BATCH, SEQ, GROUPS, DIM, generator=gen),
                v=torch.randn(BATCH, SEQ, GROUPS, DIM, generator=gen),
                grad=torch.randn(BATCH, SEQ, HEADS * DIM, generator=gen))


def oracle(whole: dict[str, torch.Tensor], causal: bool) -> dict[str, torch.Tensor]:
    """float64 attention of the whole sequence (bshd) and its q/k/v gradients for ``grad``."""
    from tests.fuzz import oracle as fuzz_oracle

    leaves = {n: whole[n].double().requires_grad_(True) for n in "qkv"}
    mask = fuzz_oracle.flash_mask(SEQ, SEQ, causal=causal, window=(-1, -1), align="bottom_right")
    out, _ = fuzz_oracle.attention(leaves["q"], leaves["k"], leaves["v"], mask)
    out = out.reshape(BATCH, SEQ, -1)
    out.backward(whole["grad"].double())
    return dict(out=out.detach(), dq=leaves["q"].grad, dk=leaves["k"].grad, dv=leaves["v"].grad)


def megatron_split(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's part of bshd tensors, as megatron-core's own ``get_batch_on_this_cp_rank`` cuts it."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    return get_batch_on_this_cp_rank(dict(batch))


def run(module: Any, part: dict[str, torch.Tensor]) -> dict:
    """Forward in training mode on Megatron's sbhd layout, backward of the part's gradient;
    output and q/k/v gradients, back in bshd."""
    leaves = [part[n].transpose(0, 1).contiguous().requires_grad_(True) for n in "qkv"]
    module.train()
    out = module(*leaves, None)
    out.backward(part["grad"].transpose(0, 1))
    grads = [t.grad.transpose(0, 1) for t in leaves]
    return dict(out=out.detach().transpose(0, 1), dq=grads[0], dk=grads[1], dv=grads[2])


def outcome(fn: Callable[[], Any]) -> tuple[str, str]:
    """``(exception type, message)`` of a call that must raise, or ``("returned", "")``."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the type is what the test compares
        return type(exc).__name__, str(exc)
    return "returned", ""


def refusals(ops: Any, cp_group: Any, ring: Any) -> dict[str, tuple[str, str]]:
    """How the fake's usp entries answer calls the real entries refuse (all raise before any collective)."""
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, SEQ // CP, HEADS, DIM, generator=gen) for _ in range(3))
    k1 = torch.randn(1, SEQ // CP, 1, DIM, generator=gen)
    usp, fp8 = ops.flash_attn_usp_func, ops.flash_attn_fp8_usp_func
    return {
        "ring None (WORLD)": outcome(lambda: usp(q, k, v, ulysses_group=cp_group, ring_group=None)),
        "ring WORLD": outcome(lambda: usp(q, k, v, ulysses_group=cp_group, ring_group=dist.group.WORLD)),
        "fp8 ring WORLD": outcome(lambda: fp8(q, k, v, ulysses_group=cp_group, ring_group=dist.group.WORLD)),
        "ulysses None": outcome(lambda: usp(q, k, v, ulysses_group=None, ring_group=ring)),
        "dropout": outcome(lambda: usp(q, k, v, dropout_p=0.1, ulysses_group=cp_group, ring_group=ring)),
        "kv heads 1": outcome(lambda: usp(q, k1, k1, ulysses_group=cp_group, ring_group=ring)),
        "bias": outcome(lambda: usp(q, k, v, bias=torch.zeros(SEQ // CP, SEQ // CP),
                                    ulysses_group=cp_group, ring_group=ring)),
    }


def varlen(ops: Any, cp_group: Any, ring: Any, rank: int) -> dict:
    """flash_attn_varlen_usp_func on this rank's token shard vs flash_attn_varlen_func on all tokens."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(SEQ, h, DIM, generator=gen).to(torch.bfloat16) for h in (HEADS, GROUPS, GROUPS))
    cu = torch.tensor([0, 5, SEQ], dtype=torch.int32)  # a document crosses the shard boundary at 8
    shard = slice(rank * SEQ // CP, (rank + 1) * SEQ // CP)
    got = ops.flash_attn_varlen_usp_func(q[shard], k[shard], v[shard], cu, cu, 11, 11, causal=True,
                                         ulysses_group=cp_group, ring_group=ring)
    want = ops.flash_attn_varlen_func(q, k, v, cu, cu, 11, 11, causal=True)[shard]
    fp32 = outcome(lambda: ops.flash_attn_varlen_usp_func(q[shard].float(), k[shard].float(), v[shard].float(),
                                                          cu, cu, 11, 11, ulysses_group=cp_group, ring_group=ring))
    return dict(got=got, want=want, fp32=fp32)


def causal_usp_rows(ops: Any, cp_group: Any, ring: Any, part: dict, want: dict) -> float:
    """The largest error of the fake usp entry's causal output on Megatron's split against the
    float64 oracle's rows: what the ``cp-causal`` refusal prevents."""
    got = ops.flash_attn_usp_func(part["q"], part["k"], part["v"], causal=True, ulysses_group=cp_group,
                                  ring_group=ring)
    return float((got.reshape(BATCH, -1, HEADS * DIM).double() - want["out"]).abs().max())


def run_rank(rank: int, port: int, out_dir: str) -> None:
    """One CP rank: gloo + parallel state at CP 2, the fake, the modules, the record."""
    import warnings

    warnings.simplefilter("ignore")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import AttnMaskType

    from primus_ext.backends.direct import singleton_ring_group
    from primus_ext.errors import UnsupportedConfigError
    from primus_ext.megatron import PrimusTurboLocalAttention
    from primus_ext.testing import fake_primus_turbo

    dist.init_process_group("gloo", rank=rank, world_size=CP, timeout=datetime.timedelta(seconds=60))
    try:
        parallel_state.initialize_model_parallel(1, 1, context_parallel_size=CP)
        cp_group = parallel_state.get_context_parallel_group()
        whole = inputs()
        part = megatron_split(whole)
        settings = gpt.settings()
        record: dict[str, Any] = dict(rank=rank, cp_rank=parallel_state.get_context_parallel_rank(),
                                      cp_ranks=dist.get_process_group_ranks(cp_group), runs={}, refused={})
        full = megatron_split(oracle(whole, causal=False) | {"grad": whole["grad"]})
        with fake_primus_turbo() as fake:
            cfg = gpt.config(context_parallel_size=CP, kv_channels=DIM)
            for comm in COMMS:
                fake.reset()
                two = PrimusTurboLocalAttention(cfg, 1, AttnMaskType.no_mask, "self", cp_comm_type=comm,
                                                settings=settings)
                got = run(two, part)
                (call,) = fake.calls
                ulysses, ring = call.args["ulysses_group"], call.args["ring_group"]
                record["runs"][comm] = dict(
                    entry=call.entry, plan_entry=two.plan.dense_entry, got=got,
                    want={name: full[name] for name in ("out", "dq", "dk", "dv")},
                    ulysses_is_cp=ulysses is cp_group, ulysses_ranks=dist.get_process_group_ranks(ulysses),
                    ring_ranks=dist.get_process_group_ranks(ring), ring_size=dist.get_world_size(ring),
                    ring_is_cached=ring is singleton_ring_group(), dropout_p=call.args["dropout_p"],
                )
            for name, mask, config in (("causal", AttnMaskType.causal, cfg),
                                       ("window", AttnMaskType.no_mask,
                                        gpt.config(context_parallel_size=CP, kv_channels=DIM, window_size=(4, 4)))):
                try:
                    PrimusTurboLocalAttention(config, 1, mask, "self", cp_comm_type="a2a", settings=settings)
                    record["refused"][name] = ()
                except UnsupportedConfigError as err:
                    record["refused"][name] = err.codes
            ring = singleton_ring_group()
            causal = megatron_split(oracle(whole, causal=True) | {"grad": whole["grad"]})
            record["causal_usp_error"] = causal_usp_rows(fake.module, cp_group, ring, part, causal)
            record["refusals"] = refusals(fake.module, cp_group, ring)
            record["varlen"] = varlen(fake.module, cp_group, ring, rank)
        torch.save(record, Path(out_dir) / f"rank{rank}.pt")
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def cp2_records(tmp_path_factory):
    records = spawn_ranks(run_rank, CP, tmp_path_factory.mktemp("cp2"))
    return sorted(records, key=lambda r: r["cp_rank"])


@pytest.mark.parametrize("comm", COMMS)
def test_usp_gets_ulysses_over_the_cp_group_and_a_ring_of_one(cp2_records, comm):
    for record in cp2_records:
        assert record["cp_ranks"] == [0, 1]
        run_ = record["runs"][comm]
        assert run_["entry"] == run_["plan_entry"] == "flash_attn_usp_func"
        assert run_["ulysses_is_cp"] and run_["ulysses_ranks"] == [0, 1]
        assert run_["ring_size"] == 1 and run_["ring_ranks"] == [record["rank"]]
        assert run_["ring_is_cached"]  # one singleton group per process, shared by every layer
        assert run_["dropout_p"] == 0.0


@pytest.mark.parametrize("comm", COMMS)
def test_non_causal_cp2_on_megatrons_split_equals_the_float64_oracle(cp2_records, comm):
    for record in cp2_records:
        run_ = record["runs"][comm]
        assert run_["got"]["out"].shape == (BATCH, SEQ // CP, HEADS * DIM)
        for name in ("out", "dq", "dk", "dv"):
            torch.testing.assert_close(run_["got"][name].double(), run_["want"][name], atol=1e-5, rtol=1e-5,
                                       msg=lambda m, n=name: f"{comm} rank {record['rank']} {n}: {m}")
    # Every row attends to both ranks' keys and every rank's dk/dv get the other rank's queries'
    # contributions, so these equalities need the gathered sequence and the summed backward.


def test_causal_and_windowed_cp2_are_refused_at_build(cp2_records):
    for record in cp2_records:
        assert "cp-causal" in record["refused"]["causal"]
        assert "cp-causal" in record["refused"]["window"]
        # what would have run: the rank-ordered all-to-all on Megatron's load-balanced chunks
        assert record["causal_usp_error"] > 0.1, record["causal_usp_error"]


def test_fake_usp_entries_refuse_what_the_real_ones_refuse(cp2_records):
    for record in cp2_records:
        got = record["refusals"]
        assert got["ring None (WORLD)"][0] == "RuntimeError" and "WORLD" in got["ring None (WORLD)"][1]
        assert got["ring WORLD"][0] == "NotImplementedError" and "2 ranks" in got["ring WORLD"][1]
        assert got["fp8 ring WORLD"][0] == "AssertionError" and "size 1" in got["fp8 ring WORLD"][1]
        assert got["ulysses None"][0] == "AttributeError" and "ulysses_group" in got["ulysses None"][1]
        assert got["dropout"][0] == "AssertionError" and "dropout_p" in got["dropout"][1]
        assert got["kv heads 1"][0] == "AssertionError" and "divide" in got["kv heads 1"][1]
        assert got["bias"][0] == "AssertionError" and "bias" in got["bias"][1]


def test_fake_varlen_usp_takes_global_boundaries_and_local_tokens(cp2_records):
    for record in cp2_records:
        result = record["varlen"]
        assert result["got"].dtype == torch.bfloat16 and result["got"].shape == (SEQ // CP, HEADS, DIM)
        torch.testing.assert_close(result["got"], result["want"], atol=0, rtol=0)
        assert result["fp32"][0] == "ValueError" and "bf16" in result["fp32"][1]
