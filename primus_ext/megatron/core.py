"""The forward core shared by both Turbo attention modules.

Megatron's contract in: ``query, key, value`` sbhd ``[S, B, H, D]`` (or thd
``[T, H, D]`` with ``packed_seq_params.qkv_format == "thd"``), ``attention_mask``,
``attn_mask_type``, ``attention_bias``, ``packed_seq_params``.  Megatron's contract
out: ``[S, B, H * Dv]`` (or ``[T, H * Dv]``).  In between, one kernel call on the
flex adapter or the direct entries, chosen and checked at construction.
"""

from __future__ import annotations

import dataclasses
import functools

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from ..backends.base import CallArgs, fp32_sink
from ..backends.direct import DirectRunner, choose_direct
from ..backends.layout import kernel_views, thd_views
from ..backends.turbo import load_ops
from ..call.adapter import TurboFlexAttention
from ..call.direct import DirectTarget
from ..call.checks import (assert_on_device, check_head_dims, check_heads, check_packed, check_packing, check_qkv,
                           check_same_boundaries, empty_result, no_queries)
from ..call.ops import register_target, run_call
from ..call.shared_prefix import check_tokens, run_shared_prefix, shared_prefix_attention
from ..call.selftest import refuse_failures, self_test, selftest_enabled
from ..errors import UnsupportedInputError
from ..plan import AttentionPlan, build_plan
from .. import refusals as R
from ..refusals import (ATTENTION_BIAS, BOTTOM_RIGHT, BOUNDS_NOT_THD, CALL_RULES, CU_DEVICE, MASK_TYPE, MASK_WITH_THD,
                        MISSING_SINK, NO_PACKED_ENTRY, PADDED, PADDED_TYPE, THD_WITHOUT_BOUNDS, TOP_LEFT,
                        WINDOW_ALIGNMENT, refuse)
from ..settings import TurboAttentionSettings
from .args import megatron_arg, settings_or_megatron_args, with_megatron_flags
from .call_contract import MaskCheck, qkv_format
from .context_parallel import LayerContextParallel, layer_context_parallel
from .document_mask import document_boundaries
from .facts import layer_facts
from .dropout_rng import LayerDropoutRng, model_parallel_tracker
from .rank_agreement import RankAgreement, agreement_group
from .shared_prefix import checked_layout


CONTEXT = "Megatron core attention"


def tensor_parallel(config: Any, pg_collection: Any) -> Tuple[int, int]:
    """``(size, rank)`` of the layer's tensor parallelism: ``pg_collection.tp``, else the config's size and
    megatron-core's tensor-parallel rank (0 where its parallel state is not set up)."""
    group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
    if group is not None:
        size, rank = group.size(), group.rank()
    else:
        from megatron.core import parallel_state

        size = int(config.tensor_model_parallel_size)
        try:
            rank = parallel_state.get_tensor_model_parallel_rank()
        except AssertionError:  # no parallel state: a single rank
            rank = 0
    if not 0 <= rank < size:
        raise R.refuse_build(R.TP_RANK, "Megatron core attention", rank=rank, size=size)
    return size, rank


_UNEQUAL_DOCUMENTS = "cu_seqlens_q != cu_seqlens_kv (documents of unequal q and kv lengths)"


