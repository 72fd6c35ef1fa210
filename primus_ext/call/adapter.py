"""`TurboFlexAttention`: drop-ins for ``flash_attn_func`` / ``flash_attn_varlen_func`` that run an `AttentionPlan`.

Calling the adapter takes exactly ``flash_attn_func``'s parameters (dense bshd
``[B, S, H, D]`` in, ``[B, S, H, Dv]`` out, ``(out, lse)`` with ``return_lse``) and its
`varlen` method exactly ``flash_attn_varlen_func``'s (packed thd ``[T, H, D]``), names and
order as in Primus-Turbo, so either replaces its call without touching ``forward()``.
``causal`` / ``window_size`` default to None, the plan's (`primus_ext.call.agreement`).

A call is one value from here on: its scalars and tensor metadata a `CallSpec`
(`primus_ext.call.spec`), looked up in the call site's prepared-call cache
(`primus_ext.call.prepared`); on a miss the arguments become a `CallArgs`, checked and
normalised once (`_checked`), routed, run through the op handle, and the runner kept under
the spec, which serves every equal call after it.  Nothing here reads tensor data to the host or copies what the layout does not need.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from ..backends import AttentionBackend, make_backend
from ..backends.base import CallArgs, Output, fp32_sink
from ..plan.plan import AttentionPlan
from .. import refusals as R
from ..refusals import (ALIBI_GRAD, ALIBI_TWICE, ATTN_PROBS, MASK_LENGTH, MISSING_SINK, PACKED_EXTRAS,
                        UNEQUAL_LENGTHS, UNPLANNED_SINK, refuse, refuse_naming)
from ..attention.pattern import Pattern, pattern_from_flash_args
from .agreement import CallAgreement
from .checks import (check_alibi, check_bias, check_dropout, check_head_dims, check_heads, check_kernel_alibi,
                     check_packed, check_packing, check_qkv, check_scale, check_sink, empty_result, no_queries)
from .ops import register_target, run_call
from .prepared import MISS, Prepared, PreparedCalls
from .spec import CallSpec, call_spec
from .target import PlanTarget


class TurboFlexAttention:
    """Runs one layer's approved plan on its backend, call by call.

    A call's ``causal`` / ``window_size`` default to the plan's; other values are refused unless
    ``drop_in`` (None: the plan's ``turbo_flex_attention_call_flags``) is on (`primus_ext.call.agreement`).
    ``calls`` is this call site's prepared-call cache; its ``hits`` / ``misses`` count the calls.
    """

    def __init__(self, plan: AttentionPlan, backend: Optional[AttentionBackend] = None, *,
                 drop_in: Optional[bool] = None) -> None:
        self.plan = plan
        self._agreement = CallAgreement(plan, drop_in, owner=self)
        if backend is None and plan.backend_given:  # another object of that name would not be what was planned
            raise R.refuse_build(R.BACKEND_NOT_GIVEN, backend=plan.backend)
        self.backend = backend if backend is not None else make_backend(plan.backend)
        self._target = PlanTarget(plan, self.backend)
        self.handle = register_target(self._target, owner=self)
        self.calls = PreparedCalls()
        # Fixed kernels (Turbo) bound what a call may pass; a backend that runs any mask computes it.
        self._fixed = not self.backend.capabilities().runs_any_mask
        self._slopes: dict[torch.device, Tensor] = {}  # the plan's ALiBi slopes, per device
        self._symmetric_alibi = plan.score_recognised == "alibi-symmetric"  # runs on every mask (B35)

    @property
    def drop_in(self) -> bool:
        """Whether calls run their own causal / window_size (checked by the layer's rules)."""
        return self._agreement.drop_in

    # -- the entries: Primus-Turbo's signatures ------------------------------------------------
    def __call__(self, q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                 causal: Optional[bool] = None, window_size: Optional[tuple[int, int]] = None,
                 bias: Optional[Tensor] = None, alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                 return_lse: bool = False, return_attn_probs: bool = False, sink: Optional[Tensor] = None) -> Output:
        """``flash_attn_func(q, k, v, ...)`` on the plan: dense bshd inputs."""
        spec = None
        if not torch.compiler.is_compiling():  # a traced cache (or counter) would be guarded constants
            calls = self.calls
            if bias is None and alibi_slopes is None and return_attn_probs is False:
                spec = call_spec(False, dropout_p, softmax_scale, causal, window_size, deterministic, return_lse,
                                 q, k, v, sink)
                prepared = calls.find(spec) if spec is not None else None
                if prepared is not None:
                    out = prepared.dense(q, k, v, sink)
                    if out is not MISS:
                        calls.hits += 1
                        return out
            calls.misses += 1
        a = CallArgs(q, k, v, None, None, None, None, sink, alibi_slopes, bias, causal, window_size, softmax_scale,
                     dropout_p, deterministic, return_lse)
        return self._run(a, return_attn_probs, spec)

    def varlen(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
               max_seqlen_q: Optional[int], max_seqlen_k: Optional[int], dropout_p: float = 0.0,
               softmax_scale: Optional[float] = None, causal: Optional[bool] = None,
               window_size: Optional[tuple[int, int]] = None, bias: Optional[Tensor] = None,
               alibi_slopes: Optional[Tensor] = None, deterministic: bool = False, return_lse: bool = False,
               return_attn_probs: bool = False, sink: Optional[Tensor] = None) -> Output:
        """``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)`` on
        the plan: packed thd inputs.  A ``max_seqlen`` of None is bounded by the token count (no host read)."""
        spec = None
        if not torch.compiler.is_compiling():  # a traced cache (or counter) would be guarded constants
            calls = self.calls
            if bias is None and alibi_slopes is None and return_attn_probs is False:
                spec = call_spec(True, dropout_p, softmax_scale, causal, window_size, deterministic, return_lse,
                                 q, k, v, sink)
                prepared = calls.find(spec) if spec is not None else None
                if prepared is not None:
                    out = prepared.packed(q, k, v, sink, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
                    if out is not MISS:
                        calls.hits += 1
                        return out
            calls.misses += 1
        a = CallArgs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sink, alibi_slopes, bias,
                     causal, window_size, softmax_scale, dropout_p, deterministic, return_lse)
        return self._run(a, return_attn_probs, spec, packed=True)

    # -- the full path -------------------------------------------------------------------------
    def _run(self, raw: CallArgs, return_attn_probs: Any, spec: Optional[CallSpec], packed: bool = False) -> Output:
        """Check ``raw`` (the arguments as passed), run it, and prepare it for calls of its ``spec``."""
        a, flash = self._checked(raw, return_attn_probs, packed)
        if no_queries(a.q, packed) and not torch.compiler.is_compiling():  # nothing to compute: the reference's
            # result on every backend (a compiled call's op returns it, after checking the proof's assumptions)
            return empty_result(a.q, a.k, a.v, a.sink, packed, a.return_lse)
        target = self._target
        call = target.kernel_call(a, flash)
        target.check(a, call)  # its kernel route on the plan's arch (B33, B34)
        if torch.compiler.is_compiling():
            return run_call(self.handle, a)
        run = target.runner(call, dense=not packed)  # what the op's eager side runs too (`PlanTarget.run`)
        out = run(a.q, a.k, a.v, a.sink) if not packed else run(a.q, a.k, a.v, a.cu_q, a.cu_kv, a.max_q, a.max_kv,
                                                                 a.sink)
        if spec is not None:
            self.calls.put(spec, Prepared(
                run, raw.sink, self._target.assumptions, same_cu=raw.cu_q is raw.cu_kv,
                max_given=(raw.max_q is not None, raw.max_kv is not None) if packed else (),
                equal_documents=self.plan.equal_documents))
        return out

    def _checked(self, raw: CallArgs, return_attn_probs: Any, packed: bool) -> tuple[CallArgs, Optional[Pattern]]:
        """``raw`` honoured or refused: the `CallArgs` the kernels get, normalised (B34), and the
        pattern of its flags where one was built."""
        if return_attn_probs:
            raise refuse(ATTN_PROBS)
        plan, q, k = self.plan, raw.q, raw.k
        check_qkv(q, k, raw.v, (3,) if packed else (4,), packed, batch_dim=None if packed else 0)
        check_heads(q, k, plan.num_heads, plan.num_kv_heads)
        check_head_dims(q, raw.v, plan.head_dim, plan.head_dim_v)
        if not torch.compiler.is_compiling():  # a compiled call's op checks them when the graph runs
            self._target.check_assumptions()
        scale = check_scale(raw.scale)
        scale = scale if scale is not None else plan.scale
        dropout = check_dropout(raw.dropout_p)
        sink = self._sink(raw.sink, q)
        deterministic = bool(raw.deterministic or plan.deterministic)
        check_packing(plan.packed, packed, plan.eod_documents, plan.mask_documents)
        common = (sink, scale, dropout, deterministic)
        return self._packed(raw, common) if packed else self._dense(raw, common)

    def _dense(self, a: CallArgs, common: tuple) -> tuple[CallArgs, Optional[Pattern]]:
        """``common``: the call's checked ``(sink, scale, dropout_p, deterministic)``."""
        q, k = a.q, a.k
        q_len, kv_len = q.shape[1], k.shape[1]
        check_bias(a.bias, q, k, kernel_shape=self._fixed)
        flag, window = self._agreement.resolve(a.causal, a.window)  # the plan's, or refused (B11, B34)
        plan = self.plan
        if plan.mask_mod is None:
            pattern = pattern_from_flash_args(flag, window)
        else:  # the hook is the mask; a backend evaluating it is exact at every shape
            pattern = None if self._target.hook_runs_itself else plan.pattern
        self._check_dense_shape(pattern, q_len, kv_len)
        alibi = a.alibi
        if alibi is not None or plan.alibi_slopes is not None:
            alibi = self._alibi_slopes(alibi, q)
            if alibi is not None and self._fixed and pattern is not None:
                check_kernel_alibi(pattern, a.return_lse, symmetric=self._symmetric_alibi and a.alibi is None,
                                   lengths=(q_len, kv_len))
        sink, scale, dropout, deterministic = common
        return CallArgs(q, k, a.v, None, None, q_len, kv_len, sink, alibi, a.bias, flag, window, scale, dropout,
                        deterministic, a.return_lse), pattern if plan.mask_mod is None else None

    def _packed(self, a: CallArgs, common: tuple) -> tuple[CallArgs, Optional[Pattern]]:
        """Like `_dense`, for a thd call."""
        plan, q, k = self.plan, a.q, a.k
        if plan.mask_mod is not None or plan.score_mod is not None or a.bias is not None:
            dropped = [name for name, value in (("turbo_flex_attention_mask_mod", plan.mask_mod),
                                                ("turbo_flex_attention_score_mod", plan.score_mod),
                                                ("bias", a.bias)) if value is not None]
            raise refuse_naming(PACKED_EXTRAS, tuple(dropped))
        cu_q, cu_kv, max_q, max_kv = check_packed(q, k, a.cu_q, a.cu_kv, a.max_q, a.max_kv,
                                                  equal_documents=plan.equal_documents, kv="k")
        alibi = a.alibi
        if alibi is not None or plan.alibi_slopes is not None:
            alibi = self._alibi_slopes(alibi, q)
        flag, window = self._agreement.resolve(a.causal, a.window)
        pattern = pattern_from_flash_args(flag, window)
        if alibi is not None and self._fixed:
            check_kernel_alibi(pattern, a.return_lse)  # a packed call takes no hook
        sink, scale, dropout, deterministic = common
        return CallArgs(q, k, a.v, cu_q, cu_kv, max_q, max_kv, sink, alibi, None, flag, window, scale, dropout,
                        deterministic, a.return_lse), pattern

    def _check_dense_shape(self, pattern: Any, q_len: int, kv_len: int) -> None:
        if pattern is None or q_len == kv_len or pattern.kind == "full":
            if pattern is None or pattern.boundaries is None or pattern.boundaries[-1] == q_len:
                return
            raise refuse(MASK_LENGTH, covered=pattern.boundaries[-1], length=q_len)
        if self._fixed:  # names the hook where the mask is the hook's, else the call's flags
            named = ("turbo_flex_attention_mask_mod",) if self.plan.mask_mod is not None else ("causal", "window_size")
            raise refuse_naming(UNEQUAL_LENGTHS, named, mask=pattern.describe(), q_len=q_len, kv_len=kv_len)

    def _sink(self, sink: Optional[Tensor], q: Tensor) -> Optional[Tensor]:
        if sink is None:
            if self.plan.sink:
                raise refuse(MISSING_SINK)
            return None
        if not self.plan.sink:
            raise refuse(UNPLANNED_SINK)
        check_sink(sink, q)
        return fp32_sink(sink)

    def _alibi_slopes(self, alibi_slopes: Optional[Tensor], q: Tensor) -> Optional[Tensor]:
        planned = self.plan.alibi_slopes
        if alibi_slopes is not None:
            check_alibi(alibi_slopes, q, kernel_dtype=self._fixed)
            if self._fixed and alibi_slopes.requires_grad and torch.is_grad_enabled():
                raise refuse(ALIBI_GRAD)
            if planned is not None:
                raise refuse(ALIBI_TWICE)
            return alibi_slopes
        if planned is None or self._target.score_mod is not None:
            return None
        slopes = self._slopes.get(q.device)
        if slopes is None:
            slopes = self._slopes[q.device] = torch.tensor(planned, dtype=torch.float32, device=q.device)
        return slopes


__all__ = ["TurboFlexAttention"]
