"""Small builders shared by the tests."""

from __future__ import annotations

from typing import Any

import torch

from primus_ext.call.adapter import TurboFlexAttention
from primus_ext.plan import LayerFacts, build_plan
from primus_ext.settings import TurboAttentionSettings

FLEX_ON = {"use_turbo_attention": True, "use_turbo_flex_attention": True}


def settings(**keys: Any) -> TurboAttentionSettings:
    """Flex path on, reference backend, unless overridden."""
    return TurboAttentionSettings.from_dict({**FLEX_ON, "turbo_flex_attention_backend": "reference", **keys})


def facts(**fields: Any) -> LayerFacts:
    base = dict(num_heads=4, num_kv_heads=2, head_dim=8, seq_length=16)
    return LayerFacts(**{**base, **fields})


def adapter(settings_obj: TurboAttentionSettings, facts_obj: LayerFacts | None = None, **kw: Any) -> TurboFlexAttention:
    return TurboFlexAttention(build_plan(settings_obj, facts_obj or facts()), **kw)


def qkv(b: int = 2, s: int = 16, hq: int = 4, hkv: int = 2, d: int = 8, dtype=torch.float64,
        skv: int | None = None, seed: int = 0, grad: bool = False):
    gen = torch.Generator().manual_seed(seed)
    skv = s if skv is None else skv
    q = torch.randn(b, s, hq, d, generator=gen, dtype=dtype)
    k = torch.randn(b, skv, hkv, d, generator=gen, dtype=dtype)
    v = torch.randn(b, skv, hkv, d, generator=gen, dtype=dtype)
    if grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def packed_qkv(total: int, hq: int = 4, hkv: int = 2, d: int = 8, dtype=torch.float64, seed: int = 0, grad=False):
    q, k, v = qkv(1, total, hq, hkv, d, dtype=dtype, seed=seed)
    q, k, v = q[0], k[0], v[0]
    if grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def proven_both_ways(prove: Any, hook: Any, monkeypatch: Any, module: Any, fast_path: str) -> tuple[Any, Any, list]:
    """``(proof, proof with module.fast_path switched off, what the fast path returned)``, each proven cold:
    a fast path's verdict is held to the one it stands in for."""
    from primus_ext.hooks import proof as hook_proof

    returned: list = []
    real = getattr(module, fast_path)
    proofs = []
    for replacement in (lambda *a: returned.append(real(*a)) or returned[-1], lambda *a: None):
        hook_proof._BY_OBJECT.clear()
        hook_proof._BY_FINGERPRINT.clear()
        with monkeypatch.context() as m:
            m.setattr(module, fast_path, replacement)
            proofs.append(prove(hook, num_heads=4))
    return proofs[0], proofs[1], returned
