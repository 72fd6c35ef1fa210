"""The ``flex`` backend: torch's own FlexAttention, for hooks no fixed kernel computes.

A layer whose hooks are *admitted* (in the provable subset, not proven equal to a Turbo kernel:
prefix-LM, documents read from a captured tensor, a softcap, a dilated window) runs here on a
GPU: ``torch.nn.attention.flex_attention.flex_attention``, compiled into a fused kernel, skipping
the blocks its BlockMask marks empty.  What this backend adds around the kernel:

* the BlockMask of the call, from the plan's mask_mod (a call without a hook: its causal /
  window as mask_mods, `flex_masks`), built by ``create_block_mask`` once per key and shared by
  every layer (`flex_cache.BLOCK_MASKS`), broadcast over the batch and heads where the hook reads
  neither index (`flex_masks.reads_argument`);
* score hooks passed through, ALiBi slopes as a score_mod;
* GQA through ``enable_gqa``; indices top-left for ``q_len != kv_len`` (as the reference);
* learned sinks, exactly and differentiably: ``out * sigmoid(lse - sink)`` per head, the LSE from
  ``return_aux=AuxRequest(lse=True)``, and the returned lse ``logaddexp(lse, sink)``;
* packed (THD) calls as one sequence (B = 1) with a document mask from ``cu_seqlens`` computed
  on the device (no host read).

Refused with our error, at the call: dropout and a bias tensor (flex_attention has neither, in
this backend's contract), ``deterministic`` (no deterministic backward is shown), and a CPU call
that needs gradients (torch's flex_attention has no CPU backward).  The plan refuses the settings
that ask for these at build time (docs/refusals.md).  ``kernel`` replaces torch's function (a
stand-in with its exact call contract, for CPU tests of the glue's gradients).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Optional

import torch
import torch._dynamo  # its exception types: what flex_attention raises on a hook it cannot trace
from torch import Tensor
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from .. import refusals as R
from ..attention.pattern import Pattern
from .base import HOOKS_TRACED, AttentionBackend, BackendCapabilities, KernelCall, Output
from .flex_cache import BLOCK_MASKS, BlockMaskCache, boundary_state
from .shared_prefix import tree_mod
from .flex_masks import (captured_bytes, captured_state, document_mod, in_score_dtype, learned_in, learned_tensors,
                         pattern_mod, reads_argument, user_hook, with_alibi)

try:
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # older torch: only the deprecated return_lse
    AuxRequest = None  # type: ignore[assignment,misc]

HAS_RETURN_AUX = AuxRequest is not None and "return_aux" in inspect.signature(flex_attention).parameters
BLOCK_SIZE = 128

_COMPILED: dict[str, Callable[..., Any]] = {}


_DEVICES = ("cpu", "cuda", "xpu", "hpu")
"""Devices torch's FlexAttention runs on (its own check, which would name the hook)."""
_FUSED = ("cuda", "xpu")
"""Devices torch's flex functions are compiled for (a GPU: ROCm's is ``cuda`` too); elsewhere (the CPU, the
meta device of shape inference) they run eagerly."""


