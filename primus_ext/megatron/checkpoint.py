"""Learned sinks between Primus's Megatron checkpoints and primus_ext's.

The same learned quantity is stored in two ways (torch_dist, megatron-core's distributed
checkpoint format, what Primus saves by default):

* Primus (``PrimusTurboAttention``, ``primus/backends/megatron/core/extensions/primus_turbo.py``
  at fd1eeab): ``...self_attention.core_attention.sinks``, created float32 with the *global*
  head count (l.881), saved replicated over tensor parallelism by megatron-core's
  ``sharded_state_dict_default`` (``megatron/core/transformer/utils.py`` l.209-250: the class
  defines no ``sharded_state_dict``);
* primus_ext (`primus_ext.megatron.sink`): ``...core_attention.softmax_offset``, megatron-core's
  own name, in ``params_dtype``, the TP rank's heads, sharded along heads.

In the file both are one global tensor ``[*layers, heads]``, so a conversion renames the key
and casts; a rank's slice is `primus_to_primus_ext`.  Values mean the same only where Primus
computed with the vector it saved: at TP 1.  At TP > 1 Primus hands every rank's kernel the
whole vector for its own heads (l.932, l.979), each rank's replica trains apart (no all-reduce), and
only TP rank 0's replica is saved, so that source is refused (``primus-checkpoint-tp``).

Inside training primus_ext's layers load ``softmax_offset`` only; `check_load_checkpoint`
refuses an unconverted Primus checkpoint (``primus-checkpoint-sinks``) instead of letting a
lenient ``dist_ckpt_strictness`` keep zero sinks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import Tensor

from .. import refusals as R
from ..errors import UnsupportedConfigError

PRIMUS_SINKS = "core_attention.sinks"
PRIMUS_EXT_SINKS = "core_attention.softmax_offset"
FORMATS = ("primus_ext", "primus")
MARKER = "primus_ext_sinks"
"""Common-state key the conversion to Primus adds: its sinks are primus_ext's whole vector (any TP)."""
TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's file naming a save directory's last iteration
CONVERTER = "primus-ext convert-checkpoint"


def _is(key: str, suffix: str) -> bool:
    return key == suffix or key.endswith("." + suffix)


def _renamed(key: str, old: str, new: str) -> str:
    return key[: len(key) - len(old)] + new


def primus_to_primus_ext(sinks: Tensor, *, tp_rank: int, tp_size: int, dtype: torch.dtype) -> Tensor:
    """A TP rank's ``softmax_offset`` from Primus's global ``sinks`` (heads last), cast to ``dtype``.

    Exact only for sinks Primus trained at TP 1 (`convert_checkpoint` checks that)."""
    heads = sinks.shape[-1]
    if tp_size < 1 or heads % tp_size or not 0 <= tp_rank < tp_size:
        raise R.refuse_build(R.CHECKPOINT_TP_SPLIT, "checkpoint", heads=heads, tp_size=tp_size, tp_rank=tp_rank)
    n = heads // tp_size
    return sinks[..., tp_rank * n:(tp_rank + 1) * n].to(dtype).clone()


def primus_ext_to_primus(shards: Sequence[Tensor]) -> Tensor:
    """Primus's global float32 ``sinks`` from primus_ext's ``softmax_offset`` shards, in TP rank order."""
    return torch.cat([s.detach().float() for s in shards], dim=-1)


@dataclasses.dataclass(frozen=True)
class SinkCheckpoint:
    """What a torch_dist checkpoint holds of learned sinks, read from its metadata and common state."""

    directory: str
    primus_keys: tuple[str, ...]
    primus_ext_keys: tuple[str, ...]
    tensor_model_parallel_size: Optional[int]
    params_dtype: Optional[torch.dtype]
    from_primus_ext: bool


def _refused(setting: str, reason: str, alternative: str, code: str) -> UnsupportedConfigError:
    found = {"primus-checkpoint-format": R.CHECKPOINT_FORMAT, "primus-checkpoint-tp": R.CHECKPOINT_TP,
             "primus-checkpoint-sinks": R.CHECKPOINT_SINKS}[code]
    return R.refuse_build(found, "checkpoint", setting=setting, what=reason, alternative=alternative)


