"""The adapter's prepared-call cache (`primus_ext.call.prepared`) changes nothing but the cost.

After a valid call the adapter keeps a runner for equal calls.  Held here:

* every hostile input of the B34 sweep is still refused with our error when it follows a
  valid call of the same kind (the memo must not let it through);
* a call the plan did not assume is still routed and refused (B33) after the planned call
  (``test_call_checks``, ``after-the-planned-call``); a sink of another dtype is cast;
* the memoised call hands the kernel exactly the arguments the full path handed it, for
  dense causal, window, the plan's own flags (none passed), sink (a bf16 sink still cast to fp32)
  and packed calls;
* a hook proof resting on a module global is re-checked at every call, cached or not.
"""

from __future__ import annotations

import types

import pytest
import torch

from primus_ext.errors import PrimusExtError, UnsupportedInputError
from primus_ext.plan import build_plan
from primus_ext.call.adapter import TurboFlexAttention
from primus_ext.testing import fake_primus_turbo

from .helpers import adapter, facts, packed_qkv, qkv, settings
from .test_call_checks import SWEEP, _sbhd, packed_call


def warm_up(run, name: str) -> None:
    """A valid call of the same kind as the sweep entry ``name``."""
    if "cu_seqlens" in name or "max_seqlen" in name:
        packed_call(run)
    else:
        run(*qkv())
    assert len(run.calls) == 1, "the valid call was not prepared: the sweep would not test it"


@pytest.mark.parametrize("backend", ["reference", "turbo"])
@pytest.mark.parametrize("name", sorted(SWEEP))
def test_a_memoised_adapter_still_refuses_every_hostile_input(name, backend):
    with fake_primus_turbo(arch=None):
        run = adapter(settings(turbo_flex_attention_backend=backend), facts(packed=None))
        warm_up(run, name)
        with pytest.raises(PrimusExtError) as err:
            SWEEP[name](run)
    assert isinstance(err.value, UnsupportedInputError), err.value


def test_a_sink_of_another_dtype_after_the_memo_is_cast_like_the_first():
    layer = facts(num_heads=8, num_kv_heads=1, head_dim=64, seq_length=128, dtype="bf16", packed=False)
    with fake_primus_turbo(arch="gfx942", build="main") as fake:
        run = TurboFlexAttention(build_plan(settings(turbo_flex_attention_backend="turbo", turbo_arch="gfx942",
                                                     use_sink_attention=True), layer))
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            run(*(_sbhd(h, arch="gfx942") for h in (8, 1, 1)), causal=True, sink=torch.zeros(8, dtype=dtype))
    assert [c.args["sink"].dtype for c in fake.calls] == [torch.float32] * 3


