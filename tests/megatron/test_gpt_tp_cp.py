"""A megatron-core GPT at TP 2 x CP 2 (4 gloo processes) trains as the same GPT at TP 1 x CP 1.

The layers use learned sinks, a sliding-window mask hook inside the provable subset and a score hook
reading a learned per-head table (`tests.megatron.learned_hooks`), on the ``reference`` backend, in
float64.  Every world builds the same GPT from the same seed (``use_cpu_initialization``: TP shards are
the TP 1 weights cut), feeds megatron-core's own CP split of the same batches, and takes 3 SGD steps;
the CP ranks' gradients of the loss over their tokens are summed over the CP group, as megatron-core's
gradient reduction over the data-and-context-parallel group does.  With dropout 0 the losses, the table
(its gradient at every step and its trained values) and every rank's sink gradients equal TP 1's.  With
dropout > 0 (megatron-core's RNG tracker seeded) two runs from the same seeds give the same losses; that
the heads drop independently is `test_dropout_rng.py`'s.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from tests.megatron import gpt
from tests.megatron.conftest import gloo_world, spawn_ranks

STEPS, LR, SEED = 3, 0.05, 1234
HOOKS = "tests.megatron.learned_hooks:"
KEYS = dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="reference", use_sink_attention=True,
            turbo_flex_attention_mask_mod=HOOKS + "window", turbo_flex_attention_score_mod=HOOKS + "head_bias_64")


class _VocabGather(torch.autograd.Function):
    """megatron-core's gather of the vocab shards (its own uses all_gather_into_tensor, which gloo lacks)."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor) -> torch.Tensor:
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group()
        ctx.rank, ctx.width = ps.get_tensor_model_parallel_rank(), shard.shape[-1]
        parts = [torch.empty_like(shard) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(parts, shard.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # every TP rank has the same loss: its own slice
        return grad[..., ctx.rank * ctx.width:(ctx.rank + 1) * ctx.width].contiguous()


def float64_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over this rank's tokens in float64 (megatron-core's own casts logits to float32)."""
    whole = _VocabGather.apply(logits)  # [B, S, V]: the vocab shards joined
    return torch.nn.functional.cross_entropy(whole.flatten(0, 1), labels.flatten())


def train(tp: int, cp: int, dropout: float) -> dict:
    """Build and train in this rank's world; the record of what the comparison reads."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    from tests.megatron import learned_hooks

    table = learned_hooks.HEAD_BIAS_64
    with torch.no_grad():
        table.copy_(torch.linspace(-0.5, 0.5, learned_hooks.HEADS, dtype=torch.float64))
    cfg = gpt.config(tensor_model_parallel_size=tp, context_parallel_size=cp, num_attention_heads=8,
                     num_query_groups=4, attention_dropout=dropout)
    model = gpt.build_gpt(gpt.settings(**KEYS), cfg).double()
    params = list(model.parameters())
    assert sum(p is table for p in params) == 1  # one parameter, however many layers read it
    cp_group = ps.get_context_parallel_group()
    record: dict = dict(tp_rank=ps.get_tensor_model_parallel_rank(), cp_rank=ps.get_context_parallel_rank(),
                        losses=[], table_grads=[], sink_grads=[], norm_grads=[])
    model.train()
    for tokens in gpt.batches(STEPS, seq=16):
        part = get_batch_on_this_cp_rank(dict(tokens=tokens, position_ids=gpt.positions(tokens)))
        loss = float64_loss(model(part["tokens"], part["position_ids"], None), part["tokens"]) / cp
        loss.backward()
        for p in params:
            if cp > 1:
                torch.distributed.all_reduce(p.grad, group=cp_group)
        total = loss.detach().clone()
        if cp > 1:
            torch.distributed.all_reduce(total, group=cp_group)
        record["losses"].append(total.item())
        record["table_grads"].append(table.grad.clone())
        record["sink_grads"].append([m.softmax_offset.grad.clone() for m in gpt.attention_modules(model)])
        record["norm_grads"].append(model.decoder.final_layernorm.weight.grad.clone())
        with torch.no_grad():
            for p in params:
                p -= LR * p.grad
                p.grad = None
    record["table"] = table.detach().clone()
    return record


def run_rank(rank: int, port: int, out_dir: str, tp: int, cp: int, dropout: float) -> None:
    from primus_ext.testing.cpu_rng import seed_model_parallel

    with gloo_world(rank, port, tp * cp, tp=tp, cp=cp, timeout_s=300):
        if dropout:
            runs = []
            for _ in range(2):
                seed_model_parallel(SEED)
                runs.append(train(tp, cp, dropout))
            record = dict(runs=runs)
        else:
            record = train(tp, cp, dropout)
        torch.save(record, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return spawn_ranks(functools.partial(run_rank, tp=1, cp=1, dropout=0.0), 1, tmp_path_factory.mktemp("tp1"))[0]


def test_tp2_cp2_trains_as_tp1_with_sinks_window_hook_and_learned_table(single, tmp_path):
    records = spawn_ranks(functools.partial(run_rank, tp=2, cp=2, dropout=0.0), 4, tmp_path)
    tight = dict(rtol=1e-10, atol=1e-12)
    assert single["losses"][0] != single["losses"][-1]
    assert not torch.equal(single["table"], torch.linspace(-0.5, 0.5, 8, dtype=torch.float64))  # it trained
    for record in records:
        torch.testing.assert_close(torch.tensor(record["losses"]), torch.tensor(single["losses"]), **tight)
        torch.testing.assert_close(record["table"], single["table"], **tight)
        heads = slice(4 * record["tp_rank"], 4 * record["tp_rank"] + 4)
        for step in range(STEPS):
            torch.testing.assert_close(record["table_grads"][step], single["table_grads"][step], **tight)
            torch.testing.assert_close(record["norm_grads"][step], single["norm_grads"][step], **tight)
            for got, want in zip(record["sink_grads"][step], single["sink_grads"][step]):
                torch.testing.assert_close(got, want[heads], **tight)


def test_tp2_cp2_with_dropout_replays_from_megatrons_seeds(single, tmp_path):
    records = spawn_ranks(functools.partial(run_rank, tp=2, cp=2, dropout=0.3), 4, tmp_path)
    for record in records:
        first, second = record["runs"]
        assert first["losses"] == second["losses"] and torch.equal(first["table"], second["table"])
        assert first["losses"][0] != pytest.approx(single["losses"][0], rel=1e-6)  # dropout did drop
