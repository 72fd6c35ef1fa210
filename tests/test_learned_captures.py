"""Hooks that capture a tensor requiring grad (a learned relative-position bias table).

Supported where the table's gradient is autograd through the hook as called: the ``reference`` backend in
eager mode, whose gradient for the table equals the float64 oracle's.  Refused with our error where it would
silently get none: ``turbo`` and ``flex`` at build (``hook-learned``; ``auto`` picks ``reference``), and any
call inside a compiled graph (``B34.learned-compile``: the op takes q, k and v, not the hook's tensors).
"""

from __future__ import annotations

import pytest
import torch

from primus_ext.call import TurboFlexAttention
from primus_ext.errors import UnsupportedConfigError, UnsupportedInputError
from primus_ext.plan import build_plan
from primus_ext.testing import fake_primus_turbo

from . import flex_hooks
from .fuzz import oracle
from .helpers import facts, qkv, settings

S = 24
HOOK = dict(turbo_flex_attention_score_mod="tests.flex_hooks:relative_bias")


def plan(backend: str, **keys):
    return build_plan(settings(turbo_flex_attention_backend=backend, **HOOK, **keys), facts(seq_length=S))


def test_auto_picks_reference_and_the_table_trains_as_the_oracle_says():
    chosen = plan("auto")
    assert chosen.backend == "reference" and "require grad" in chosen.backend_reason
    q, k, v = qkv(s=S, grad=True)
    flex_hooks.RELATIVE.grad = None
    out = TurboFlexAttention(chosen)(q, k, v)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    out.backward(grad_out)
    got = flex_hooks.RELATIVE.grad.clone()
    flex_hooks.RELATIVE.grad = None

    table = flex_hooks.RELATIVE.detach().double().requires_grad_(True)

    def bias(score, b, h, q_idx, kv_idx):
        return score + table[(q_idx - kv_idx).clamp(0, 15)]

    mask = oracle.flash_mask(S, S, causal=True, window=(-1, -1))
    want_out, _ = oracle.attention(*(t.detach().double() for t in (q, k, v)), mask, score_fn=bias)
    want_out.backward(grad_out.double())
    assert got.abs().sum() > 0
    torch.testing.assert_close(got.double(), table.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["flex", "turbo"])
def test_a_fixed_kernel_or_flex_is_refused_at_build(backend):
    with fake_primus_turbo():
        with pytest.raises(UnsupportedConfigError) as err:
            plan(backend)
    assert "hook-learned" in err.value.codes and "requires_grad=False" in str(err.value)


def test_a_frozen_table_is_no_learned_capture():
    flex_hooks.RELATIVE.requires_grad_(False)
    try:
        assert plan("flex").backend == "flex"
    finally:
        flex_hooks.RELATIVE.requires_grad_(True)


def test_under_torch_compile_the_call_is_our_refusal():
    run = TurboFlexAttention(plan("reference"))
    compiled = torch.compile(lambda q, k, v: run(q, k, v), backend="aot_eager", fullgraph=True)
    with pytest.raises(UnsupportedInputError) as err:
        compiled(*qkv(s=S, grad=True))
    assert "B34.learned-compile" in err.value.codes
