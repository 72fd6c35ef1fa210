"""A stand-in for torch's ``flex_attention`` with its exact call contract, computing with autograd.

torch's FlexAttention has no CPU backward, so the glue of the ``flex`` backend (sinks through the
LSE, GQA, packing) is differentiated on the CPU through this function instead; a test holds its
forward equal to the real ``flex_attention``'s.  It reads the BlockMask as the kernel does: a key
block not listed for a query block is skipped, inside a listed block the mask_mod decides.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import AuxOutput, AuxRequest, BlockMask, _vmap_for_bhqkv


def _allowed(block_mask: Optional[BlockMask], b: int, h: int, sq: int, skv: int, device) -> Optional[Tensor]:
    if block_mask is None:
        return None
    qb, kb = block_mask.BLOCK_SIZE
    blocks = block_mask.to_dense().to(torch.bool)  # [B or 1, H or 1, q blocks, kv blocks]
    cells = blocks.repeat_interleave(qb, dim=2).repeat_interleave(kb, dim=3)[..., :sq, :skv]
    index = [torch.arange(n, device=device) for n in (b, h, sq, skv)]
    inside = _vmap_for_bhqkv(block_mask.mask_mod, prefix=())(*index)
    return cells & torch.as_tensor(inside, dtype=torch.bool).broadcast_to((b, h, sq, skv))


def flex_standin(query: Tensor, key: Tensor, value: Tensor, score_mod: Any = None,
                 block_mask: Optional[BlockMask] = None, scale: Optional[float] = None, enable_gqa: bool = False,
                 return_lse: bool = False, kernel_options: Any = None, *,
                 return_aux: Optional[AuxRequest] = None) -> Any:
    b, hq, sq, d = query.shape
    hkv, skv = key.shape[1], key.shape[2]
    if hq != hkv:
        if not enable_gqa or hq % hkv:
            raise ValueError(f"query heads {hq} and key/value heads {hkv} need enable_gqa=True and divide")
        key = key.repeat_interleave(hq // hkv, dim=1)
        value = value.repeat_interleave(hq // hkv, dim=1)
    work = torch.promote_types(query.dtype, torch.float32)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    s = (query.to(work) @ key.to(work).transpose(-1, -2)) * scale
    if score_mod is not None:
        index = [torch.arange(n, device=query.device) for n in (b, hq, sq, skv)]
        s = _vmap_for_bhqkv(score_mod, prefix=(0,))(s, *index).to(work)
    allowed = _allowed(block_mask, b, hq, sq, skv, query.device)
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    top = s.amax(-1, keepdim=True).detach()
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    p = torch.exp(s - top)
    denom = p.sum(-1, keepdim=True)
    out = (p @ value.to(work)) / torch.where(denom > 0, denom, torch.ones_like(denom))
    live = denom > 0
    lse = torch.where(live, torch.log(torch.where(live, denom, torch.ones_like(denom))) + top,
                      torch.full_like(denom, -math.inf)).squeeze(-1)
    out = out.to(query.dtype)
    if return_aux is not None and return_aux.lse:
        return out, AuxOutput(lse=lse)
    if return_lse:
        return out, lse
    return out
