"""`TurboFlexAttention`: a drop-in for ``flash_attn_func`` that runs an `AttentionPlan`.

It has ``flash_attn_func``'s positional signature and return contract (dense bshd
``[B, S, H, D]`` in, ``[B, S, H, Dv]`` out, ``(out, lse)`` with ``return_lse``), so it
can replace ``self.attn`` without touching ``forward()``; keyword-only
``cu_seqlens_*`` / ``max_seqlen_*`` switch to packed thd ``[T, H, D]`` inputs.

Everything that depends only on the plan was decided at build time; per call it
checks only what the caller passes, never reads tensor data to the host, and copies
nothing the layout does not need.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch
from torch import Tensor

from ..backends import AttentionBackend, make_backend
from ..backends.base import KernelCall, Output, fp32_sink
from .agreement import CallAgreement, eager_flash_pattern, flash_args, flash_pattern
from .checks import (check_alibi, check_bias, check_dropout, check_heads, check_kernel_alibi, check_packed,
                          check_packing, check_qkv, check_sink)
from .memo import MISS, CallMemo, scalars_key
from ..backends.call_route import CallRoutes
from .ops import CallArgs, KernelPair, register_target, run_dense, run_packed
from ..errors import Reason, UnsupportedInputError
from ..attention.library import library_pattern
from ..attention.pattern import Pattern

MASK_KEY = "turbo_flex_attention_mask_mod"


def _refuse(settings: Tuple[str, ...], reason: str, alternative: str = "") -> UnsupportedInputError:
    return UnsupportedInputError(Reason(settings, reason, alternative))


class TurboFlexAttention:
    """Runs one layer's approved plan on its backend, call by call.

    A call's ``causal`` / ``window_size`` default to the plan's; other values are refused unless
    ``drop_in`` (None: the plan's ``turbo_flex_attention_call_flags``) is on (`call_agreement`).
    """

    def __init__(self, plan: Any, backend: Optional[AttentionBackend] = None, *,
                 drop_in: Optional[bool] = None) -> None:
        self.plan = plan
        self._agreement = CallAgreement(plan, drop_in, owner=self)
        self.backend = backend if backend is not None else make_backend(plan.backend)
        self._alibi: dict[torch.device, Tensor] = {}
        self._target = PlanTarget(plan, self.backend)
        self.handle = register_target(self._target, owner=self)
        # On a known arch, a call the plan did not assume is routed too (B33 per call).
        self._routes = self._target.routes
        # A proof that used a module global or a captured tensor holds while they are
        # unchanged; the reference evaluates the hooks themselves and needs no check.
        self._assumptions = () if self.backend.name == "reference" else tuple(plan.hook_assumptions)
        self._fast: Optional[CallMemo] = None  # the last validated call (`call_memo`)
        self._symmetric_alibi = plan.score_recognised == "alibi-symmetric"  # runs on every mask (B35)

    @property
    def drop_in(self) -> bool:
        """Whether calls run their own causal / window_size (checked by the layer's rules)."""
        return self._agreement.drop_in

    # -- per-call checks -----------------------------------------------------
    def _dense_pattern(self, flash: Tuple[bool, Tuple[int, int]]) -> Optional[Pattern]:
        """The call's pattern; ``flash`` is its ``(causal, window)`` as `CallAgreement.resolve` gave it."""
        plan = self.plan
        if plan.mask_mod is None:
            return flash_pattern(*flash)
        if self._target.hook_runs_itself:
            return None  # evaluated at every call by the backend: exact at every shape
        return plan.pattern

    def _check_assumptions(self) -> None:
        for assumption in self._assumptions:
            if not assumption.holds():
                hooks = " / ".join(h for h in (self.plan.mask_hook, self.plan.score_hook) if h)
                raise _refuse((MASK_KEY, "turbo_flex_attention_score_mod"),
                              f"the hook {hooks} was proven equal to a fixed kernel's attention while "
                              f"{assumption.what}; that no longer holds, so the proof does not either (B31).",
                              "keep the values a hook reads constant, or set turbo_flex_attention_backend: "
                              "reference, which evaluates the hook at every call.")

    def _check_dense_shape(self, pattern: Optional[Pattern], q_len: int, kv_len: int) -> None:
        if pattern is None or q_len == kv_len or pattern.kind == "full":
            if pattern is None or pattern.boundaries is None or pattern.boundaries[-1] == q_len:
                return
            raise _refuse((MASK_KEY,), f"the document mask covers {pattern.boundaries[-1]} tokens but the "
                          f"sequence has {q_len}.", "build the mask for the training sequence length.")
        if self.backend.name != "reference":
            raise _refuse(("causal", "window_size"), f"a {pattern.describe()} mask with q_len={q_len} != "
                          f"kv_len={kv_len} is ambiguous on Turbo's fixed kernels (flash aligns it "
                          "bottom-right, a mask_mod top-left).",
                          "use equal lengths, or turbo_flex_attention_backend: reference.")

    def _sink(self, sink: Optional[Tensor], q: Tensor) -> Optional[Tensor]:
        if sink is None:
            return None
        if not self.plan.sink:
            raise _refuse(("use_sink_attention",), "a sink tensor was passed but the plan has no sink; it "
                          "would change the softmax the config asked for.", "set use_sink_attention: true.")
        check_sink(sink, q)
        return fp32_sink(sink)

    def _alibi_slopes(self, alibi_slopes: Optional[Tensor], q: Tensor) -> Optional[Tensor]:
        planned, device = self.plan.alibi_slopes, q.device
        if alibi_slopes is not None:
            check_alibi(alibi_slopes, q, kernel_dtype=self.backend.name == "turbo")
        if (alibi_slopes is not None and self.backend.name == "turbo" and alibi_slopes.requires_grad
                and torch.is_grad_enabled()):
            raise _refuse(("alibi_slopes",), "the alibi_slopes require a gradient, and Primus-Turbo's backward "
                          "computes none for them: they would silently not train (B34).",
                          "pass constant slopes (detach them), or set turbo_flex_attention_backend: reference, "
                          "which differentiates them.")
        if alibi_slopes is not None and planned is not None:
            raise _refuse(("turbo_flex_attention_score_mod",), "alibi_slopes were passed and the score hook "
                          "is ALiBi too; adding both would double the bias.", "pass only one of them.")
        if alibi_slopes is not None or planned is None or self._target.score_mod is not None:
            return alibi_slopes
        slopes = self._alibi.get(device)
        if slopes is None:
            slopes = self._alibi[device] = torch.tensor(planned, dtype=torch.float32, device=device)
        return slopes

    # -- the call ------------------------------------------------------------
    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        dropout_p: float = 0.0,
        softmax_scale: Optional[float] = None,
        causal: Optional[bool] = None,
        window_size: Optional[Tuple[int, int]] = None,
        bias: Optional[Tensor] = None,
        alibi_slopes: Optional[Tensor] = None,
        deterministic: bool = False,
        return_lse: bool = False,
        return_attn_probs: bool = False,
        sink: Optional[Tensor] = None,
        *,
        cu_seqlens_q: Optional[Tensor] = None,
        cu_seqlens_kv: Optional[Tensor] = None,
        max_seqlen_q: Optional[int] = None,
        max_seqlen_kv: Optional[int] = None,
    ) -> Output:
        fast = self._fast
        if (fast is not None and bias is None and alibi_slopes is None and not return_attn_probs
                and not torch.compiler.is_compiling()):
            if cu_seqlens_q is None and cu_seqlens_kv is None:
                out = fast.dense(q, k, v, sink, dropout_p, softmax_scale, causal, window_size, deterministic,
                                 return_lse)
            else:
                out = fast.packed(q, k, v, sink, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                                  dropout_p, softmax_scale, causal, window_size, deterministic, return_lse)
            if out is not MISS:
                return out
        if return_attn_probs:
            raise _refuse(("return_attn_probs",), "attention probabilities are never materialised (B26).",
                          "call with return_attn_probs=False.")
        plan = self.plan
        key = scalars_key(dropout_p, softmax_scale, causal, window_size, deterministic, return_lse)
        sink_arg, alibi_arg = sink, alibi_slopes
        check_qkv(q, k, v)
        check_heads(q, k, plan.num_heads, plan.num_kv_heads)
        if self._assumptions:
            self._check_assumptions()
        scale = softmax_scale if softmax_scale is not None else plan.scale
        dropout = check_dropout(dropout_p)
        if sink is not None:
            sink = self._sink(sink, q)
        elif plan.sink:
            raise _refuse(("use_sink_attention", "sink"), "the layer was planned with a learned sink but the call "
                          "passes none; it would run without one (B34).", "pass the layer's sink tensor.")
        deterministic = bool(deterministic or plan.deterministic)
        packed_call = cu_seqlens_q is not None or cu_seqlens_kv is not None
        check_packing(plan.packed, packed_call, plan.eod_documents)
        if packed_call:
            out, flag, window, alibi_slopes = self._packed(
                q, k, v, causal, window_size, bias, alibi_slopes, scale, dropout, sink, deterministic, return_lse,
                cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv)
            self._remember(key, q, k, v, sink_arg, alibi_arg, bias, sink, alibi_slopes, flag, window, scale, dropout,
                           deterministic, return_lse, (cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv))
            return out
        if q.dim() != 4:
            raise _refuse(("qkv_format",), f"dense inputs are bshd [B, S, H, D]; got a {q.dim()}-D query.",
                          "pass cu_seqlens_q/cu_seqlens_kv for packed thd inputs.")
        q_len, kv_len = q.shape[1], k.shape[1]
        check_bias(bias, q, k, kernel_shape=self.backend.name == "turbo")
        flag, window = self._agreement.resolve(causal, window_size)  # the plan's, or refused (B11, B34)
        pattern = self._dense_pattern((flag, window))
        self._check_dense_shape(pattern, q_len, kv_len)
        if alibi_slopes is not None or plan.alibi_slopes is not None:
            alibi_slopes = self._alibi_slopes(alibi_slopes, q)
            if alibi_slopes is not None and self._routes is not None and pattern is not None:
                check_kernel_alibi(pattern, return_lse, symmetric=self._symmetric_alibi and alibi_arg is None,
                                   lengths=(q_len, kv_len))
        if self._routes is not None and pattern is not None:
            self._routes.check("varlen" if pattern.documents else "dense", q, k, v, pattern.right == 0,
                               pattern.window, sink, dropout, deterministic, alibi_slopes, bias, scale)
        out = run_dense(self.handle, q, k, v, sink, alibi_slopes, bias, flag, window, scale, dropout,
                        deterministic, return_lse)
        self._remember(key, q, k, v, sink_arg, alibi_arg, bias, sink, alibi_slopes, flag, window, scale, dropout,
                       deterministic, return_lse)
        return out

    def _remember(self, key: Optional[tuple], q: Tensor, k: Tensor, v: Tensor, sink_arg: Any, alibi_arg: Any,
                  bias: Any, sink: Optional[Tensor], alibi: Optional[Tensor], flag: bool, window: Tuple[int, int],
                  scale: Optional[float], dropout: float, deterministic: bool, return_lse: bool,
                  packed: Optional[tuple] = None) -> None:
        """Keep this validated call for the fast path (`call_memo`), where an equal call may skip
        the checks: plain scalar arguments, no bias, no explicit slopes, no hook assumptions,
        int32 boundaries, eager.  ``packed`` is ``(cu_q, cu_kv, max_q, max_kv)`` as passed."""
        boundaries = packed[:2] if packed is not None else ()
        if (key is None or bias is not None or alibi_arg is not None or self._assumptions
                or torch.compiler.is_compiling()
                or not all(type(cu) is Tensor and cu.dtype is torch.int32 for cu in boundaries)):
            return
        run = self._target.runner(packed is None, q, sink, alibi, flag, window, scale, dropout, deterministic,
                                  return_lse)
        if packed is None:
            self._fast = CallMemo(q, k, v, key, sink_arg, run)
            return
        cu_q, cu_kv, max_q, max_kv = packed
        self._fast = CallMemo(q, k, v, key, sink_arg, run, packed=True, same_cu=cu_q is cu_kv,
                              max_given=(max_q is not None, max_kv is not None),
                              equal_documents=self.plan.equal_documents)

    def _packed(self, q: Tensor, k: Tensor, v: Tensor, causal: Any, window_size: Any,
                bias: Optional[Tensor], alibi_slopes: Optional[Tensor], scale: Optional[float], dropout: float,
                sink: Optional[Tensor], deterministic: bool, return_lse: bool,
                cu_seqlens_q: Optional[Tensor], cu_seqlens_kv: Optional[Tensor],
                max_seqlen_q: Optional[int], max_seqlen_kv: Optional[int]
                ) -> Tuple[Output, bool, Tuple[int, int], Optional[Tensor]]:
        """The packed call's output, with the normalised ``(causal, window)`` and slopes it ran with."""
        plan = self.plan
        if plan.mask_mod is not None or plan.score_mod is not None or bias is not None:
            dropped = [name for name, value in (("turbo_flex_attention_mask_mod", plan.mask_mod),
                                                ("turbo_flex_attention_score_mod", plan.score_mod),
                                                ("bias", bias)) if value is not None]
            raise _refuse(tuple(dropped), "packed (thd) attention runs the document kernel, which takes no "
                          "mask_mod, score_mod or bias; they would be dropped (B17).",
                          "remove them for packed batches, or pass dense bshd inputs.")
        if q.dim() != 3:
            raise _refuse(("qkv_format",), f"packed inputs are thd [T, H, D]; got a {q.dim()}-D query.")
        # A missing max_seqlen is bounded by the token count: valid for the kernels and,
        # unlike reading the boundaries, free of a host sync.
        cu_seqlens_q, cu_seqlens_kv, max_q, max_kv = check_packed(q, k, cu_seqlens_q, cu_seqlens_kv,
                                                                  max_seqlen_q, max_seqlen_kv,
                                                                  equal_documents=plan.equal_documents)
        if alibi_slopes is not None or plan.alibi_slopes is not None:
            alibi_slopes = self._alibi_slopes(alibi_slopes, q)
        flag, window = self._agreement.resolve(causal, window_size)
        if self._routes is not None:
            call = flash_pattern(flag, window)
            if alibi_slopes is not None:
                check_kernel_alibi(call, return_lse)  # a packed call takes no hook: explicit slopes only
            self._routes.check("varlen", q, k, v, call.right == 0, call.window, sink, dropout, deterministic,
                               alibi_slopes, None, scale)
        out = run_packed(self.handle, q, k, v, cu_seqlens_q, cu_seqlens_kv, max_q, max_kv, sink, alibi_slopes, flag,
                         window, scale, dropout, deterministic, return_lse)
        return out, flag, window, alibi_slopes


_CALLS_MAX = 64


class PlanTarget:
    """What a flex adapter's op handle runs: its plan on its backend, eagerly.

    Calls are normalised by the adapter (or by the op's schema) before they get here:
    ``causal`` a bool, ``window`` a tuple of two ints.
    """

    def __init__(self, plan: Any, backend: AttentionBackend) -> None:
        self.plan = plan
        self.backend = backend
        # A hook plan takes no packed calls (B17), so its varlen calls are its own documents, not declared ones.
        self.routes = CallRoutes(plan.arch, plan.selection, plan.equal_documents and plan.mask_mod is None
                                 ) if backend.name == "turbo" else None
        # The turbo kernels take ALiBi as slopes; the reference runs the score_mod itself.
        self.score_mod = plan.score_mod if backend.name == "reference" else None
        # The reference evaluates every user hook itself at every call, proven or not, so
        # it stays exact whatever a proof assumed; only library masks run as their pattern.
        self.hook_runs_itself = (backend.name == "reference" and plan.mask_mod is not None
                                 and library_pattern(plan.mask_mod) is None)
        # Chunks and constant document cuts hold at every length; a call gets its boundaries.
        self.per_length = plan.pattern is not None and (plan.pattern.chunk is not None
                                                        or plan.pattern.cuts is not None)
        # Building a frozen KernelCall costs ~1.2 us, a third of the adapter's Python per
        # call, and a layer makes the same call step after step.  Calls without tensor
        # extras are kept per scalar value; the latest call with a sink or ALiBi slopes
        # (never a bias) is kept and reused while the same tensor objects come back.
        self._calls: dict[tuple, KernelCall] = {}
        self._last: Optional[Tuple[tuple, KernelCall]] = None

    def dense(self, q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor], alibi: Optional[Tensor],
              bias: Optional[Tensor], causal: bool, window: Tuple[int, int], scale: Optional[float],
              dropout_p: float, deterministic: bool, return_lse: bool) -> Output:
        call = self.kernel_call(True, q, sink, alibi, bias, causal, window, scale, dropout_p, deterministic,
                                return_lse)
        return self.backend.dense(q, k, v, call)

    def packed(self, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_kv: Tensor, max_q: int, max_kv: int,
               sink: Optional[Tensor], alibi: Optional[Tensor], causal: bool, window: Tuple[int, int],
               scale: Optional[float], dropout_p: float, deterministic: bool, return_lse: bool) -> Output:
        call = self.kernel_call(False, q, sink, alibi, None, causal, window, scale, dropout_p, deterministic,
                                return_lse)
        return self.backend.packed(q, k, v, cu_q, cu_kv, max_q, max_kv, call)

    def check(self, a: CallArgs) -> None:
        """The call's kernel route and storage layout, as the adapter checks an eager call (the
        forward op runs this inside a compiled graph)."""
        if self.routes is None:
            return
        pattern = self.kernel_call(a.cu_q is None, a.q, a.sink, a.alibi, a.bias, a.causal, a.window, a.scale,
                                   a.dropout_p, a.deterministic, a.return_lse).pattern
        if pattern is None:
            return
        entry = "varlen" if a.cu_q is not None or pattern.documents else "dense"
        self.routes.check(entry, a.q, a.k, a.v, pattern.right == 0, pattern.window, a.sink, a.dropout_p,
                          a.deterministic, a.alibi, a.bias, a.scale)

    def pair(self, a: CallArgs) -> Optional[KernelPair]:
        """The backend's kernel-level pair for this call, if it has one (compiled steps)."""
        find = getattr(self.backend, "kernel_pair", None)
        if find is None:
            return None
        call = self.kernel_call(a.cu_q is None, a.q, a.sink, a.alibi, a.bias, a.causal, a.window, a.scale,
                                a.dropout_p, a.deterministic, a.return_lse)
        return find(a, call, self.routes)

    def runner(self, dense: bool, q: Tensor, sink: Optional[Tensor], alibi: Optional[Tensor], causal: bool,
               window: Tuple[int, int], scale: Optional[float], dropout_p: float, deterministic: bool,
               return_lse: bool) -> Callable[..., Output]:
        """This call again with only its tensors to give (the adapter's fast path): the backend's
        bound kernel entry (``run(q, k, v, sink)``, packed ``run(q, k, v, cu_q, cu_kv, max_q, max_kv,
        sink)``), or this target's own call with the other arguments fixed."""
        call = self.kernel_call(dense, q, sink, alibi, None, causal, window, scale, dropout_p, deterministic,
                                return_lse)
        bind = getattr(self.backend, "bind_dense" if dense else "bind_packed", None)
        if bind is not None:
            return bind(call)
        fixed = (causal, window, scale, dropout_p, deterministic, return_lse)
        if dense:
            return lambda q, k, v, s: self.dense(q, k, v, s, call.alibi_slopes, None, *fixed)
        return lambda q, k, v, cu_q, cu_kv, mq, mk, s: self.packed(q, k, v, cu_q, cu_kv, mq, mk, s,
                                                                   call.alibi_slopes, *fixed)

    def kernel_call(self, dense: bool, q: Tensor, sink: Optional[Tensor], alibi: Optional[Tensor],
                    bias: Optional[Tensor], causal: bool, window: Tuple[int, int], scale: Optional[float],
                    dropout_p: float, deterministic: bool, return_lse: bool) -> KernelCall:
        """The `KernelCall` of a dense or packed call with these arguments (memoised, see `_call`)."""
        flash: Any = (causal, tuple(window))
        length = None
        if dense and self.plan.mask_mod is not None:  # the layer's hook is the mask, not the flags
            flash = None
            length = q.shape[1] if self.per_length else None
        return self._call(dense, flash, sink, alibi, bias, scale, dropout_p, deterministic, return_lse, length)

    def _call(self, dense: bool, flash: Any, sink: Optional[Tensor], alibi: Optional[Tensor],
              bias: Optional[Tensor], scale: Optional[float], dropout_p: float, deterministic: bool,
              return_lse: bool, length: Optional[int] = None) -> KernelCall:
        """The `KernelCall` of these arguments, reused when an equal one was built before."""
        key = (dense, flash, scale, dropout_p, deterministic, return_lse, length)
        if bias is None:
            if sink is None and alibi is None:
                call = self._calls.get(key)
                if call is None:
                    if len(self._calls) >= _CALLS_MAX:
                        self._calls.clear()
                    call = self._calls[key] = self._build(dense, flash, None, None, None, scale, dropout_p,
                                                          deterministic, return_lse, length)
                return call
            last = self._last
            if last is not None and last[1].sink is sink and last[1].alibi_slopes is alibi and last[0] == key:
                return last[1]
        call = self._build(dense, flash, sink, alibi, bias, scale, dropout_p, deterministic, return_lse, length)
        if bias is None:
            self._last = (key, call)
        return call

    def _build(self, dense: bool, flash: Any, sink: Optional[Tensor], alibi: Optional[Tensor],
               bias: Optional[Tensor], scale: Optional[float], dropout_p: float, deterministic: bool,
               return_lse: bool, length: Optional[int] = None) -> KernelCall:
        if not dense:
            return KernelCall(pattern=eager_flash_pattern(*flash_args(*flash)), scale=scale, dropout_p=dropout_p,
                              sink=sink, alibi_slopes=alibi, deterministic=deterministic, return_lse=return_lse)
        plan = self.plan
        if flash is not None:
            pattern = eager_flash_pattern(*flash_args(*flash))
        else:
            pattern = None if self.hook_runs_itself else plan.pattern
            if pattern is not None and length is not None:
                pattern = pattern.at_length(length)
        return KernelCall(pattern=pattern, mask_mod=plan.mask_mod, score_mod=self.score_mod, scale=scale,
                          dropout_p=dropout_p, sink=sink, alibi_slopes=alibi, bias=bias,
                          deterministic=deterministic, return_lse=return_lse, flash_args=flash)


__all__ = ["PlanTarget", "TurboFlexAttention"]