def iteration_dir(path: str, step: Optional[int] = None) -> tuple[Path, Optional[str]]:
    """The checkpoint directory ``path`` names: itself, or the iteration its Megatron tracker (or
    ``step``) names under it; and the tracker's text when there is one."""
    root = Path(path)
    tracker = root / TRACKER
    if step is not None:
        text = str(step)
    elif tracker.is_file():
        text = tracker.read_text().strip()
    else:
        return root, None
    name = "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else None
    if name is None:
        raise _refused("SRC", f"{tracker} names no iteration ({text!r}).",
                       "pass the iteration directory itself (iter_XXXXXXX).", "primus-checkpoint-format")
    return root / name, text


def inspect_checkpoint(directory: str | os.PathLike) -> SinkCheckpoint:
    """Which sink keys a torch_dist checkpoint holds, and the Megatron args it was saved with."""
    from megatron.core import dist_checkpointing

    where = str(directory)
    with _read(where):  # megatron-core parses metadata.json here: a malformed one is a JSONDecodeError
        distributed = dist_checkpointing.check_is_distributed_checkpoint(where)
    if not distributed:
        raise _refused("SRC", f"{where} is not a Megatron distributed (torch_dist) checkpoint: no metadata.json "
                       "there (ckpt_format: torch writes per-rank mp_rank_*/ files instead).",
                       "pass an iteration directory of a torch_dist checkpoint (iter_XXXXXXX), or convert a "
                       "ckpt_format: torch one first with Megatron's own ckpt_convert_format: torch_dist.",
                       "primus-checkpoint-format")
    with _read(where):
        keys = list(dist_checkpointing.load_tensors_metadata(where))
        common = dist_checkpointing.load_common_state_dict(where)
    args = common.get("args")
    tp = getattr(args, "tensor_model_parallel_size", None)
    dtype = getattr(args, "params_dtype", None)
    return SinkCheckpoint(where, tuple(k for k in keys if _is(k, PRIMUS_SINKS)),
                          tuple(k for k in keys if _is(k, PRIMUS_EXT_SINKS)),
                          int(tp) if isinstance(tp, int) else None,
                          dtype if isinstance(dtype, torch.dtype) else None, bool(common.get(MARKER)))


