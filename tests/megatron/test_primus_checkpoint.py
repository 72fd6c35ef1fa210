"""Learned sinks move between Primus's Megatron checkpoints and primus_ext's
(`primus_ext.megatron.checkpoint`, ``primus-ext convert-checkpoint``).

Primus's side is `primus_ext.testing.fake_primus_checkpoint`: its core attention's ``sinks``
(fp32, global heads, saved replicated by megatron-core's default sharded state dict).  Both
sides are tiny megatron-core GPTs saved and loaded through megatron-core's own
``dist_checkpointing`` (torch_dist); TP 2 runs in two gloo processes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from megatron.core import dist_checkpointing
from megatron.core.models.gpt import GPTModel
from torch.distributed.checkpoint.api import CheckpointException

from primus_ext.cli import main as cli
from primus_ext.errors import UnsupportedConfigError
from primus_ext.megatron.checkpoint import (MARKER, check_load_checkpoint, convert_checkpoint, inspect_checkpoint,
                                            primus_ext_to_primus, primus_to_primus_ext, save_checkpoint)
from primus_ext.testing import fake_primus_checkpoint as FP

from . import gpt
from tests.megatron.conftest import gloo_world, spawn_ranks

SINK_KEY = "decoder.layers.self_attention.core_attention.sinks"
OFFSET_KEY = "decoder.layers.self_attention.core_attention.softmax_offset"
SINKS = torch.tensor([[0.5, -0.25, 1.0, 0.3], [-1.0, 0.75, 0.1, -0.6]])  # [layer, global head]; 0.3, 0.1: not bf16
EXT = dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="reference", use_sink_attention=True)
BF16 = dict(params_dtype=torch.bfloat16, bf16=True)
TP = 2


def primus_gpt(tp: int = 1, **cfg) -> GPTModel:
    torch.manual_seed(0)
    return GPTModel(config=gpt.config(tensor_model_parallel_size=tp, **cfg), transformer_layer_spec=FP.gpt_layer_spec(),
                    vocab_size=gpt.VOCAB, max_sequence_length=gpt.SEQ * 4, position_embedding_type="learned_absolute")


def ext_gpt(tp: int = 1, **cfg) -> GPTModel:
    return gpt.build_gpt(gpt.settings(**EXT), gpt.config(tensor_model_parallel_size=tp, **cfg), seed=1)


def megatron_args(tp: int, dtype: torch.dtype = torch.bfloat16, **more) -> argparse.Namespace:
    return argparse.Namespace(tensor_model_parallel_size=tp, params_dtype=dtype, **more)


def set_sinks(model: GPTModel, values: torch.Tensor) -> None:
    with torch.no_grad():
        for param, row in zip(FP.sinks_of(model), values):
            param.copy_(row)


def save(model: GPTModel, directory: Path, args: argparse.Namespace) -> Path:
    directory.mkdir(parents=True)
    save_checkpoint(FP.training_state_dict(model, args), directory)
    return directory


def load_into(model: GPTModel, directory: Path, strict: str = "assume_ok_unexpected") -> GPTModel:
    """Megatron-LM's way: the model's sharded state dict filled from the checkpoint, then loaded."""
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(directory), strict=strict)
    model.load_state_dict(loaded["model"], strict=strict == "assume_ok_unexpected")
    return model


def plain(directory: Path) -> dict:
    """Every tensor of a checkpoint, whole, by key (megatron-core's own reader)."""
    keys = dist_checkpointing.load_tensors_metadata(str(directory))
    return {k: v for k, v in dist_checkpointing.load_plain_tensors(str(directory)).items() if k in keys}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def primus_tp1(root) -> Path:
    """What Primus saved at TP 1: sinks set on its fp32 module, a bf16 run's args."""
    model = primus_gpt()
    set_sinks(model, SINKS)
    return save(model, root / "primus_tp1", megatron_args(1))


@pytest.fixture(scope="module")
def ext_from_primus(root, primus_tp1) -> Path:
    return Path(convert_checkpoint(primus_tp1, root / "ext_from_primus", to="primus_ext").target)


def test_rank_mapping_slices_casts_and_gathers_back():
    shards = [primus_to_primus_ext(SINKS, tp_rank=r, tp_size=TP, dtype=torch.bfloat16) for r in range(TP)]
    assert [s.shape for s in shards] == [(2, 2), (2, 2)] and shards[0].dtype == torch.bfloat16
    torch.testing.assert_close(primus_ext_to_primus(shards), SINKS.bfloat16().float(), rtol=0, atol=0)
    assert primus_ext_to_primus(shards).dtype == torch.float32
    with pytest.raises(UnsupportedConfigError) as err:
        primus_to_primus_ext(SINKS, tp_rank=0, tp_size=3, dtype=torch.float32)
    assert "tensor_model_parallel_size" in err.value.settings


def test_tp1_round_trip_primus_to_primus_ext_to_primus(root, primus_tp1, ext_from_primus):
    source, ext = plain(primus_tp1), plain(ext_from_primus)
    assert set(ext) == set(source) - {SINK_KEY, f"optimizer.state.exp_avg.{SINK_KEY}"} | {
        OFFSET_KEY, f"optimizer.state.exp_avg.{OFFSET_KEY}"}
    assert ext[OFFSET_KEY].dtype == torch.bfloat16  # the run's params_dtype, from its args
    torch.testing.assert_close(ext[OFFSET_KEY], SINKS.bfloat16(), rtol=0, atol=0)
    assert ext[f"optimizer.state.exp_avg.{OFFSET_KEY}"].dtype == torch.float32  # optimizer states keep theirs
    model = load_into(ext_gpt(**BF16), ext_from_primus)
    for param, row in zip(FP.sinks_of(model), SINKS):
        assert param.dtype == torch.bfloat16
        torch.testing.assert_close(param.detach(), row.bfloat16(), rtol=0, atol=0)

    back = Path(convert_checkpoint(ext_from_primus, root / "primus_again", to="primus").target)
    again = plain(back)
    assert set(again) == set(source)
    assert again[SINK_KEY].dtype == torch.float32  # Primus's own dtype
    torch.testing.assert_close(again[SINK_KEY], SINKS.bfloat16().float(), rtol=0, atol=0)
    assert all(torch.equal(again[k], v) for k, v in source.items() if "core_attention.sinks" not in k)
    primus = load_into(primus_gpt(), back)
    torch.testing.assert_close(torch.stack([p.detach() for p in FP.sinks_of(primus)]), SINKS.bfloat16().float())
    common = dist_checkpointing.load_common_state_dict(str(back))
    assert common.pop(MARKER) is True and common == dist_checkpointing.load_common_state_dict(str(primus_tp1))


def test_converted_sinks_compute_what_primus_computed(root):
    """fp32 end to end: Primus's model and primus_ext's, loaded from the converted checkpoint, give one output."""
    primus = primus_gpt()
    set_sinks(primus, SINKS)
    source = save(primus, root / "primus_fp32", megatron_args(1, torch.float32))
    ext = load_into(ext_gpt(), Path(convert_checkpoint(source, root / "ext_fp32", to="primus_ext").target))
    tokens = gpt.batches(1)[0]
    torch.testing.assert_close(gpt.logits(ext, tokens), gpt.logits(primus, tokens), rtol=1e-5, atol=1e-5)
    set_sinks(ext, torch.zeros_like(SINKS))  # the sinks matter: without them the outputs differ
    assert not torch.allclose(gpt.logits(ext, tokens), gpt.logits(primus, tokens), atol=1e-3)


def run_rank(rank: int, port: int, out_dir: str) -> None:
    """One TP rank: load the converted checkpoint into primus_ext at TP 2 and save it again; save a
    Primus TP 2 checkpoint whose replicas diverged (rank 1's sinks are not rank 0's)."""
    out = Path(out_dir)
    with gloo_world(rank, port, TP, tp=TP) as parallel_state:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        model = load_into(ext_gpt(TP, **BF16), out / "ext_from_primus")
        loaded = [p.detach().clone() for p in FP.sinks_of(model)]
        save_checkpoint(FP.training_state_dict(model, megatron_args(TP)), _mkdir(out / "ext_tp2", rank))
        primus = primus_gpt(TP)
        set_sinks(primus, SINKS + 10 * tp_rank)
        save_checkpoint(FP.training_state_dict(primus, megatron_args(TP)), _mkdir(out / "primus_tp2", rank))
        torch.save(dict(tp_rank=tp_rank, loaded=loaded), out / f"rank{rank}.pt")


def _mkdir(path: Path, rank: int) -> Path:
    if rank == 0:
        path.mkdir(exist_ok=True)
    torch.distributed.barrier()
    return path


@pytest.fixture(scope="module")
def tp2(root, ext_from_primus, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("tp2")
    (out / "ext_from_primus").symlink_to(ext_from_primus)
    records = sorted(spawn_ranks(run_rank, TP, out), key=lambda r: r["tp_rank"])
    return dict(out=out, records=records)


def test_tp2_round_trip_primus_to_primus_ext_to_primus(tp2, root):
    for record in tp2["records"]:  # each rank loaded its heads of the global vector, cast to bf16
        expected = primus_to_primus_ext(SINKS, tp_rank=record["tp_rank"], tp_size=TP, dtype=torch.bfloat16)
        torch.testing.assert_close(torch.stack(record["loaded"]), expected, rtol=0, atol=0)
    gathered = primus_ext_to_primus([torch.stack(r["loaded"]) for r in tp2["records"]])
    back = Path(convert_checkpoint(tp2["out"] / "ext_tp2", root / "primus_from_tp2", to="primus").target)
    torch.testing.assert_close(plain(back)[SINK_KEY], gathered, rtol=0, atol=0)
    torch.testing.assert_close(gathered, SINKS.bfloat16().float(), rtol=0, atol=0)
    # written by primus_ext from every rank's shard: converting it back is exact at TP 2 too
    again = Path(convert_checkpoint(back, root / "ext_again", to="primus_ext").target)
    torch.testing.assert_close(plain(again)[OFFSET_KEY], SINKS.bfloat16(), rtol=0, atol=0)


def test_a_primus_checkpoint_saved_at_tp2_is_refused(tp2, root):
    source = tp2["out"] / "primus_tp2"
    torch.testing.assert_close(plain(source)[SINK_KEY], SINKS)  # rank 0's replica only: rank 1's is lost
    with pytest.raises(UnsupportedConfigError) as err:
        convert_checkpoint(source, root / "refused", to="primus_ext")
    assert err.value.codes == ("primus-checkpoint-tp",)
    assert err.value.settings == ("tensor_model_parallel_size",)
    message = str(err.value)
    assert SINK_KEY in message and "tensor_model_parallel_size: 2" in message and "convert-checkpoint" in message
    assert not (root / "refused").exists()


def test_sinks_saved_without_megatron_args_are_refused(root):
    model = primus_gpt()
    set_sinks(model, SINKS)
    directory = root / "no_args"
    directory.mkdir()
    state = FP.training_state_dict(model, None)
    del state["args"]
    save_checkpoint(state, directory)
    with pytest.raises(UnsupportedConfigError) as err:
        convert_checkpoint(directory, root / "no_args_out", to="primus_ext", params_dtype=torch.float32)
    assert err.value.codes == ("primus-checkpoint-tp",) and "unknown" in str(err.value)


def test_the_cli_converts_a_whole_save_directory(root, primus_tp1, capsys):
    save_dir = root / "primus_save"
    save_dir.mkdir()
    (save_dir / "iter_0000007").symlink_to(primus_tp1)
    (save_dir / "latest_checkpointed_iteration.txt").write_text("7")
    assert cli(["convert-checkpoint", str(save_dir), str(root / "cli_out"), "--to", "primus_ext"]) == 0
    assert SINK_KEY in capsys.readouterr().out
    assert (root / "cli_out" / "latest_checkpointed_iteration.txt").read_text() == "7"
    out_dir = root / "cli_out" / "iter_0000007"
    source, converted = plain(primus_tp1), plain(out_dir)
    assert all(torch.equal(converted[k], v) for k, v in source.items() if "core_attention.sinks" not in k)
    assert len([k for k in source if "core_attention.sinks" not in k]) >= 20
    objects = {k: v for k, v in dist_checkpointing.load(_objects(primus_tp1), str(out_dir),
                                                        validate_access_integrity=False).items() if "/" in k}
    assert objects == {k: v for k, v in dist_checkpointing.load(_objects(primus_tp1), str(primus_tp1),
                                                                validate_access_integrity=False).items() if "/" in k}
    assert any(k.startswith("rng_state") for k in objects)
    assert dist_checkpointing.load_common_state_dict(str(out_dir)) == \
        dist_checkpointing.load_common_state_dict(str(primus_tp1))


def _objects(directory: Path) -> dict:
    from megatron.core.dist_checkpointing import ShardedObject
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    return {k: v for k, v in load_sharded_metadata(str(directory)).items() if isinstance(v, ShardedObject)}


def test_the_cli_refuses_with_exit_status_2(tp2, root, primus_tp1, capsys):
    assert cli(["convert-checkpoint", str(tp2["out"] / "primus_tp2"), str(root / "x"), "--to", "primus_ext"]) == 2
    err = capsys.readouterr().err
    assert SINK_KEY in err and "tensor_model_parallel_size" in err
    (root / "full").mkdir()
    (root / "full" / "file").write_text("x")
    assert cli(["convert-checkpoint", str(primus_tp1), str(root / "full"), "--to", "primus_ext"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert cli(["convert-checkpoint", str(root / "full"), str(root / "y"), "--to", "primus_ext"]) == 2
    assert "torch_dist" in capsys.readouterr().err
    assert cli(["convert-checkpoint", str(primus_tp1), str(root / "z"), "--to", "primus"]) == 2
    assert "nothing to convert" in capsys.readouterr().err


def test_an_unconverted_primus_checkpoint_never_loads_as_zero_sinks(primus_tp1, ext_from_primus):
    with pytest.raises(CheckpointException) as err:  # Megatron's default strictness (Primus's too) stops the load
        load_into(ext_gpt(**BF16), primus_tp1)
    assert "softmax_offset" in str(err.value)
    lenient = load_into(ext_gpt(**BF16), primus_tp1, strict="log_all")  # what check_load_checkpoint is for:
    assert all(not p.any() for p in FP.sinks_of(lenient))  # a lenient strictness keeps the zero initialisation
    args = megatron_args(1, load=str(primus_tp1), dist_ckpt_strictness="log_all", **EXT)
    with pytest.raises(UnsupportedConfigError) as refused:
        check_load_checkpoint(args)
    assert refused.value.codes == ("primus-checkpoint-sinks",) and refused.value.settings == ("load",)
    assert "convert-checkpoint" in str(refused.value) and SINK_KEY in str(refused.value)
    check_load_checkpoint(megatron_args(1, load=str(ext_from_primus), **EXT))  # converted: loads
    check_load_checkpoint(megatron_args(1, load=str(primus_tp1)))  # not primus_ext's sinks: not ours to check
    assert inspect_checkpoint(ext_from_primus).primus_ext_keys == (OFFSET_KEY, f"optimizer.state.exp_avg.{OFFSET_KEY}")


def test_the_primus_patch_refuses_an_unconverted_load_before_the_model_is_built(primus_tp1, ext_from_primus):
    from primus_ext.primus import register
    from primus_ext.testing import fake_primus as P

    module = {"enable_primus_turbo": True, "use_turbo_attention": True, **EXT, "load": str(primus_tp1)}
    with P.installed() as registry:
        assert register()
        with pytest.raises(UnsupportedConfigError) as refused:  # from the condition: Primus does not swallow it
            P.run_lifecycle(registry, P.megatron_args({}, module))
        assert "primus-checkpoint-sinks" in refused.value.codes
    with P.installed() as registry:
        assert register()
        P.run_lifecycle(registry, P.megatron_args({}, {**module, "load": str(ext_from_primus)}))  # converted: runs