def _compiled(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile(fn)``, once per process (torch's flex functions fuse only when compiled)."""
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fn, dynamic=False)
    return _COMPILED[name]


class FlexBackend(AttentionBackend):
    """torch's ``flex_attention`` (compiled off the CPU) with shared BlockMasks."""

    name = "flex"

    def __init__(self, kernel: Optional[Callable[..., Any]] = None, block_masks: Optional[BlockMaskCache] = None,
                 block_size: int = BLOCK_SIZE) -> None:
        self.kernel = kernel
        """None: torch's flex_attention; else a function with its exact call contract."""
        self.block_masks = block_masks if block_masks is not None else BLOCK_MASKS
        self.block_size = block_size

    def capabilities(self) -> BackendCapabilities:
        return BackendCapabilities(
            name=self.name,
            hooks=HOOKS_TRACED,
            softcap=True,
            dense_entry="torch flex_attention",
            packed_entry="torch flex_attention (document mask)",
            direct_entry=None,
            deterministic_dense=False,
            deterministic_packed=False,
            dropout=False,  # torch's flex_attention has no dropout
            deterministic_backward=False,  # not shown deterministic
            learned_tables=False,  # its captured-buffer gradient is not shown here
            tree_mask=True,
            notes=("BlockMasks built once per key and shared by every layer",),
        )

    # ----------------------------------------------------------------------------- calls
    def dense(self, q: Tensor, k: Tensor, v: Tensor, call: KernelCall) -> Output:
        self._refuse_unsupported(call, q, k, v)
        batch, q_len, heads = q.shape[0], q.shape[1], q.shape[2]
        kv_len = k.shape[1]
        hook = user_hook(call.mask_mod, "mask_mod")
        if hook is not None:
            # A mask that never reads the batch (head) index is one BlockMask broadcast over it: B (H) times less
            mask_mod, shape = hook, tuple(None if not reads_argument(hook, i) else n for i, n in ((0, batch), (1, heads)))
        else:
            pattern = call.pattern if call.pattern is not None else Pattern()
            mask_mod, shape = pattern_mod(pattern.at_length(q_len)), (None, None)
        score_hook = user_hook(call.score_mod, "score_mod")
        state = captured_state(hook) if hook is not None else ()  # the BlockMask's, read once per call
        learned = learned_in(state) + learned_tensors(score_hook) if torch.is_grad_enabled() else 0
        if learned:  # a table set to train after the build (hook-learned refuses it there)
            raise R.refuse(R.FLEX_LEARNED, learned=learned)
        score_mod = with_alibi(in_score_dtype(score_hook), call.alibi_slopes)
        block_mask = None
        if mask_mod is not None and q_len and kv_len:  # no cell to mask in an empty call
            block_mask = self.block_mask(mask_mod, shape[0], shape[1], q_len, kv_len, q.device, state)
        out, lse = self._attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod, block_mask, call)
        out = out.transpose(1, 2)
        return (out, lse) if call.return_lse else out

    def packed(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_kv: Tensor,
               max_seqlen_q: Any, max_seqlen_kv: Any, call: KernelCall) -> Output:
        self._refuse_unsupported(call, q, k, v)
        pattern = call.pattern if call.pattern is not None else Pattern()
        block_mask = (self.document_block_mask(pattern, cu_seqlens_q, cu_seqlens_kv, q.shape[0], k.shape[0], q.device)
                      if q.shape[0] and k.shape[0] else None)
        score_mod = with_alibi(None, call.alibi_slopes)
        out, lse = self._attend(*(t.unsqueeze(0).transpose(1, 2) for t in (q, k, v)), score_mod, block_mask, call)
        out = out.transpose(1, 2)[0]
        return (out, lse[0]) if call.return_lse else out

    def tree(self, q: Tensor, k: Tensor, v: Tensor, layout: Any, call: KernelCall) -> Tensor:
        """A shared-prefix row (`primus_ext.backends.shared_prefix.SharedPrefixLayout`) as one call on its tree mask:
        ``[T, Hq, Dv]``; the sink, scale and GQA as any packed call of the layer."""
        self._refuse_unsupported(call, q, k, v)
        total = q.shape[0]
        key = ("shared prefix", total, q.device, self.block_size)
        block_mask = self.block_masks.get(key, boundary_state(layout.group, layout.part), lambda: (
            self._create(tree_mod(layout.group, layout.part), None, None, total, total, q.device),
            2 * total * 8)) if total else None
        out, _ = self._attend(*(t.unsqueeze(0).transpose(1, 2) for t in (q, k, v)), None, block_mask,
                              dataclasses.replace(call, return_lse=False))
        return out.transpose(1, 2)[0]

    # ----------------------------------------------------------------------------- parts
    def document_block_mask(self, pattern: Pattern, cu_seqlens_q: Tensor, cu_seqlens_kv: Tensor, total_q: int,
                            total_kv: int, device: torch.device) -> Any:
        """The shared BlockMask of packed documents (``pattern``'s window inside each), built again only when
        the boundary tensors are other objects or were changed in place."""
        key = ("packed documents", pattern.left, pattern.right, total_q, total_kv, device, self.block_size)
        shared = cu_seqlens_kv is cu_seqlens_q
        state = boundary_state(cu_seqlens_q, None if shared else cu_seqlens_kv)

        def build() -> tuple[Any, int]:
            mod, held = document_mod(pattern, cu_seqlens_q, cu_seqlens_q if shared else cu_seqlens_kv,
                                     total_q, total_kv)
            return self._create(mod, None, None, total_q, total_kv, device), held

        return self.block_masks.get(key, state, build)

    def block_mask(self, mask_mod: Callable, batch: Optional[int], heads: Optional[int], q_len: int, kv_len: int,
                   device: torch.device, state: tuple = ()) -> Any:
        """The shared BlockMask of ``mask_mod`` for one call shape (built on a miss or a changed capture)."""
        key = ("mask_mod", mask_mod, batch, heads, q_len, kv_len, device, self.block_size)
        return self.block_masks.get(key, state, lambda: (self._create(mask_mod, batch, heads, q_len, kv_len, device),
                                                         captured_bytes(state)))

    def _create(self, mask_mod: Callable, batch: Optional[int], heads: Optional[int], q_len: int, kv_len: int,
                device: torch.device) -> Any:
        build = create_block_mask
        if device.type in _FUSED and not torch.compiler.is_compiling():
            build = _compiled("create_block_mask", create_block_mask)
        try:
            return build(mask_mod, batch, heads, q_len, kv_len, device=device, BLOCK_SIZE=self.block_size)
        except R.HOOK_ERRORS as exc:  # the user's mask_mod at an index it was not written for
            raise R.refuse(R.HOOK_RAISED, kind="mask_mod", error=f"{type(exc).__name__} ({exc})",
                           top=[(batch or 1) - 1, (heads or 1) - 1, q_len - 1, kv_len - 1]) from exc

    def _kernel(self, device: torch.device) -> Callable[..., Any]:
        if self.kernel is not None:
            return self.kernel
        if device.type not in _FUSED or torch.compiler.is_compiling():
            return flex_attention
        return _compiled("flex_attention", flex_attention)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, score_mod: Optional[Callable], block_mask: Any,
                call: KernelCall) -> tuple[Tensor, Optional[Tensor]]:
        """``(out [B, Hq, Sq, Dv], lse [B, Hq, Sq] or None)`` in torch's layout, sinks applied."""
        if not q.shape[2] or not k.shape[2]:  # torch's kernel fails on an empty call: no query, or no key to see
            return self._empty(q, v, call)
        kernel = self._kernel(q.device)
        given = q.dtype
        if self.kernel is None and q.device.type == "cpu" and given in (torch.bfloat16, torch.float16):
            # torch's eager CPU flex_attention computes scores, softmax and lse in the inputs' dtype; the
            # compiled GPU kernel (and every other backend) accumulates in float32: compute in float32 here.
            q, k, v = q.float(), k.float(), v.float()
        if self.kernel is None and q.device.type == "cpu" and not torch.is_grad_enabled():
            # torch refuses CPU inputs that require grad even where no graph is recorded (no_grad; the forward
            # of a compiled graph's attention op): nothing is differentiated here, so hand it detached views
            q, k, v = q.detach(), k.detach(), v.detach()
        want_lse = call.sink is not None or call.return_lse
        common = dict(score_mod=score_mod, block_mask=block_mask, scale=call.scale, enable_gqa=q.shape[1] != k.shape[1])
        try:  # torch traces the hooks into its kernel, even eagerly: what it cannot trace is refused, ours
            if not want_lse:
                return kernel(q, k, v, **common).to(given), None
            if HAS_RETURN_AUX:
                out, aux = kernel(q, k, v, **common, return_aux=AuxRequest(lse=True))
                lse = aux.lse
            else:  # pragma: no cover - torch before return_aux
                out, lse = kernel(q, k, v, **common, return_lse=True)
        except torch._dynamo.exc.TorchDynamoException as exc:
            raise R.refuse(R.FLEX_TRACE, error=type(exc).__name__) from exc
        except R.HOOK_ERRORS as exc:  # a hook evaluated by the kernel at an index it was not written for
            raise R.refuse(R.HOOK_RAISED, kind="score_mod or mask_mod", error=f"{type(exc).__name__} ({exc})",
                           top=[q.shape[0] - 1, q.shape[1] - 1, q.shape[2] - 1, k.shape[2] - 1]) from exc
        work = torch.promote_types(q.dtype, torch.float32)
        lse = lse.to(work)
        if call.sink is not None:
            sink = call.sink.to(work).view(1, -1, 1)
            # softmax over the keys and the sink: the keys' share of the mass is sigmoid(lse - sink)
            out = out.to(work) * torch.sigmoid(lse - sink).unsqueeze(-1)
            lse = torch.logaddexp(lse, sink.expand_as(lse))
        return out.to(given), lse

    @staticmethod
    def _empty(q: Tensor, v: Tensor, call: KernelCall) -> tuple[Tensor, Optional[Tensor]]:
        """An empty call as the reference computes it: zeros, lse -inf (the sink's where there is one)."""
        b, heads, sq = q.shape[0], q.shape[1], q.shape[2]
        out = q.new_zeros(b, heads, sq, v.shape[-1])
        lse = q.new_full((b, heads, sq), float("-inf"), dtype=torch.promote_types(q.dtype, torch.float32))
        if call.sink is not None:
            lse = torch.logaddexp(lse, call.sink.to(lse.dtype).view(1, -1, 1).expand_as(lse))
        return out, lse

    def _refuse_unsupported(self, call: KernelCall, q: Tensor, k: Tensor, v: Tensor) -> None:
        if call.dropout_p > 0.0:
            raise R.refuse(R.FLEX_UNSUPPORTED, what=f"dropout_p={call.dropout_p:g}", setting="attention_dropout",
                           instead="attention_dropout: 0.0 (dropout_p=0.0)")
        if call.bias is not None:
            raise R.refuse(R.FLEX_UNSUPPORTED, what="a bias tensor", setting="bias",
                           instead="a score hook (turbo_flex_attention_score_mod) in place of the bias")
        if call.deterministic:
            raise R.refuse(R.FLEX_UNSUPPORTED, what="deterministic=True", setting="deterministic_mode",
                           instead="deterministic_mode: false")
        if self.kernel is None and q.device.type not in _DEVICES:
            raise R.refuse(R.FLEX_DEVICE, device=q.device.type, devices=", ".join(_DEVICES))
        if self.kernel is None and q.device.type == "cpu" and torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in (q, k, v, call.sink)):
            raise R.refuse(R.FLEX_CPU_GRAD)


__all__ = ["BLOCK_SIZE", "FlexBackend", "HAS_RETURN_AUX"]