@contextlib.contextmanager
def _read(where: str, setting: str = "SRC", doing: str = "read") -> Iterator[None]:
    """Every failure megatron-core or torch has reading (or writing) ``where``, as our error."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    try:
        yield
    except UnsupportedConfigError:
        raise
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - whatever megatron-core or torch raises
        raise _refused(setting, f"megatron-core could not {doing} the checkpoint {where} "
                       f"({type(exc).__name__}: {exc}).", "check that the directory is a complete torch_dist "
                       "checkpoint (metadata.json, .metadata, common.pt, *.distcp) and that DST is writable.",
                       "primus-checkpoint-format") from exc


def refuse_primus_tp(info: SinkCheckpoint) -> None:
    """Raise ``primus-checkpoint-tp`` unless Primus's saved sinks are the ones it computed with
    (saved at TP 1, or written by primus_ext's conversion)."""
    if info.from_primus_ext or not info.primus_keys or info.tensor_model_parallel_size == 1:
        return
    key = next((k for k in info.primus_keys if not k.startswith("optimizer.")), info.primus_keys[0])
    if info.tensor_model_parallel_size is None:
        why = "its common state has no Megatron args, so the tensor_model_parallel_size it was saved at is unknown"
    else:
        why = (f"it was saved at tensor_model_parallel_size: {info.tensor_model_parallel_size}. Primus keeps one "
               "vector of every head on each TP rank and hands each rank's kernel the whole vector for its own "
               "heads; the replicas train apart (no all-reduce) and only TP rank 0's was saved, so the saved "
               "entries are not what the other ranks' heads computed with")
    raise _refused("tensor_model_parallel_size",
                   f"{info.directory} holds Primus's learned sinks ({key}), but {why}; converted, they would "
                   "give primus_ext sinks Primus never trained.",
                   f"convert a checkpoint Primus saved at tensor_model_parallel_size: 1 ({CONVERTER} SRC DST "
                   "--to primus_ext; any target TP size loads it), or train the sinks in primus_ext.",
                   "primus-checkpoint-tp")


def _plan(info: SinkCheckpoint, to: str, params_dtype: Optional[torch.dtype]) -> tuple[str, str, torch.dtype]:
    """(old suffix, new suffix, the model tensors' dtype) of a conversion, or our refusal."""
    if to not in FORMATS:
        raise _refused("--to", f"unknown target format {to!r}.", f"use one of {', '.join(FORMATS)}.",
                       "primus-checkpoint-format")
    source, target = (PRIMUS_SINKS, PRIMUS_EXT_SINKS) if to == "primus_ext" else (PRIMUS_EXT_SINKS, PRIMUS_SINKS)
    has = info.primus_keys if to == "primus_ext" else info.primus_ext_keys
    if not has:
        other = info.primus_ext_keys if to == "primus_ext" else info.primus_keys
        state = f"is already in that format ({other[0]})" if other else f"holds no learned sinks ({source})"
        raise _refused("--to", f"{info.directory} {state}: there is nothing to convert to {to}.",
                       "load it as it is, or convert the other way.", "primus-checkpoint-format")
    if to == "primus":
        return source, target, torch.float32  # Primus's own dtype; its load casts to what its module holds
    refuse_primus_tp(info)
    dtype = params_dtype or info.params_dtype
    if dtype is None:
        raise _refused("params_dtype", f"{info.directory} records no params_dtype in its Megatron args.",
                       "give the dtype of the run that loads it: --params-dtype bf16 (or fp16, fp32).",
                       "primus-checkpoint-format")
    return source, target, dtype


@dataclasses.dataclass(frozen=True)
class Conversion:
    """What `convert_checkpoint` wrote."""

    source: str
    target: str
    renamed: tuple[tuple[str, str], ...]
    copied_tensors: int
    copied_objects: int


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, *, to: str,
                       params_dtype: Optional[torch.dtype] = None) -> Conversion:
    """Convert a whole torch_dist checkpoint's learned sinks to ``to`` (``primus_ext`` or ``primus``).

    Every ``core_attention`` sink tensor (each layer's; optimizer states in the model's key space
    too) is renamed; the model's are cast (to ``params_dtype``, by default the source's
    ``args.params_dtype``, for primus_ext; to float32 for Primus), optimizer states keep theirs.
    Every other tensor, object and common-state entry is copied unchanged.  ``src`` may be a save
    directory with Megatron's tracker: ``dst`` then gets the same iteration and tracker.  Refused
    with our error: a Primus source saved at TP > 1, a non-empty ``dst``, a non-torch_dist source."""
    src_dir, tracker = iteration_dir(str(src))
    dst_root = Path(dst)
    dst_dir = dst_root / src_dir.name if tracker is not None else dst_root
    if dst_root.exists() and any(dst_root.iterdir()):
        raise _refused("DST", f"{dst_root} exists and is not empty.", "name a new or empty directory.",
                       "primus-checkpoint-format")
    info = inspect_checkpoint(src_dir)
    old, new, dtype = _plan(info, to, params_dtype)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    where = str(src_dir)
    with one_process_world(), _read(where):
        metadata = load_sharded_metadata(where)
        loaded = dist_checkpointing.load(metadata, where, validate_access_integrity=False)
        common = dist_checkpointing.load_common_state_dict(where)
    state: dict[str, Any] = {k: v for k, v in common.items() if k != MARKER}
    if to == "primus":
        state[MARKER] = True  # a later conversion back may trust the vector at any TP size
    sharded: dict[str, Any] = {}
    renamed, tensors, objects = [], 0, 0
    for name, meta in metadata.items():
        value = loaded[name]
        if isinstance(meta, ShardedObject):
            sharded[name] = ShardedObject(meta.key, value, meta.global_shape, meta.global_offset, replica_id=0)
            objects += 1
            continue
        key = meta.key
        if _is(key, old):
            key = _renamed(key, old, new)
            if not key.startswith("optimizer."):  # optimizer states keep their own (float32) precision
                value = value.to(dtype)
            renamed.append((meta.key, key))
        else:
            tensors += 1
        sharded[name] = ShardedTensor.from_rank_offsets(key, value, replica_id=0)
    state["__sharded__"] = sharded  # an emptied dict is not saved: the common state stays as it was
    dst_dir.mkdir(parents=True, exist_ok=True)
    with one_process_world(), _read(str(dst_dir), "DST", "write"):
        save_checkpoint(state, dst_dir)
    if tracker is not None:
        (dst_root / TRACKER).write_text(tracker)
    return Conversion(where, str(dst_dir), tuple(renamed), tensors, objects)


