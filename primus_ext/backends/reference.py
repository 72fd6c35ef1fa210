"""The ``reference`` backend: exact attention in torch, with autograd, on any device.

This is how CPU users train and how every other path is checked.  Plain causal or
full attention without extras goes through ``scaled_dot_product_attention``.  Windows,
documents, packed batches, sinks, ALiBi and mask hooks run blockwise (`blockwise`):
memory linear in the sequence, masked tiles skipped.  A score hook, a bias or dropout
materialises the score matrix (`exact`): a score hook's gradient must reach whatever
tensors the hook captures, which only autograd through the whole hook can promise, a
bias is already a score matrix, and dropout needs one mask for forward and backward.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import blockwise, exact
from .base import HOOKS_EVALUATED, AttentionBackend, BackendCapabilities, KernelCall, Output, same_tensor
from .base import CallArgs, kernel_rng


class ReferenceBackend(AttentionBackend):
    """Runs any plan exactly; nothing is recognised, nothing is refused for speed."""

    name = "reference"

    def __init__(self) -> None:
        self.read_boundaries: Optional[bool] = None
        """Read packed boundaries on the host (per-document tiles); None: only when they are in
        host memory already (CPU), so an accelerator never syncs (`blockwise.packed_band_layout`)."""

    def capabilities(self) -> BackendCapabilities:
        return BackendCapabilities(
            name=self.name,
            hooks=HOOKS_EVALUATED,
            softcap=True,
            dense_entry="torch (exact)",
            packed_entry="torch (exact, per document)",
            direct_entry="torch (exact)",
        )

    @staticmethod
    def _sdpa_allowed(q: Tensor, k: Tensor, call: KernelCall) -> bool:
        pattern = call.pattern
        return (
            pattern is not None
            and pattern.kind in ("full", "causal")
            and (pattern.kind == "full" or q.shape[1] == k.shape[1])
            and call.score_mod is None
            and call.sink is None
            and call.alibi_slopes is None
            and call.bias is None
            and not call.return_lse
        )

    @staticmethod
    def blockwise_allowed(call: KernelCall) -> bool:
        """Whether a call runs blockwise (see the module docstring for the others)."""
        return call.score_mod is None and call.bias is None and call.dropout_p == 0.0

    def kernel_pair(self, a: CallArgs, call: KernelCall, _routes: Any = None) -> Any:
        """The forward/backward pair of a compiled step: on CPU, SDPA's own flash kernels for
        what eager sends to SDPA; else the blockwise forward and hand-written backward."""
        if a.cu_q is None and self._sdpa_allowed(a.q, a.k, call):
            return SdpaCpuPair(call) if SdpaCpuPair.takes(a, call) else None
        return BlockwisePair(call, self) if self.blockwise_allowed(call) else None

    def packed_layout(self, pattern: Any, cu_q: Tensor, cu_kv: Tensor, total_q: int, total_kv: int,
                      max_q: Any, max_kv: Any) -> blockwise.Layout:
        """Per-document regions from host boundaries, or the sync-free band (see `read_boundaries`)."""
        read = self.read_boundaries if self.read_boundaries is not None else cu_q.device.type == "cpu"
        if read:
            return blockwise.packed_layout(pattern, cu_q.tolist(), cu_kv.tolist())
        return blockwise.packed_band_layout(pattern, cu_q, cu_kv, total_q, total_kv, int(max_q), int(max_kv),
                                            same_tensor(cu_q, cu_kv))

    def dense(self, q: Tensor, k: Tensor, v: Tensor, call: KernelCall) -> Output:
        if self._sdpa_allowed(q, k, call):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                dropout_p=call.dropout_p,
                is_causal=call.pattern.kind == "causal",  # type: ignore[union-attr]
                scale=call.scale,
                enable_gqa=q.shape[2] != k.shape[2],
            )
            return out.transpose(1, 2)
        batch, q_len, heads = q.shape[0], q.shape[1], q.shape[2]
        kv_len = k.shape[1]
        if self.blockwise_allowed(call):
            layout = blockwise.dense_layout(call.pattern, call.mask_mod, q_len, kv_len)
            return _finish(blockwise.BlockwiseAttention.apply(q, k, v, call.sink, call.alibi_slopes, layout,
                                                              call.scale), call.return_lse)
        if call.pattern is not None:
            _, _, qi, ki = exact.index_grid(1, 1, q_len, kv_len, q.device)
            allowed = call.pattern.allows(qi, ki)
        elif call.mask_mod is not None:
            allowed = exact.mask_from_mask_mod(call.mask_mod, batch, heads, q_len, kv_len, q.device)
        else:
            allowed = None
        return exact.attention(
            q, k, v,
            scale=call.scale,
            allowed=allowed,
            score_mod=call.score_mod,
            alibi_slopes=call.alibi_slopes,
            bias=call.bias,
            sink=call.sink,
            dropout_p=call.dropout_p,
            return_lse=call.return_lse,
        )

    def packed(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cu_seqlens_q: Tensor,
        cu_seqlens_kv: Tensor,
        max_seqlen_q: Any,
        max_seqlen_kv: Any,
        call: KernelCall,
    ) -> Output:
        assert call.pattern is not None, "packed calls always carry a window pattern"
        if self.blockwise_allowed(call):
            layout = self.packed_layout(call.pattern, cu_seqlens_q, cu_seqlens_kv, q.shape[0], k.shape[0],
                                        max_seqlen_q, max_seqlen_kv)
            out, lse = blockwise.BlockwiseAttention.apply(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                                          call.sink, call.alibi_slopes, layout, call.scale)
            return _finish((out.squeeze(0), lse.squeeze(0)), call.return_lse)
        allowed = exact.document_mask(call.pattern, cu_seqlens_q, cu_seqlens_kv, q.shape[0], k.shape[0])
        result = exact.attention(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
            scale=call.scale,
            allowed=allowed,
            alibi_slopes=call.alibi_slopes,
            sink=call.sink,
            dropout_p=call.dropout_p,
            return_lse=call.return_lse,
        )
        if call.return_lse:
            out, lse = result
            return out.squeeze(0), lse.squeeze(0)
        return result.squeeze(0)


class SdpaCpuPair:
    """aten's CPU flash-attention forward (out, logsumexp) and its backward: the kernels
    ``scaled_dot_product_attention`` runs on CPU, split (`primus_ext.call.ops.KernelPair`)."""

    def __init__(self, call: KernelCall) -> None:
        self.causal = call.pattern is not None and call.pattern.kind == "causal"
        self.scale = call.scale

    @staticmethod
    def takes(a: CallArgs, call: KernelCall) -> bool:
        """CPU, no dropout, one head dim for q/k and v (the kernel's own limits), and no GQA: eager
        SDPA sums a group's key/value gradients in its own order, which a split cannot repeat."""
        return (a.q.device.type == "cpu" and call.dropout_p == 0.0 and a.q.shape[-1] == a.v.shape[-1]
                and a.q.shape[2] == a.k.shape[2])

    def forward(self, a: CallArgs) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = (t.transpose(1, 2) for t in (a.q, a.k, a.v))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, self.causal,
                                                                               scale=self.scale)
        return out.transpose(1, 2), lse, kernel_rng(a)

    def backward(self, a: CallArgs, grad_out: Tensor, out: Tensor, lse: Tensor, rng_state: Tensor
                 ) -> tuple[Any, ...]:
        q, k, v = (t.transpose(1, 2) for t in (a.q, a.k, a.v))
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.transpose(1, 2), q, k, v, out.transpose(1, 2), lse, 0.0, self.causal, scale=self.scale)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None, None, None


