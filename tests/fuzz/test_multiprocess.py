"""The differential fuzzer across ranks: tensor parallel 2 and context parallel 2, each a world of 2 gloo
processes with megatron-core's parallel state.

Every rank draws the same cases from one seed (hypothesis cannot drive several processes): a path (direct, or
flex on reference, turbo over the CPU fake, flex over the autograd stand-in of torch's flex_attention), learned
sinks or not, causal, full or windowed, a mask hook reading the head index and positions or a score hook
(ALiBi, a softcap, the identity), GQA, eager or compiled (``fullgraph``).  A rank builds megatron-core's core
attention for its heads (TP: its column split, hooks proven for its global heads) and takes its rows of the
batch with megatron-core's own load-balanced ``get_batch_on_this_cp_rank`` (CP), then runs forward and backward.
Each case must be refused (our error) or match the float64 oracle of the whole batch on every rank: output,
q/k/v gradients and the sink's (summed over the CP ranks as Megatron's gradient reduction sums it).  A layer
may be refused at build on some ranks only (each rank's hooks are proven for its own heads: a head-0 exception
is no kernel mask on TP rank 0 and causal on rank 1); then no rank runs it.  A call refused on one rank only,
ranks that disagree on what they ran, a mismatch or any other exception fails.

Profiles: ``ci`` runs a few cases per world, ``long`` (``PRIMUS_FUZZ_PROFILE=long``) 250 per world.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from hypothesis import settings as hyp_settings

from tests.megatron.conftest import gloo_world, spawn_ranks
from tests.megatron.cp_world import Layer, build, inputs, megatron_split, oracle, run, tp_part

from . import oracle as fuzz_oracle

HOOKS = "tests.fuzz.user_hooks:"
PATHS = {"direct": {}, "reference": dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="reference"),
         "turbo": dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="turbo"),
         "flex": dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="flex")}
MASK_HOOKS = ("causal", "everything", "first_head_sees_all", "every_other_key", "prefix_four", "global_window")
SCORE_HOOKS = ("alibi", "identity", "softcap")
WORLDS = {"tp2": (2, 1), "cp2": (1, 2)}


def cases_per_world() -> int:
    name = hyp_settings.get_current_profile_name()
    return 250 if name == "long" else 10


@dataclass(frozen=True)
class RankCase:
    """One layer every rank builds and runs (drawn alike on every rank from the case's seed)."""

    path: str
    layer: Layer
    hq: int
    hkv: int

    def describe(self) -> str:
        return (f"{self.path} hq={self.hq} hkv={self.hkv} sink={self.layer.sink} causal={self.layer.causal} "
                f"window={self.layer.window} mask={self.layer.mask_hook} score={self.layer.score_hook} "
                f"compiled={self.layer.compiled} comm={self.layer.comm}")


def draw(seed: int, tp: int, cp: int) -> RankCase:
    rng = random.Random(seed)
    path = rng.choice(list(PATHS))
    keys = dict(PATHS[path], use_sink_attention=rng.random() < 0.4)
    causal = rng.random() < 0.7
    window = (rng.choice((1, 3, 6)), 0) if causal and rng.random() < 0.3 else None
    mask = score = None
    if path != "direct" and rng.random() < 0.45:
        if rng.random() < 0.6:
            mask, window = HOOKS + rng.choice(MASK_HOOKS), None
        else:
            score = HOOKS + rng.choice(SCORE_HOOKS)
    ranks = tp * cp
    hq = ranks * rng.choice((1, 2, 4))
    hkv = rng.choice(sorted({d for d in (ranks, hq // 2, hq) if d >= ranks and hq % d == 0 and d % cp == 0}))
    comm = rng.choice(("a2a", "p2p", "a2a+p2p", "all_gather")) if cp > 1 else "a2a"
    layer = Layer(keys, causal=causal, window=window, comm=comm, mask_hook=mask, score_hook=score,
                  compiled=rng.random() < 0.25)
    return RankCase(path, layer, hq, hkv)


def _close(got: Optional[torch.Tensor], want: Optional[torch.Tensor], grad: bool) -> str:
    if got is None or want is None:
        return "" if got is None and want is None else "a gradient is missing"
    tol = (fuzz_oracle.GRAD_TOL if grad else fuzz_oracle.OUTPUT_TOL)[torch.float32]
    return fuzz_oracle.mismatch(got, want, tol) or ""


def run_case(case: RankCase, tp: int, cp: int, seed: int) -> tuple[str, str]:
    """``(outcome, detail)`` of one case on this rank: refused (codes), matched, mismatched or foreign."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from primus_ext.errors import PrimusExtError

    whole = inputs(case.hq, case.hkv, seed=seed)
    try:
        module = build(case.layer, cp, case.hq, case.hkv, tp=tp)
        built = 1
    except PrimusExtError as err:
        module, built, refusal = None, 0, ("refused", ",".join(err.codes) or "build")
    flag = torch.tensor([built])
    dist.all_reduce(flag, op=dist.ReduceOp.SUM)  # the harness's own agreement: never run a half-built world
    if module is None:
        return refusal
    if int(flag) != tp * cp:  # a rank's plan is proven for its own heads: others may refuse theirs at build
        return "refused", "on another rank"
    part = tp_part(megatron_split(whole), tp, case.hq)
    if case.layer.compiled:
        torch._dynamo.reset()  # each case's module is another object: Dynamo's cache would hit its recompile limit
    try:
        got = run(module, part, compiled=case.layer.compiled)
    except PrimusExtError as err:
        return "refused", ",".join(err.codes) or "call"
    want = oracle(case.layer, whole, case.hq)
    rows = megatron_split({n: want[n] for n in ("out", "dq", "dk", "dv")})
    mine = tp_part(dict(q=rows["dq"], k=rows["dk"], v=rows["dv"], grad=rows["out"]), tp, case.hq)
    problems = [f"{name}: {why}" for name, why in (
        ("out", _close(got["out"], mine["grad"], False)), ("dq", _close(got["dq"], mine["q"], True)),
        ("dk", _close(got["dk"], mine["k"], True)), ("dv", _close(got["dv"], mine["v"], True))) if why]
    if got["dsink"] is not None:
        dsink = got["dsink"].clone()
        if cp > 1:
            dist.all_reduce(dsink, group=parallel_state.get_context_parallel_group())
        rank = parallel_state.get_tensor_model_parallel_rank()
        n = case.hq // tp
        why = _close(dsink, want["dsink"][rank * n:(rank + 1) * n].float(), True)
        if why:
            problems.append(f"dsink: {why}")
    return ("mismatched", "; ".join(problems)) if problems else ("matched", "")


def run_world(name: str, count: int, rank: int, port: int, out_dir: str) -> None:
    from primus_ext.testing import fake_primus_turbo

    tp, cp = WORLDS[name]
    records = []
    with gloo_world(rank, port, tp * cp, tp=tp, cp=cp, timeout_s=60), fake_primus_turbo():
        for i in range(count):
            seed = 7919 * (i + 1) + (0 if name == "tp2" else 104729)
            case = draw(seed, tp, cp)
            try:
                outcome, detail = run_case(case, tp, cp, seed)
            except Exception as exc:  # noqa: BLE001 - recorded: a foreign exception fails the test
                outcome, detail = "foreign", f"{type(exc).__name__}: {str(exc)[:300]}"
            records.append(dict(case=case.describe(), outcome=outcome, detail=detail))
            if outcome == "foreign":
                break  # a collective may be out of step now
    torch.save(records, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.parametrize("world", list(WORLDS))
def test_every_rank_agrees_and_matches_the_oracle(world, tmp_path, fuzz_tally):
    count = cases_per_world()
    records = spawn_ranks(functools.partial(run_world, world, count), 2, tmp_path)
    problems = []
    for i, per_rank in enumerate(zip(*records)):
        outcomes = {(r["outcome"], r["detail"] if r["outcome"] == "refused" else "") for r in per_rank}
        if all(r["outcome"] == "refused" for r in per_rank) and any(r["detail"] == "on another rank"
                                                                    for r in per_rank):
            outcomes = {("refused", "at build, on some ranks")}
        bad = [r for r in per_rank if r["outcome"] in ("mismatched", "foreign")]
        if len(outcomes) > 1 and not bad:
            bad = [dict(per_rank[0], outcome="mismatched", detail=f"ranks disagree: {sorted(outcomes)}")]
        outcome = bad[0]["outcome"] if bad else per_rank[0]["outcome"]
        fuzz_tally.record_multiprocess(world, outcome, per_rank[0]["detail"] if outcome == "refused" else "")
        if bad:
            problems.append(f"case {i} ({per_rank[0]['case']}): {bad[0]['outcome']}: {bad[0]['detail']}")
    assert len(records[0]) == count or problems, "a world stopped early"
    assert not problems, "\n".join(problems[:10])