class TurboAttentionCore:
    """Plan + kernel binding of one layer; `forward` speaks Megatron's contract."""

    default_qkv_format = "sbhd"
    shared_prefix_mark: Optional[int] = None  # set by `prepare_shared_prefix` on its model's layers

    def __init__(self, *, config: Any, layer_number: int, attn_mask_type: Any, attention_dropout: Optional[float],
                 softmax_scale: Optional[float], k_channels: Optional[int], v_channels: Optional[int],
                 cp_comm_type: Optional[str], pg_collection: Any,
                 settings: Optional[TurboAttentionSettings]) -> None:
        self.settings = with_megatron_flags(settings_or_megatron_args(settings), config)
        tp, tp_rank = tensor_parallel(config, pg_collection)
        heads = config.num_attention_heads // tp
        groups = (config.num_query_groups or config.num_attention_heads) // tp
        self.attn_mask_type = attn_mask_type
        mask_name = getattr(attn_mask_type, "name", str(attn_mask_type))
        self.dropout = float(config.attention_dropout if attention_dropout is None else attention_dropout)
        self.facts = layer_facts(
            config, max(1, layer_number),
            num_heads=heads,
            num_kv_heads=max(groups, 1),
            head_dim=int(k_channels or config.kv_channels),
            head_dim_v=int(v_channels or config.kv_channels),
            causal=mask_name in ("causal", "causal_bottom_right"),
            attn_mask_type=mask_name,
            attention_dropout=self.dropout,
            softmax_scale=softmax_scale if softmax_scale is not None else config.softmax_scale,
            cp_comm_type=cp_comm_type,
            runs_here=True,  # built to run in this process: auto plans flex only with a GPU here
            position_embedding_type=getattr(config, "position_embedding_type", None)
            or megatron_arg("position_embedding_type", "learned_absolute"),
            turbo_module=True,
            tp_rank=tp_rank,  # hooks see the model's head index (`primus_ext.attention.heads`)
            rng_tracker=model_parallel_tracker() is not None,  # B30-rng
        )
        self.plan: AttentionPlan = build_plan(self.settings, self.facts)
        pattern = self.plan.pattern
        self.check_mask = MaskCheck(pattern is not None and pattern.right == 0 and self.plan.score_hook is None,
                                    pattern.describe() if pattern is not None else f"the hook {self.plan.mask_hook}")
        if selftest_enabled(self.settings.turbo_selftest):
            refuse_failures(self_test([self.plan]), f"layer {self.facts.layer_number}")
        self.storage = self.plan.storage  # a constant per layer, as a compiled region needs
        # Whether unequal q and kv lengths (or documents) are refused: a constant, so no refusal is built per call.
        self.unequal_refused = self._alignment_rule is not None
        # Context parallel: Ulysses around the per-rank attention, which gets this rank's heads
        # of the whole sequence (`primus_ext.megatron.context_parallel`); None at CP 1.
        self.cp: Optional[LayerContextParallel] = layer_context_parallel(
            self.facts.context_parallel_size, pg_collection, self.check_mask.layer_is_causal, self.check_mask.what)
        self.agreement = RankAgreement(agreement_group(pg_collection))
        ulysses = self.cp.ulysses if self.cp is not None else None
        cp_rank, cp_size = (ulysses.rank, ulysses.size) if ulysses is not None else (0, 1)
        self.dropout_rng = LayerDropoutRng(tp * cp_size, cp_rank, cp_size)
        self.adapter: Optional[TurboFlexAttention] = None
        self.runner: Optional[DirectRunner] = None
        if self.plan.flex:
            self.adapter = TurboFlexAttention(self.cp.local_plan(self.plan) if self.cp is not None else self.plan)
        else:
            entries = choose_direct(load_ops(), fp8=self.settings.enable_turbo_attention_float8,
                                    context_parallel=self.cp is not None)
            self.runner = DirectRunner(load_ops(), entries)
            self.direct = DirectTarget(self.runner, self.plan.arch, self.plan.selection, self.plan.equal_documents,
                                       self.plan.turbo_build)
            self.handle = register_target(self.direct, owner=self)

    @property
    def local_heads(self) -> int:
        return self.facts.num_heads

    # -- input checks ------------------------------------------------------------
    def _check_call(self, attn_mask_type: Any, attention_bias: Optional[Tensor]) -> None:
        if attention_bias is not None:
            raise refuse(ATTENTION_BIAS, CONTEXT)
        if attn_mask_type is not None and attn_mask_type != self.attn_mask_type:
            raise refuse(MASK_TYPE, CONTEXT, asked=attn_mask_type, built=self.attn_mask_type)

    def _packing(self, packed_seq_params: Any, fmt: str) -> Optional[Any]:
        """The packed params when this call is thd, None when dense; refuse anything ambiguous."""
        if packed_seq_params is None:
            return None
        has_bounds = packed_seq_params.cu_seqlens_q is not None or packed_seq_params.cu_seqlens_kv is not None
        if self.plan.packed_entry is None:
            raise refuse(NO_PACKED_ENTRY, CONTEXT, entry=self.plan.dense_entry)
        if fmt != "thd":
            if has_bounds:
                raise refuse(BOUNDS_NOT_THD, CONTEXT, fmt=fmt)
            return None
        if packed_seq_params.cu_seqlens_q is None or packed_seq_params.cu_seqlens_kv is None:
            raise refuse(THD_WITHOUT_BOUNDS, CONTEXT)
        for plain, padded in (("cu_seqlens_q", "cu_seqlens_q_padded"), ("cu_seqlens_kv", "cu_seqlens_kv_padded")):
            pad = getattr(packed_seq_params, padded)
            ref = getattr(packed_seq_params, plain)
            if pad is None or pad is ref:
                continue
            if not isinstance(pad, Tensor) or not isinstance(ref, Tensor):
                bad = padded if not isinstance(pad, Tensor) else plain
                raise refuse(PADDED_TYPE, CONTEXT, name=bad, kind=type(getattr(packed_seq_params, bad)).__name__)
            if pad.device != ref.device:  # compared below: on one device, or not at all
                raise refuse(CU_DEVICE, CONTEXT, name=padded, device=pad.device, inputs=ref.device)
            if pad.shape == ref.shape and torch.compiler.is_compiling():
                # No host read inside a graph: the check op refuses when the graph runs (our error on CPU).
                why = PADDED.reason_for(padded=padded, plain=plain).reason
                # Plain strings in the closure: Dynamo keeps the refusal as a constant.
                assert_on_device((pad == ref).all(), why, lambda p=padded, q=plain: refuse(PADDED, CONTEXT, padded=p,
                                                                                            plain=q))
                continue
            # One host comparison per batch, only when distinct padded boundaries are given (B19).
            if pad.shape != ref.shape or not torch.equal(pad.to(ref.device), ref):
                raise refuse(PADDED, CONTEXT, padded=padded, plain=plain)
        return packed_seq_params

    # -- forward -----------------------------------------------------------------
    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Any = None, attention_bias: Optional[Tensor] = None,
                packed_seq_params: Any = None, *, sink: Optional[Tensor] = None, training: bool = False) -> Tensor:
        # Every check first, agreed by the ranks of the group where it read this rank's data
        # (`rank_agreement`); then the call: the exchange, the kernel, the exchange back.
        call = self.agreement.run(self.agreement.needed(attention_mask, packed_seq_params), lambda: self._checked(
            query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params, sink, training))
        with self.dropout_rng.drawing(call.dropout_p, query.device):  # as megatron-core's attention draws it
            return self._run(call)

    def _checked(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                 attn_mask_type: Any, attention_bias: Optional[Tensor], packed_seq_params: Any,
                 sink: Optional[Tensor], training: bool) -> "_Call":
        """Everything this call is refused for, before anything of it runs."""
        self._check_call(attn_mask_type, attention_bias)
        check_qkv(query, key, value)
        check_heads(query, key, self.facts.num_heads, self.facts.kv_heads)
        check_head_dims(query, value, self.plan.head_dim, self.plan.head_dim_v)
        layout = checked_layout(self.plan, packed_seq_params, self.shared_prefix_mark)  # a shared-prefix row (B37), before its boundaries
        fmt = qkv_format(packed_seq_params, self.default_qkv_format)
        packed = self._packing(packed_seq_params, fmt)
        if packed is None:  # a dense call: sbhd (or bshd), with one batch size for q and k
            check_qkv(query, key, value, (4,), batch_dim=1 if fmt == "sbhd" else 0)
        check_packing(self.plan.packed, packed is not None, self.plan.eod_documents)
        dropout_p = self.dropout if training else 0.0  # B30
        plan = self.plan
        if plan.sink and sink is None:
            raise refuse(MISSING_SINK, CONTEXT)
        seq = 0 if packed is not None or fmt == "sbhd" else 1
        call = _Call(query, key, value, fmt, dropout_p, sink)
        if self.cp is not None:
            if packed is not None:
                raise self.cp.packed_refusal()
            self.cp.check_mask(attention_mask, query.shape[seq], key.shape[seq])
            self._check_lengths(query.shape[seq] * self.cp.ulysses.size, key.shape[seq] * self.cp.ulysses.size)
            return call
        if packed is None:
            self._check_lengths(query.shape[seq], key.shape[seq])
            if plan.mask_documents:
                return self._documents_from_mask(call, attention_mask)
            self.check_mask(attention_mask, query.shape[seq], key.shape[seq])
            return call
        if attention_mask is not None:
            raise refuse(MASK_WITH_THD, CONTEXT)
        squeeze = query.dim() == 4
        q_thd, k_thd, v_thd = (t.squeeze(1) if squeeze else t for t in (query, key, value))
        q_thd, k_thd, v_thd = thd_views(q_thd, k_thd, v_thd, self.storage)  # as the self-test feeds them
        if layout is not None:
            check_tokens(q_thd, k_thd, v_thd, layout)
        return self._checked_packed(_Call(q_thd, k_thd, v_thd, fmt, dropout_p, sink, squeeze=squeeze, layout=layout),
                                    packed)

    def _run(self, call: "_Call") -> Tensor:
        plan = self.plan
        query, key, value, fmt, sink = call.query, call.key, call.value, call.fmt, call.sink
        if call.packed is not None:
            out_thd = self._packed(call)
            if call.rows is not None:  # the documents of a dense call: Megatron's own layout again
                out = out_thd.flatten(1).unflatten(0, call.rows)
                return out.transpose(0, 1) if fmt == "sbhd" else out
            out = out_thd.flatten(1)  # [T, H * Dv], also for no token
            return out.unsqueeze(1) if call.squeeze else out
        if self.cp is not None:
            # Ulysses: this rank's heads of the whole sequence, in sequence order, and its slice of the sink.
            query, key, value = self.cp.scatter(query, key, value, fmt)
            sink = self.cp.sink(sink)
        hooked = plan.mask_mod is not None
        causal = plan.causal and not hooked
        window = (-1, -1) if hooked else plan.window
        q_bshd, k_bshd, v_bshd = kernel_views(query, key, value, self.storage, fmt)  # as the self-test feeds them
        if self.adapter is not None:
            out_bshd = self.adapter(q_bshd, k_bshd, v_bshd, dropout_p=call.dropout_p, causal=causal,
                                    window_size=window, sink=sink, deterministic=plan.deterministic)
        else:
            a = CallArgs(q_bshd, k_bshd, v_bshd, None, None, q_bshd.shape[1], k_bshd.shape[1], fp32_sink(sink), None,
                         None, causal, window, plan.scale, call.dropout_p, plan.deterministic)
            self.direct.check(a)
            out_bshd = empty_result(q_bshd, k_bshd, v_bshd, a.sink, False, False) if no_queries(q_bshd, False) and \
                not torch.compiler.is_compiling() else run_call(self.handle, a)
        out = out_bshd.transpose(0, 1) if fmt == "sbhd" else out_bshd  # Megatron's own layout again
        if self.cp is not None:
            out = self.cp.gather(out, fmt)
        return out.flatten(2)  # [S, B, H * Dv], also for an empty batch or sequence

    def _check_lengths(self, q_len: int, kv_len: int) -> None:
        if q_len != kv_len:
            refusal = self._alignment_refusal(f"q_len={q_len} != kv_len={kv_len}")
            if refusal is not None:
                raise refusal

    def _alignment_refusal(self, unequal: str) -> Optional[UnsupportedInputError]:
        """Why this layer cannot run unequal q and kv lengths (``unequal`` says which), or None.

        Megatron's ``causal`` is top-left, ``causal_bottom_right`` bottom-right, and megatron-core
        aligns a non-causal window bottom-right; flash kernels align bottom-right and a mask_mod
        top-left, so only the path that computes the requested alignment runs.  The same holds per
        document for packed calls whose q and kv boundaries differ."""
        found = self._alignment_rule
        return None if found is None else refuse(CALL_RULES[found[0]], CONTEXT, unequal=unequal, **dict(found[1]))

    @functools.cached_property
    def _alignment_rule(self) -> Optional[tuple[str, tuple]]:
        """``(code, values)`` of `_alignment_refusal`'s rule (plain constants, which a compiled graph can keep)."""
        if not self.plan.causal:
            if self.plan.flex and self.plan.mask_mod is None and self.plan.window != (-1, -1):
                return WINDOW_ALIGNMENT.code, (("window", tuple(self.plan.window)),)
            return None
        bottom_right = getattr(self.attn_mask_type, "name", str(self.attn_mask_type)) == "causal_bottom_right"
        if bottom_right and self.plan.flex:
            return BOTTOM_RIGHT.code, ()
        if not bottom_right and not self.plan.flex:
            return TOP_LEFT.code, ()
        return None

    def _documents_from_mask(self, call: "_Call", mask: Any) -> "_Call":
        """A dense call of a ``reset_attention_mask`` layer: the documents of Megatron's mask
        (`primus_ext.megatron.document_mask`), run as one THD sequence of ``B * S`` tokens."""
        from megatron.core.packed_seq_params import PackedSeqParams

        query, key, value, fmt = call.query, call.key, call.value, call.fmt
        rows = 1 if fmt == "sbhd" else 0
        batch, q_len, kv_len = query.shape[rows], query.shape[1 - rows], key.shape[1 - rows]
        cu = document_boundaries(mask, batch, q_len, kv_len, self.settings.reset_attention_mask_max_documents)
        # [S, B, H, D] (or [B, S, H, D]) -> [B * S, H, D]: row after row, as the boundaries count.
        q_thd, k_thd, v_thd = ((t.transpose(0, 1) if fmt == "sbhd" else t).reshape(batch * q_len, *t.shape[2:])
                               for t in (query, key, value))
        q_thd, k_thd, v_thd = thd_views(q_thd, k_thd, v_thd, self.storage)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=q_len,
                                 max_seqlen_kv=kv_len)
        return self._checked_packed(_Call(q_thd, k_thd, v_thd, fmt, call.dropout_p, call.sink, rows=(batch, q_len),
                                          causal=self.plan.causal, window=self.plan.window), params)

    def _checked_packed(self, call: "_Call", params: Any) -> "_Call":
        """A thd call with its boundaries checked (on the device: `check_packed`) before any kernel runs."""
        q_thd, k_thd = call.query, call.key
        cu_q, cu_kv = params.cu_seqlens_q, params.cu_seqlens_kv
        for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_kv", cu_kv)):
            if isinstance(cu, Tensor) and cu.device != q_thd.device:  # before any comparison of the two
                raise refuse(CU_DEVICE, CONTEXT, name=name, device=cu.device, inputs=q_thd.device)
        if self.unequal_refused and isinstance(cu_q, Tensor) and isinstance(cu_kv, Tensor):
            code, values = self._alignment_rule
            # plain constants in the refusal: a compiled graph keeps it, and raises it when the graph runs
            check_same_boundaries(cu_q, cu_kv, lambda c=code, v=values + (("unequal", _UNEQUAL_DOCUMENTS),): refuse(
                CALL_RULES[c], CONTEXT, **dict(v)), f"primus_ext: {_UNEQUAL_DOCUMENTS} ({code})")
        # Missing max_seqlen: the token count bounds it, with no host read of the boundaries.
        max_q = params.max_seqlen_q if params.max_seqlen_q is not None else q_thd.shape[0]
        max_kv = params.max_seqlen_kv if params.max_seqlen_kv is not None else k_thd.shape[0]
        checked = check_packed(q_thd, k_thd, cu_q, cu_kv, max_q, max_kv, equal_documents=self.plan.equal_documents)
        # The adapter takes the boundaries as its callers give them (its own check then knows them proven).
        return dataclasses.replace(call, packed=(cu_q, cu_kv, max_q, max_kv) if self.adapter is not None else checked)

    def _packed(self, call: "_Call") -> Tensor:
        q_thd, k_thd, v_thd = call.query, call.key, call.value
        cu_q, cu_kv, max_q, max_kv = call.packed
        plan = self.plan
        if call.layout is not None:  # a shared-prefix row: the packed call merged with its cross call (B37)
            if self.adapter is not None:
                return shared_prefix_attention(self.adapter, q_thd, k_thd, v_thd, call.layout, sink=call.sink,
                                               deterministic=plan.deterministic)
            a = CallArgs(q_thd, k_thd, v_thd, cu_q, cu_kv, max_q, max_kv, fp32_sink(call.sink), None, None, plan.causal,
                         plan.window, plan.scale, 0.0, plan.deterministic, True)
            return run_shared_prefix(self.direct, self.handle, a, call.layout)
        hooked = plan.mask_mod is not None
        causal = call.causal if call.causal is not None else plan.causal and not hooked
        window = call.window if call.window is not None else ((-1, -1) if hooked else plan.window)
        if self.adapter is not None:
            return self.adapter.varlen(q_thd, k_thd, v_thd, cu_q, cu_kv, max_q, max_kv, dropout_p=call.dropout_p,
                                       causal=causal, window_size=window, deterministic=plan.deterministic,
                                       sink=call.sink)
        a = CallArgs(q_thd, k_thd, v_thd, cu_q, cu_kv, max_q, max_kv, fp32_sink(call.sink), None, None, causal, window,
                     plan.scale, call.dropout_p, plan.deterministic)
        self.direct.check(a)
        if no_queries(q_thd, True) and not torch.compiler.is_compiling():
            return empty_result(q_thd, k_thd, v_thd, a.sink, True, False)
        return run_call(self.handle, a)


@dataclasses.dataclass(frozen=True)
class _Call:
    """A checked call of one layer: its tensors as the kernel takes them, and what it runs with."""

    query: Tensor
    key: Tensor
    value: Tensor
    fmt: str
    dropout_p: float
    sink: Optional[Tensor]
    packed: Optional[tuple] = None  # (cu_q, cu_kv, max_q, max_kv) of a thd call
    squeeze: bool = False  # a thd call given as [T, 1, H, D]
    rows: Optional[Tuple[int, int]] = None  # (B, S) of a dense call run as its mask's documents
    causal: Optional[bool] = None  # the documents' own flags (None: the plan's)
    window: Optional[Tuple[int, int]] = None
    layout: Any = None  # the `SharedPrefixLayout` of a shared-prefix row


__all__ = ["TurboAttentionCore"]
