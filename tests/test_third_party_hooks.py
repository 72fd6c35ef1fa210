"""attn-gym's and torchtitan's mask and score factories, used as their docs show.

Every one runs exactly on ``reference`` (equal to the float64 oracle of the hook as torch
calls it); each that is a fixed kernel's attention is proven and runs on ``turbo`` (the CPU
fake); the others are refused there with B31.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import _vmap_for_bhqkv

from primus_ext.call.adapter import TurboFlexAttention
from primus_ext.errors import UnsupportedConfigError
from primus_ext.plan import build_plan
from primus_ext.testing import fake_primus_turbo

from . import oracle, third_party_hooks
from .helpers import facts, qkv, settings

S = 16
MASKS = {  # factory, kwargs -> what turbo runs (None: refused, B31)
    "gym_causal": ({}, "causal"),
    "gym_sliding_window": ({"window_size": 3}, "window(left=3, right=0)"),
    "gym_prefix_lm": ({"prefix_length": 4}, None),
    "gym_dilated_sliding_window": ({"window_size": 4, "dilation": 2}, None),
    "gym_global_sliding_window": ({"window_size": 2}, None),
    "titan_causal": ({}, "causal"),
    "titan_sliding_window": ({"window_size": 4}, "window(left=3, right=0)"),
    "titan_fixed_block": ({"fixed_block_size": 4}, "chunks(4)"),
    "titan_document": ({}, None),
    "titan_sliding_window_and_blocks": ({"window_size": 3, "fixed_block_size": 8}, "chunks(8, window(left=2, right=0))"),
}
SCORES = {"gym_alibi": ({"num_heads": 4}, "alibi"), "gym_softcap": ({"soft_cap": 20}, None)}


def _settings(kind: str, name: str, kwargs: dict, backend: str):
    keys = {f"turbo_flex_attention_{kind}": f"tests.third_party_hooks:{name}",
            f"turbo_flex_attention_{kind}_kwargs": kwargs}
    if kind == "score_mod":
        keys.update(turbo_flex_attention_mask_mod="tests.third_party_hooks:gym_causal",
                    turbo_flex_attention_mask_mod_kwargs={})
    return settings(turbo_flex_attention_backend=backend, **keys)


def _expected(kind: str, hook, q, k, v):
    batch, s, hq, d = q.shape
    grid = [torch.arange(n) for n in (batch, hq, s, s)]
    if kind == "mask_mod":
        mask = _vmap_for_bhqkv(hook, prefix=())(*grid)
        return oracle.attention(q, k, v, lambda b, h, i, j: bool(mask[b, h, i, j]))
    keys = k.double().repeat_interleave(hq // k.shape[2], 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), keys) / d ** 0.5
    table = _vmap_for_bhqkv(hook, prefix=(0,))(scores, *grid).double()
    return oracle.attention(q, k, v, oracle.causal(), score_mod=lambda score, b, h, i, j: table[b, h, i, j])


CASES = [("mask_mod", n, *v) for n, v in MASKS.items()] + [("score_mod", n, *v) for n, v in SCORES.items()]


@pytest.mark.parametrize("kind, name, kwargs, proven", CASES, ids=[c[1] for c in CASES])
@pytest.mark.parametrize("backend", ["reference", "turbo"])
def test_a_library_factory_runs_exactly_or_is_refused_on_turbo(kind, name, kwargs, proven, backend):
    q, k, v = qkv(s=S)
    hook = getattr(third_party_hooks, name)(**kwargs)
    with fake_primus_turbo():
        if backend == "turbo" and proven is None:
            with pytest.raises(UnsupportedConfigError) as err:
                build_plan(_settings(kind, name, kwargs, backend), facts(seq_length=S))
            assert {"B31", "softcap"} & set(err.value.codes)
            return
        plan = build_plan(_settings(kind, name, kwargs, backend), facts(seq_length=S))
        if backend == "turbo":
            shown = plan.mask_recognised if kind == "mask_mod" else plan.score_recognised
            assert shown == proven
        out = TurboFlexAttention(plan)(q, k, v)
    torch.testing.assert_close(out, _expected(kind, hook, q, k, v), atol=1e-9, rtol=1e-9)
