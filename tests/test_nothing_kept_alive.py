"""No cache keeps a call's inputs alive after the call returns or raises.

A memo that keeps an exception instance and raises it again appends each raising frame to its
traceback, and the frames hold the call's q, k and v: a caller that catches refusals (a loader
skipping a bad batch) would keep every refused batch.  Each case below makes three calls with fresh
tensors, catches what they raise, drops its references and asks the garbage collector whether any
of the nine tensors is still alive.
"""

from __future__ import annotations

import gc
import weakref
from typing import Callable

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType

from primus_ext.errors import PrimusExtError
from primus_ext.megatron import PrimusTurboLocalAttention
from primus_ext.testing import fake_primus_turbo
from tests.megatron import gpt
from tests.megatron.conftest import megatron_world  # noqa: F401 - the gloo world Megatron's modules need

from .helpers import adapter, facts, qkv, settings

BF16 = torch.bfloat16
TURBO = dict(turbo_flex_attention_backend="turbo")


def _turbo_adapter(**keys):
    return adapter(settings(**TURBO, **keys), facts(dtype="bf16", head_dim=64))


def _tensors(refs: list, *tensors: torch.Tensor) -> tuple:
    refs.extend(weakref.ref(t) for t in tensors)
    return tensors


def _route_refused(run, seed, refs):  # fp32 at gfx950: no kernel backend takes it (B33, the route memo)
    run(*_tensors(refs, *qkv(d=64, dtype=torch.float32, seed=seed)))


def _rank_refused(run, seed, refs):  # 3-D tensors on the dense entry (a call rule)
    q, k, v = _tensors(refs, *(t[0].clone() for t in qkv(d=64, dtype=BF16, seed=seed)))
    run(q, k, v)


def _runs(run, seed, refs):  # a call that runs: its output dropped too
    run(*_tensors(refs, *qkv(d=64, dtype=BF16, seed=seed)))


def _module():
    return PrimusTurboLocalAttention(gpt.config(kv_channels=16, bf16=True, params_dtype=BF16), 1,
                                     AttnMaskType.causal, "self", settings=gpt.settings())


def _module_refused(run, seed, refs):  # sbhd tensors with THD boundaries (B21)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = _tensors(refs, *(torch.randn(16, 2, h, 16, generator=gen).to(BF16) for h in (4, 2, 2)))
    bounds = torch.tensor([0, 10, 32], dtype=torch.int32)
    run(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=bounds,
                                                         cu_seqlens_kv=bounds, max_seqlen_q=22, max_seqlen_kv=22))


CASES: dict[str, tuple[Callable, Callable]] = {
    "route-refusal": (_turbo_adapter, _route_refused),
    "call-rule-refusal": (_turbo_adapter, _rank_refused),
    "call-that-runs": (_turbo_adapter, _runs),
    "megatron-module-refusal": (_module, _module_refused),
}


def _alive_after_three_calls(run, call, fake) -> int:
    refs: list[weakref.ref] = []
    refused = 0
    for seed in range(3):
        try:
            call(run, seed, refs)
        except PrimusExtError:
            refused += 1
    assert len(refs) == 9 and refused in (0, 3)
    fake.calls.clear()  # the fake's own log of the calls it took (a test's instrument, not ours)
    gc.collect()
    return sum(r() is not None for r in refs)


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_no_tensor_of_a_call_outlives_it(case, arch):
    build, call = CASES[case]
    with fake_primus_turbo(arch=arch) as fake:
        run = build() if case != "route-refusal" else adapter(settings(**TURBO, turbo_arch=arch),
                                                              facts(dtype="bf16", head_dim=64))
        assert _alive_after_three_calls(run, call, fake) == 0


def test_a_model_refused_by_the_primus_check_keeps_no_forwards_inputs():
    """The launcher's model check refuses every later forward too: with a fresh error each time, so
    no refused forward's frames stay on one error's traceback."""
    import sys

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from primus_ext.primus import layer_check

    saved = dict(layer_check._state)
    check = layer_check.LayerCheck(lambda: True)
    try:
        layer_check._state["condition"] = None
        sys.modules.setdefault("megatron.training", None)  # type: ignore[arg-type]
        torch.manual_seed(0)
        model = GPTModel(config=gpt.config(), transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=gpt.VOCAB,
                         max_sequence_length=gpt.SEQ * 4, position_embedding_type="learned_absolute")
        refs, errors = [], []
        for _ in range(3):
            tokens = torch.randint(0, gpt.VOCAB, (2, gpt.SEQ))
            refs.append(weakref.ref(tokens))
            try:
                model(tokens, torch.arange(gpt.SEQ).expand_as(tokens), None)
            except PrimusExtError as exc:
                errors.append(str(exc))
            del tokens
        gc.collect()
        assert len(errors) == 3 and len(set(errors)) == 1
        assert sum(r() is not None for r in refs) == 0
    finally:
        check.remove()
        layer_check._state.update(saved)