class BlockwisePair:
    """`blockwise.forward` / `blockwise.backward` for one call (`primus_ext.call.ops.KernelPair`)."""

    def __init__(self, call: KernelCall, backend: ReferenceBackend) -> None:
        self.call, self.backend = call, backend

    def _layout(self, a: CallArgs) -> blockwise.Layout:
        if a.cu_q is None:
            return blockwise.dense_layout(self.call.pattern, self.call.mask_mod, a.q.shape[1], a.k.shape[1])
        assert a.cu_kv is not None
        return self.backend.packed_layout(self.call.pattern, a.cu_q, a.cu_kv, a.q.shape[0], a.k.shape[0], a.max_q,
                                          a.max_kv)

    def forward(self, a: CallArgs) -> tuple[Tensor, Tensor, Tensor]:
        one = a.cu_q is not None  # packed: one sequence of T tokens
        q, k, v = (t.unsqueeze(0) if one else t for t in (a.q, a.k, a.v))
        out, lse = blockwise.forward(q, k, v, self._layout(a), scale=a.scale, sink=a.sink, alibi_slopes=a.alibi)
        return (out[0], lse[0], kernel_rng(a)) if one else (out, lse, kernel_rng(a))

    def backward(self, a: CallArgs, grad_out: Tensor, out: Tensor, lse: Tensor, rng_state: Tensor
                 ) -> tuple[Any, ...]:
        one = a.cu_q is not None
        q, k, v, g, o, l = (t.unsqueeze(0) if one else t for t in (a.q, a.k, a.v, grad_out, out, lse))
        dq, dk, dv, dsink, dslopes = blockwise.backward(g, q, k, v, o, l, self._layout(a), scale=a.scale,
                                                        sink=a.sink, alibi_slopes=a.alibi)
        return (dq[0], dk[0], dv[0], dsink, dslopes, None) if one else (dq, dk, dv, dsink, dslopes, None)


def _finish(result: tuple[Tensor, Tensor], return_lse: bool) -> Output:
    out, lse = result
    return (out, lse.float()) if return_lse else out


__all__ = ["ReferenceBackend"]
