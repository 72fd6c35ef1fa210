"""A learned table read by a score hook trains, saves and loads as a parameter of the Megatron model.

``tests.megatron.learned_hooks.HEAD_BIAS_64`` is a per-head bias (a ``torch.nn.Parameter``) read by
the score hook of every layer.  Before, it got a gradient but was no parameter of the GPT: an optimizer
over ``model.parameters()`` left it unchanged and ``state_dict`` lost it.  Now it is one parameter of
the model (registered on each layer), its SGD step is the float64 finite-difference gradient's, it is
in ``state_dict`` and megatron-core's ``sharded_state_dict`` under each layer, saved at TP 2 it loads
at TP 1 exactly, and ``primus-ext convert`` carries it.  A table that is no parameter is refused.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from primus_ext.errors import UnsupportedConfigError
from primus_ext.megatron.checkpoint import convert_checkpoint, save_checkpoint
from primus_ext.testing import fake_primus_checkpoint as FP
from tests.megatron import gpt, learned_hooks
from tests.megatron.conftest import gloo_world, spawn_ranks

HOOKS = "tests.megatron.learned_hooks:"
KEY = "self_attention.core_attention.hook_tables.0"
START = torch.linspace(-0.5, 0.5, learned_hooks.HEADS, dtype=torch.float64)


def keys(score: str = "head_bias_64") -> dict:
    return dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="reference", use_sink_attention=True,
                turbo_flex_attention_score_mod=HOOKS + score)


def model(tp: int = 1) -> torch.nn.Module:
    with torch.no_grad():
        learned_hooks.HEAD_BIAS_64.copy_(START)
    cfg = gpt.config(tensor_model_parallel_size=tp, num_attention_heads=8, num_query_groups=4)
    return gpt.build_gpt(gpt.settings(**keys()), cfg).double()


def loss_of(m: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """float64 cross entropy (megatron-core's own casts the logits to float32: no finite differences there)."""
    logits = m(tokens, gpt.positions(tokens), None)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())


def test_the_table_is_one_parameter_of_the_model_and_steps_by_its_float64_gradient():
    m = model()
    table = learned_hooks.HEAD_BIAS_64
    assert sum(p is table for p in m.parameters()) == 1
    state = m.state_dict()
    assert [k for k in state if "hook_tables" in k] == [f"decoder.layers.{i}.{KEY}" for i in range(2)]
    sharded = m.sharded_state_dict()
    entries = [sharded[f"decoder.layers.{i}.{KEY}"] for i in range(2)]  # one layer axis, replicated over TP
    assert {e.key for e in entries} == {f"decoder.layers.{KEY}"} and {e.global_shape for e in entries} == {(2, 8)}
    tokens = gpt.batches(1)[0]
    m.train()
    eps = 1e-6
    numeric = torch.zeros_like(START)
    with torch.no_grad():  # the oracle: central differences of the loss, one head's entry at a time
        for h in range(len(START)):
            for sign in (1, -1):
                table[h] += sign * eps
                numeric[h] += sign * loss_of(m, tokens) / (2 * eps)
                table[h] -= sign * eps
    lr = 0.1
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    loss_of(m, tokens).backward()
    opt.step()
    assert not torch.equal(table.detach(), START)  # it trained
    torch.testing.assert_close(table.detach(), START - lr * numeric, rtol=0, atol=1e-9)


def test_a_table_that_is_no_parameter_is_refused_at_build():
    cfg = gpt.config(num_attention_heads=8, num_query_groups=4)
    with pytest.raises(UnsupportedConfigError) as err:
        gpt.build_gpt(gpt.settings(**keys("plain_head_bias")), cfg)
    assert "hook-learned-param" in err.value.codes
    assert "turbo_flex_attention_score_mod" in err.value.settings
    assert "torch.nn.Parameter" in str(err.value) and "requires_grad=False" in str(err.value)


def run_rank(rank: int, port: int, out_dir: str) -> None:
    """Save at TP 2 a model whose table was set to values of its own."""
    out = Path(out_dir)
    with gloo_world(rank, port, 2, tp=2):
        m = model(tp=2)
        with torch.no_grad():
            learned_hooks.HEAD_BIAS_64.copy_(torch.arange(8, dtype=torch.float64) / 8)
        if rank == 0:
            (out / "tp2").mkdir()
        torch.distributed.barrier()
        save_checkpoint(FP.training_state_dict(m, argparse.Namespace(tensor_model_parallel_size=2,
                                                                     params_dtype=torch.float64),
                                               optimizer_state=False), out / "tp2")
        torch.save({}, out / f"rank{rank}.pt")


def test_saved_at_tp2_the_table_loads_at_tp1_exactly_and_convert_carries_it(tmp_path):
    from megatron.core import dist_checkpointing

    spawn_ranks(run_rank, 2, tmp_path)
    saved = torch.arange(8, dtype=torch.float64) / 8
    m = model()
    loaded = dist_checkpointing.load({"model": m.sharded_state_dict()}, str(tmp_path / "tp2"))
    m.load_state_dict(loaded["model"], strict=False)
    assert torch.equal(learned_hooks.HEAD_BIAS_64.detach(), saved)
    convert_checkpoint(tmp_path / "tp2", tmp_path / "primus", to="primus")
    plain = dist_checkpointing.load_plain_tensors(str(tmp_path / "primus"))
    assert torch.equal(plain[f"decoder.layers.{KEY}"], saved.expand(2, 8))
