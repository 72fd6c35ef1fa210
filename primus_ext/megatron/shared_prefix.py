"""RL rows with a shared prefix: one prompt, its n responses after it, packed once.

GRPO-style post-training samples n responses per prompt; packing each after its own copy of
the prompt computes the prompt n times in every layer.  `pack_shared_prefix` packs the prompt
once, its responses after it, into one THD row that megatron-core's GPT takes as it takes any
packed row (``input_ids [1, T]``, ``position_ids [1, T]``, ``packed_seq_params``), with:

* position ids that continue each response from the end of its prompt, so that position
  embeddings (RoPE or learned) see what they see in the duplicated layout;
* `SharedPrefixSeqParams`: Megatron's `PackedSeqParams` (``cu_seqlens`` of every prompt,
  response and document) carrying the row's `SharedPrefixLayout`, which primus_ext's layers
  run as the tree mask (`primus_ext.call.shared_prefix`) and any other layer would run as
  plain documents: such a layer is refused, never run on the wrong mask (`layer_check`);
* the loss's targets: a response's first token is predicted at its prompt's last position,
  which n responses share, so a target is read from the logits by position
  (`SharedPrefixBatch.sequence_losses`), not by Megatron's shifted labels.
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from .. import refusals as R
from ..backends.shared_prefix import SharedPrefixLayout
from ..call.shared_prefix import check_planned
from .call_contract import CONTEXT

_MARKS = itertools.count(1)
from ..errors import short_repr


@dataclass
class SharedPrefixSeqParams(PackedSeqParams):
    """`PackedSeqParams` of a shared-prefix row: its boundaries, and the ``layout`` that says which
    segments are prompts and which their responses."""

    layout: Optional[SharedPrefixLayout] = None
    positions_given: Optional[int] = None
    """The mark of the model `prepare_shared_prefix` prepared whose forward gave the row its positions and its
    boundaries (a layer refuses a shared-prefix row without its own model's mark, `shared-prefix.positions`)."""


@dataclass(frozen=True)
class SharedPrefixBatch:
    """One packed shared-prefix row and its loss targets."""

    tokens: Tensor
    """``[1, T]`` token ids."""
    position_ids: Tensor
    """``[1, T]``: 0.. in each document and prompt, continuing from the prompt in each response."""
    packed_seq_params: SharedPrefixSeqParams
    target_tokens: Tensor
    """``[N]``: every token predicted (each response's, each document's but its first; prompts' if asked)."""
    target_positions: Tensor
    """``[N]``: the position of the row whose logits predict it."""
    target_sequence: Tensor
    """``[N]``: the sequence it belongs to, numbered as the duplicated layout's: each document, and each
    response with its copy of the prompt, in order."""
    sequences: int

    @property
    def layout(self) -> SharedPrefixLayout:
        assert self.packed_seq_params.layout is not None
        return self.packed_seq_params.layout

    def sequence_losses(self, logits: Tensor) -> Tensor:
        """``[sequences]`` summed cross-entropy of each sequence's targets, from ``logits`` ``[1, T, V]`` (or
        ``[T, 1, V]``, or ``[T, V]``) of this row."""
        flat = logits.reshape(-1, logits.shape[-1])
        work = torch.promote_types(flat.dtype, torch.float32)  # float64 logits stay float64
        losses = F.cross_entropy(flat.index_select(0, self.target_positions).to(work), self.target_tokens,
                                 reduction="none")
        return torch.zeros(self.sequences, dtype=losses.dtype, device=losses.device).index_add(
            0, self.target_sequence, losses)


def pack_shared_prefix(groups: Sequence[Any], *, prompt_loss: bool = False) -> SharedPrefixBatch:
    """A row of ``groups``: each a document (a 1-D token tensor) or a tree ``(prompt, [response, ...])`` of 1-D
    token tensors.  ``prompt_loss``: the prompt's own next-token targets are kept (once per response, as the
    duplicated layout has them once per copy), else only the responses' and documents'."""
    if isinstance(groups, (str, bytes, Tensor)) or not isinstance(groups, Sequence) or not groups:
        raise R.refuse(R.PREFIX_LAYOUT, got=short_repr(groups))
    items, parts = [], []
    for group in groups:
        if _tokens(group):
            items.append(group.numel())
            parts.append([group])
        elif (isinstance(group, (tuple, list)) and len(group) == 2 and _tokens(group[0])
              and isinstance(group[1], (tuple, list)) and all(_tokens(r) for r in group[1])):
            items.append((group[0].numel(), [r.numel() for r in group[1]]))
            parts.append([group[0], *group[1]])
        else:
            raise R.refuse(R.PREFIX_LAYOUT, got=f"the group {short_repr(group)} (token tensors expected)")
    device = parts[0][0].device
    layout = SharedPrefixLayout.of(items, device)
    tokens = torch.cat([t.reshape(-1) for row in parts for t in row]).reshape(1, -1)
    targets, at_positions, of_sequence = [], [], []
    at, sequence = 0, 0
    for item, row in zip(items, parts):
        if isinstance(item, int):
            targets.append(row[0].reshape(-1)[1:])
            at_positions.append(torch.arange(at, at + item - 1) if item else torch.arange(0))
            of_sequence.append(torch.full((max(item - 1, 0),), sequence))
            at, sequence = at + item, sequence + 1
            continue
        prompt_len, responses = item
        prompt = row[0].reshape(-1)
        prompt_end = offset = at + prompt_len
        for length, response in zip(responses or (0,), row[1:] or (None,)):
            if prompt_loss and prompt_len > 1:  # the prompt's own targets, once per copy
                targets.append(prompt[1:])
                at_positions.append(torch.arange(at, prompt_end - 1))
                of_sequence.append(torch.full((prompt_len - 1,), sequence))
            if length:
                # a response's first token is predicted at its prompt's last position (its own first, with none)
                first = torch.tensor([prompt_end - 1]) if prompt_len else torch.zeros(0, dtype=torch.long)
                targets.append(response.reshape(-1) if prompt_len else response.reshape(-1)[1:])
                at_positions.append(torch.cat([first, torch.arange(offset, offset + length - 1)]))
                of_sequence.append(torch.full((length if prompt_len else length - 1,), sequence))
            offset += length
            sequence += 1  # a response with its copy of the prompt (a prompt without responses: itself)
        at = offset
    # No boundaries until a prepared model's forward gives them: a model that was not prepared (any attention, also
    # one that is not primus_ext's) then has no boundaries to run the row as plain documents by.  The lengths stay:
    # megatron-core sizes its rotary table by them before any layer runs, and primus_ext's layers refuse the row.
    params = SharedPrefixSeqParams(qkv_format="thd", max_seqlen_q=layout.max_segment, max_seqlen_kv=layout.max_segment,
                                   layout=layout)
    as_long = dict(dtype=torch.long, device=device)
    return SharedPrefixBatch(
        tokens=tokens, position_ids=layout.positions.reshape(1, -1), packed_seq_params=params,
        target_tokens=torch.cat(targets).to(**as_long) if targets else torch.zeros(0, **as_long),
        target_positions=torch.cat(at_positions).to(**as_long) if at_positions else torch.zeros(0, **as_long),
        target_sequence=torch.cat(of_sequence).to(**as_long) if of_sequence else torch.zeros(0, **as_long),
        sequences=sequence)


def prepare_shared_prefix(model: torch.nn.Module) -> torch.nn.Module:
    """Make a megatron-core ``GPTModel`` give shared-prefix rows their positions; returns ``model``.

    megatron-core ignores ``position_ids`` for RoPE and numbers every THD segment from 0
    (``_apply_rotary_pos_emb_thd``), so a response would be rotated as if it started a sequence.  Prepared, the
    model's rotary table of a shared-prefix forward holds one row per token, at the token's position in the
    duplicated layout: megatron-core then slices it by the segments' packed offsets (its table covers every token),
    which gives each token its own row.  Learned absolute positions read ``position_ids``, filled in from the row
    where none are given.  Each forward hands its `SharedPrefixSeqParams` the layout's segments as boundaries and
    marks it with this model's mark, and a layer refuses a shared-prefix row without its own model's mark
    (`shared-prefix.positions`): an unprepared model never trains on wrong positions."""
    kind = getattr(model, "position_embedding_type", None)
    config = getattr(model, "config", None)
    problems = []
    if kind not in ("rope", "learned_absolute", "none"):
        problems.append(f"position_embedding_type={kind} (rope, learned_absolute and none are read here)")
    if kind == "rope" and getattr(config, "apply_rope_fusion", False):
        problems.append("apply_rope_fusion=True (the fused THD kernel numbers each segment from 0 itself)")
    if kind == "rope" and getattr(config, "multi_latent_attention", False):
        problems.append("multi_latent_attention=True (MLA applies RoPE inside its own attention)")
    problems += _unplanned_layers(model)
    if problems:
        raise R.refuse_build(R.PREFIX_MODEL, what="; ".join(problems))
    if getattr(model, "_primus_ext_shared_prefix", False):
        return model
    rotary = getattr(model, "rotary_pos_emb", None) if kind == "rope" else None
    # Which model positioned a row: a row positioned by this model is no proof for another (an RL reference model
    # scoring the policy's batch), and the mark must outlive the forward (a recomputed layer checks it again).
    mark = next(_MARKS)
    for module in model.modules():
        core = getattr(module, "core", None)
        if hasattr(core, "shared_prefix_mark"):  # primus_ext's layers (`TurboAttentionCore`)
            core.shared_prefix_mark = mark
    state: dict[str, Any] = {"layout": None}
    if rotary is not None:
        table = rotary.forward  # the bound (cached) method: a per-instance forward shadows it below

        def per_token(max_seq_len: int, *args: Any, **kwargs: Any) -> Tensor:
            layout = state["layout"]
            if layout is None:
                return table(max_seq_len, *args, **kwargs)
            # the whole table from position 0 (packed_seq: no CP slicing; CP > 1 is refused, B37-cp)
            cp_group = kwargs.get("cp_group", args[2] if len(args) > 2 else None)
            return table(max(layout.longest_position, 1), 0, True, cp_group).index_select(0, layout.positions)

        rotary.forward = per_token

    def before(module: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[tuple]:
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
        params = bound.arguments.get("packed_seq_params")
        layout = getattr(params, "layout", None)
        state["layout"] = layout
        if layout is None:
            return None
        given = bound.arguments.get("position_ids")
        if given is None:
            bound.arguments["position_ids"] = layout.positions.reshape(1, -1)
        elif not (isinstance(given, Tensor) and given.data_ptr() == layout.positions.data_ptr()
                  and given.numel() == layout.positions.numel()):
            raise R.refuse(R.PREFIX_POSITION_IDS, CONTEXT)
        _check_boundaries(params, layout, unset=True)  # boundaries a caller set are refused, not overwritten
        params.positions_given = mark
        params.cu_seqlens_q = params.cu_seqlens_kv = layout.segments
        return bound.args, bound.kwargs

    def after(*_: Any) -> None:
        state["layout"] = None

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, always_call=True)  # also after a forward that raised
    model._primus_ext_shared_prefix = True
    return model


def _unplanned_layers(model: torch.nn.Module) -> list[str]:
    """The attention layers that would run a shared-prefix row as plain documents: every megatron-core attention's
    core must be primus_ext's, planned with ``packed_shared_prefix: true``."""
    from megatron.core.transformer.attention import Attention

    found = []
    for name, module in model.named_modules():
        core = getattr(module, "core_attention", None) if isinstance(module, Attention) else None
        plan = getattr(core, "plan", None)
        if core is not None and not getattr(plan, "shared_prefix", False):
            why = "not planned with packed_shared_prefix: true" if plan is not None else "not primus_ext's"
            found.append(f"{name}.core_attention ({type(core).__name__}) is {why}, so it would run each response "
                         "without its prompt")
    return found


def checked_layout(plan: Any, params: Any, mark: Optional[int]) -> Optional[SharedPrefixLayout]:
    """The `SharedPrefixLayout` a layer's packed call carries (None: an ordinary call), or our refusal: a layer not
    planned for one, a row its own model (``mark``: the layer's, from `prepare_shared_prefix`) did not position,
    boundaries that are not the layout's."""
    layout = getattr(params, "layout", None)
    if layout is None:
        return None
    check_planned(plan)
    if mark is None or getattr(params, "positions_given", None) != mark:
        raise R.refuse(R.PREFIX_POSITIONS, CONTEXT, layer=getattr(plan, "layer_number", "?"))
    _check_boundaries(params, layout, unset=False)
    return layout


def _check_boundaries(params: Any, layout: SharedPrefixLayout, *, unset: bool) -> None:
    """The layout is the row: its params' boundaries are its segments (or, before a prepared forward, ``unset``,
    none), compared by identity so no call reads them."""
    for which in ("cu_seqlens_q", "cu_seqlens_kv"):
        bounds = getattr(params, which)
        if bounds is not layout.segments and not (unset and bounds is None):
            raise R.refuse(R.PREFIX_BOUNDS, CONTEXT, which=which)


def _tokens(value: Any) -> bool:
    return isinstance(value, Tensor) and not value.dtype.is_floating_point and value.dim() in (1, 2) and (
        value.dim() == 1 or value.shape[0] == 1)


__all__ = ["SharedPrefixBatch", "SharedPrefixSeqParams", "checked_layout", "pack_shared_prefix", "prepare_shared_prefix"]