@contextlib.contextmanager
def one_process_world() -> Iterator[None]:
    """A gloo world of one process for megatron-core's checkpoint calls (kept if one exists)."""
    if torch.distributed.is_initialized():
        if torch.distributed.get_world_size() != 1:
            raise _refused("WORLD_SIZE", "the offline conversion runs in one process; this one is part of a "
                           f"world of {torch.distributed.get_world_size()}.", f"run {CONVERTER} on its own.",
                           "primus-checkpoint-format")
        yield
        return
    # A HashStore needs no port: the converter may run where no network is open.
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def save_checkpoint(state_dict: dict, directory: str | os.PathLike) -> None:
    """``megatron.core.dist_checkpointing.save`` into ``directory``, synchronously on the host.

    megatron-core 0.16's torch_dist writer stages tensors through CUDA (``torch.cuda.synchronize``
    in ``FileSystemWriterAsync.preload_tensors``, a CUDA tensor in
    ``save_state_dict_async_finalize``) and needs ``psutil`` in its writer processes (without it
    they fail and the save waits for ever).  `_HostSaveStrategy` writes the same format with
    torch's synchronous ``FileSystemWriter``, through megatron-core's own key translation and
    planner; megatron-core writes the common state and ``metadata.json`` itself."""
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(state_dict, str(directory), sharded_strategy=_host_save_strategy())


def _host_save_strategy() -> Any:
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

    class _HostSaveStrategy(mcore_torch.TorchDistSaveShardedStrategy):
        """megatron-core's torch_dist save, without its CUDA-staged asynchronous writer."""

        def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
            # The first half of megatron-core's async_save: MCore ShardedTensors to PyT ones.
            flat, _, _ = mcore_torch._replace_state_dict_keys_with_sharded_keys(  # noqa: SLF001 - no public twin
                sharded_state_dict, self.keep_only_main_replica)
            dcp.save(mcore_torch.mcore_to_pyt_state_dict(flat, False),
                     storage_writer=dcp.FileSystemWriter(str(checkpoint_dir), thread_count=self.thread_count),
                     planner=mcore_torch.MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                                          flatten_state_dict=False))

    return _HostSaveStrategy("torch_dist", 1)


def check_load_checkpoint(args: Any) -> None:
    """Refuse a run of primus_ext's learned sinks that would load an unconverted Primus checkpoint.

    Reads Megatron's ``load`` (and ``pretrained_checkpoint``, ``ckpt_step``): where the checkpoint
    holds Primus's ``core_attention.sinks`` and no ``softmax_offset``, primus_ext's layers would find
    nothing to load; megatron-core stops on that under ``dist_ckpt_strictness:
    assume_ok_unexpected``, and keeps the zero initialisation under the values that tolerate
    missing keys (``log_all``, ``ignore_all``, ...).  No checkpoint there yet: nothing to check."""
    learned = bool(getattr(args, "use_sink_attention", False)) or getattr(args, "softmax_type", "") == "learnable"
    if not (getattr(args, "use_turbo_flex_attention", False) and learned):
        return
    for setting in ("load", "pretrained_checkpoint"):
        path = getattr(args, setting, None)
        if not path:
            continue
        directory, _ = iteration_dir(str(path), getattr(args, "ckpt_step", None))
        if not (directory / "metadata.json").is_file():
            continue  # a fresh run, or not torch_dist: Megatron reports that itself
        info = inspect_checkpoint(directory)
        if info.primus_keys and not info.primus_ext_keys:
            raise _refused(setting, f"{setting}: {path} holds Primus's learned sinks ({info.primus_keys[0]}) and "
                           "no softmax_offset, which is what primus_ext's layers load: unconverted, they would "
                           "either stop the load or keep zero sinks.",
                           f"convert it first ({CONVERTER} {path} NEW_DIR --to primus_ext) and set {setting}: "
                           "NEW_DIR.", "primus-checkpoint-sinks")


__all__ = ["CONVERTER", "Conversion", "FORMATS", "MARKER", "PRIMUS_EXT_SINKS", "PRIMUS_SINKS", "SinkCheckpoint",
           "check_load_checkpoint", "convert_checkpoint", "inspect_checkpoint", "iteration_dir",
           "one_process_world", "primus_ext_to_primus", "primus_to_primus_ext", "refuse_primus_tp",
           "save_checkpoint"]