CASES = {
    "causal": (dict(), dict(causal=True)),
    "window": (dict(sink_sliding_window=5), dict(causal=True, window_size=(5, 0))),
    "the plan's flags (none passed)": (dict(sink_sliding_window=5), dict()),
    "sink (bf16)": (dict(use_sink_attention=True), dict(causal=True, sink=torch.zeros(4, dtype=torch.bfloat16))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_memoised_call_passes_the_kernel_the_same_arguments(name):
    keys, kwargs = CASES[name]
    with fake_primus_turbo() as fake:
        run = adapter(settings(turbo_flex_attention_backend="turbo", **keys), facts(packed=False))
        q, k, v = qkv(dtype=torch.float32)
        first = run(q, k, v, **kwargs)
        second = run(q, k, v, **kwargs)
        assert (run.calls.misses, run.calls.hits) == (1, 1)
    slow, fast = fake.calls
    assert slow.entry == fast.entry and slow.args.keys() == fast.args.keys()
    for key, value in slow.args.items():
        other = fast.args[key]
        if isinstance(value, torch.Tensor):
            assert value.dtype == other.dtype and torch.equal(value, other), key
        else:
            assert value == other, key
    torch.testing.assert_close(first, second, rtol=0, atol=0)


def test_the_memoised_packed_call_passes_the_kernel_the_same_arguments_and_checks_new_boundaries():
    with fake_primus_turbo() as fake:
        run = adapter(settings(turbo_flex_attention_backend="turbo"), facts(packed=True))
        packed_call(run)
        packed_call(run)
        assert (run.calls.misses, run.calls.hits) == (1, 1)
        slow, fast = fake.calls
        assert {k: v for k, v in slow.args.items() if not isinstance(v, torch.Tensor)} == \
            {k: v for k, v in fast.args.items() if not isinstance(v, torch.Tensor)}
        bad = torch.tensor([0, 9, 11], dtype=torch.int32)  # a document longer than max_seqlen 7
        with pytest.raises(UnsupportedInputError):
            packed_call(run, cu_seqlens_q=bad, cu_seqlens_kv=bad)
    assert len(fake.calls) == 2


def test_a_proof_resting_on_a_global_is_checked_at_every_call(monkeypatch):
    module = types.ModuleType("memo_hooks")
    module.WIDTH = 3
    # The hook reads WIDTH as a module global (a module held in a captured variable is outside the subset).
    exec("def band(b, h, q_idx, kv_idx):\n    return (kv_idx <= q_idx) & (q_idx - kv_idx <= WIDTH)\n",  # noqa: S102
         module.__dict__)
    monkeypatch.setitem(__import__("sys").modules, "memo_hooks", module)
    with fake_primus_turbo():
        run = adapter(settings(turbo_flex_attention_backend="turbo", turbo_flex_attention_mask_mod="memo_hooks:band"),
                      facts(packed=False))
        q, k, v = qkv(dtype=torch.float32)
        run(q, k, v)
        run(q, k, v)
        assert run.calls.hits == 1, "a proof resting on a global gets the fast path too, re-checked"
        module.WIDTH = 5
        with pytest.raises(UnsupportedInputError) as err:
            run(q, k, v)
    assert "(B31)" in str(err.value)


def test_packed_inputs_keep_their_own_memo_checks():
    """int64 boundaries take the full path (they are cast), and then run exactly."""
    with fake_primus_turbo():
        run = adapter(settings(turbo_flex_attention_backend="reference"), facts(packed=True))
        q, k, v = packed_qkv(11)
        cu = torch.tensor([0, 4, 11])
        a = run.varlen(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=None, max_seqlen_k=None)
        b = run.varlen(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=None, max_seqlen_k=None)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_sink_on_another_device_is_refused_by_us():
    with fake_primus_turbo():
        run = adapter(settings(use_sink_attention=True), facts(packed=False))
        q, k, v = qkv()
        run(q, k, v, causal=True, sink=torch.zeros(4))
        with pytest.raises(UnsupportedInputError, match="sink"):
            run(q, k, v, causal=True, sink=torch.zeros(4, device="meta"))


def test_inference_mode_tensors_are_checked_at_every_call():
    """Inference tensors have no version counter: their values cannot be memoised as proven,
    so each call checks them (and refuses a bad one), instead of failing inside torch."""
    run = adapter(settings(), facts(packed=True))
    with torch.inference_mode():
        q, k, v = packed_qkv(11)
        cu = torch.tensor([0, 4, 11], dtype=torch.int32)
        for _ in range(2):
            run.varlen(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=7, max_seqlen_k=7)
        bad = torch.tensor([0, 2, 11], dtype=torch.int32)
        with pytest.raises(UnsupportedInputError, match="max_seqlen"):
            run.varlen(q, k, v, causal=True, cu_seqlens_q=bad, cu_seqlens_k=bad, max_seqlen_q=7, max_seqlen_k=7)


def test_a_window_equal_in_value_but_not_of_ints_is_refused_after_the_memo():
    """(2.0, 0) == (2, 0) in Python; the fast path must not take it where the full path refuses it."""
    with fake_primus_turbo():
        run = adapter(settings(sink_sliding_window=2), facts(packed=False))
        q, k, v = qkv()
        run(q, k, v, causal=True, window_size=(2, 0))
        with pytest.raises(UnsupportedInputError, match="window_size"):
            run(q, k, v, causal=True, window_size=(2.0, 0))
