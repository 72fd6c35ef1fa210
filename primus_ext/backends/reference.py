"""The ``reference`` backend: exact attention in torch, with autograd, on any device.

This is how CPU users train and how every other path is checked.  Plain causal or
full attention without extras goes through ``scaled_dot_product_attention``;
everything else materialises the score matrix (the math lives in `exact`).
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor

from . import exact
from .base import BackendCapabilities, KernelCall, Output


class ReferenceBackend:
    """Runs any plan exactly; nothing is recognised, nothing is refused for speed."""

    name = "reference"

    def capabilities(self) -> BackendCapabilities:
        return BackendCapabilities(
            name=self.name,
            runs_any_mask=True,
            softcap=True,
            dense_entry="torch (exact)",
            packed_entry="torch (exact, document mask)",
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


__all__ = ["ReferenceBackend"]
