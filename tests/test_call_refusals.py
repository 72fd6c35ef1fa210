"""Every call-time refusal comes from one catalogue, `primus_ext.refusals.CALL_RULES` (issue 27).

Each rule is triggered once here, through what a user calls: the flex adapter
(``TurboFlexAttention(plan)(q, k, v, ...)`` for dense calls, ``.varlen(...)`` with
``flash_attn_varlen_func``'s arguments for packed ones), the Megatron modules, and
`pack_eod_micro_batch`; Primus-Turbo is the CPU fake.  For each: the error is our
`UnsupportedInputError`, it carries the rule's code, and docs/refusals.md lists the code.
A rule added to the catalogue without a trigger here fails `test_every_rule_has_a_trigger`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType

from primus_ext.backends.context_parallel import Ulysses
from primus_ext.backends.shared_prefix import SharedPrefixLayout
from primus_ext.call import TurboFlexAttention
from primus_ext.call.shared_prefix import shared_prefix_attention
from primus_ext.errors import UnsupportedInputError
from primus_ext.megatron import PrimusTurboLocalAttention, pack_eod_micro_batch
from primus_ext.megatron.context_parallel import LayerContextParallel
from primus_ext.plan import build_plan
from primus_ext.refusals import CALL_RULES
from primus_ext.testing import fake_primus_turbo
from tests.megatron import gpt
from tests.megatron.conftest import megatron_world  # noqa: F401 - the gloo world Megatron's modules need

from . import hook_examples, proof_hooks
from .helpers import adapter, facts, packed_qkv, qkv, settings

DOCS = Path(__file__).resolve().parent.parent / "docs" / "refusals.md"
BF16 = torch.bfloat16
FULL = dict(causal=False, attn_mask_type="no_mask")
ALIBI = {"turbo_flex_attention_score_mod": "tests.hook_examples:alibi"}
SYMMETRIC = {"turbo_flex_attention_score_mod": "tests.hook_examples:symmetric_alibi"}
DOCUMENTS = {"turbo_flex_attention_mask_mod": "primus_ext.attention.masks:packed_documents",
             "turbo_flex_attention_mask_mod_kwargs": {"cu_seqlens": [0, 6, 16]}}


# -------------------------------------------------------------------------------- callers
def turbo(**keys: Any):
    return settings(turbo_flex_attention_backend="turbo", **keys)


def cu(*bounds: int, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor(bounds, dtype=dtype)


def varlen(run: TurboFlexAttention, total: int = 11, bounds: Any = None, longest: Any = 7, *, q: Any = None,
           **kw: Any):
    """``run.varlen`` on ``total`` packed tokens, documents ``bounds`` (default [0, 4, 11]) on both sides."""
    tq, tk, tv = packed_qkv(total)
    q = tq if q is None else q
    bounds = cu(0, 4, 11) if bounds is None else bounds
    return run.varlen(q, tk, tv, bounds, bounds, longest, longest, **kw)


def slopes() -> torch.Tensor:
    return torch.tensor(hook_examples.SLOPES, dtype=torch.float32)


def _traced(run: TurboFlexAttention, call: Callable, *tensors: torch.Tensor, fullgraph: bool = True):
    """``call(run, *tensors)`` under ``torch.compile`` (the adapter built outside the graph)."""
    return torch.compile(lambda *ts: call(run, *ts), backend="aot_eager", fullgraph=fullgraph)(*tensors)


def sbhd(s: int = 16, b: int = 2, hq: int = 4, hkv: int = 2, d: int = 16):
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(s, b, h, d, generator=gen) for h in (hq, hkv, hkv))


def thd(t: int = 12, hq: int = 4, hkv: int = 2, d: int = 16):
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(t, h, d, generator=gen) for h in (hq, hkv, hkv))


def thd_params(**over: Any) -> PackedSeqParams:
    bounds = cu(0, 5, 12)
    fields = dict(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=7, max_seqlen_kv=7)
    return PackedSeqParams(**{**fields, **over})


MEGATRON_PATHS = {
    "direct": {},
    "flex-reference": dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="reference"),
}


def megatron(path: str = "direct", mask_type=AttnMaskType.causal, keys: Any = None, **cfg: Any):
    """The Megatron core-attention module (built inside a fake Primus-Turbo, as the direct path needs)."""
    return PrimusTurboLocalAttention(gpt.config(kv_channels=16, **cfg), 1, mask_type, "self",
                                     settings=gpt.settings(**MEGATRON_PATHS[path], **(keys or {})))


RESET = dict(reset_attention_mask=True)


def _learned_after_build():
    """A table frozen at build (so hook-learned let the layer onto flex), set to train before a call."""
    from . import flex_hooks
    from .flex_standin import flex_standin

    flex_hooks.RELATIVE.requires_grad_(False)
    try:
        run = adapter(settings(turbo_flex_attention_backend="flex",
                               turbo_flex_attention_score_mod="tests.flex_hooks:relative_bias"))
    finally:
        flex_hooks.RELATIVE.requires_grad_(True)
    run.backend.kernel = flex_standin  # past the CPU-backward refusal: what is refused is the table
    return run(*qkv(grad=True))


def _untraceable_on_flex():
    """torch's flex_attention raising its tracer's error on a hook (the fuzzer met one with math.isqrt in a
    Megatron layer): our refusal, not torch._dynamo's."""
    import torch._dynamo

    from primus_ext.attention.pattern import Pattern
    from primus_ext.backends.base import KernelCall
    from primus_ext.backends.flex import FlexBackend

    def kernel(*args, **kwargs):
        raise torch._dynamo.exc.TorchDynamoException("torch.* op returned non-Tensor")

    q = torch.randn(1, 4, 2, 8)
    FlexBackend(kernel=kernel).dense(q, q, q, KernelCall(pattern=Pattern(-1, 0)))


def causal_mask(b: int, q_len: int, kv_len: int) -> torch.Tensor:
    """Megatron's causal mask (True = masked)."""
    return torch.arange(kv_len).view(1, -1) > torch.arange(q_len).view(-1, 1)


def on_cp_rank(layer: PrimusTurboLocalAttention) -> PrimusTurboLocalAttention:
    """``layer`` as rank 0 of two context-parallel ranks sees its calls.  A real CP-2 world needs spawned
    processes (tests/megatron/test_cp_ulysses.py); these refusals all come before the first exchange."""
    core = layer.core
    core.cp = LayerContextParallel(Ulysses(None, 2, 0), core.check_mask.layer_is_causal, core.check_mask.what)
    return layer


def cp_layer(mask_type=AttnMaskType.causal) -> PrimusTurboLocalAttention:
    return on_cp_rank(megatron(mask_type=mask_type))


# -------------------------------------------------------------------------------- one trigger per rule
def _backend_lacks():
    """ALiBi slopes given to a fixed-kernel backend that declares its kernels take none."""
    from primus_ext.backends.base import HOOKS_PROVEN, BackendCapabilities

    class Kernels:
        name = "kernels"

        def capabilities(self) -> BackendCapabilities:
            return BackendCapabilities(name=self.name, hooks=HOOKS_PROVEN, softcap=False, dense_entry="dense")

    plan = build_plan(settings(), facts(packed=False), backend=Kernels())
    TurboFlexAttention(plan, backend=Kernels())(*qkv(dtype=torch.float32), alibi_slopes=slopes())


def _hook_assumption():
    layer = TurboFlexAttention(build_plan(turbo(turbo_flex_attention_mask_mod="tests.proof_hooks:global_window"),
                                          facts()))
    layer(*qkv())
    try:
        proof_hooks.WINDOW = 4
        layer(*qkv())
    finally:
        proof_hooks.WINDOW = 8


def _eod_tokens(eod_every: int, batch: int = 2, seq: int = 16) -> torch.Tensor:
    tokens = torch.ones(batch, seq, dtype=torch.int64)
    tokens[:, eod_every - 1::eod_every] = 0
    return tokens


def _hook_changed() -> None:
    """A captured document-id tensor written between a call's forward and its backward on reference."""
    from . import hook_state_hooks

    saved = hook_state_hooks.DOC.clone()
    try:
        out = adapter(settings(turbo_flex_attention_mask_mod="tests.hook_state_hooks:documents"))(*qkv(grad=True))
        hook_state_hooks.DOC.zero_()
        out.sum().backward()
    finally:
        hook_state_hooks.DOC.copy_(saved)


TRIGGERS: dict[str, Callable[[], Any]] = {
    # the flash-attn-compatible entries
    "B26": lambda: adapter(settings())(*qkv(), return_attn_probs=True),
    "B31.assumption": _hook_assumption,
    "B34.hook-changed": _hook_changed,
    "B34.flex-device": lambda: adapter(settings(turbo_flex_attention_backend="flex"))(
        *(t.to("meta") for t in qkv(dtype=torch.float32))),
    "B34.mask-length": lambda: adapter(settings(**DOCUMENTS))(*qkv(s=12)),
    "B34.unequal-lengths": lambda: adapter(turbo())(*qkv(skv=12), causal=True),
    "B34.unplanned-sink": lambda: adapter(settings())(*qkv(), sink=torch.zeros(4)),
    "B34.backend-lacks": _backend_lacks,
    "B34.missing-sink": lambda: adapter(settings(use_sink_attention=True))(*qkv()),
    "B34.alibi-grad": lambda: adapter(turbo())(*qkv(dtype=torch.float32), alibi_slopes=slopes().requires_grad_()),
    "B34.alibi-twice": lambda: adapter(settings(**ALIBI))(*qkv(), alibi_slopes=slopes().double()),
    "B34.dense-rank": lambda: adapter(settings(), facts(packed=False))(*packed_qkv(16)),
    "B34.packed-rank": lambda: adapter(settings()).varlen(*qkv(b=1), cu(0, 16), cu(0, 16), 16, 16),
    "B17": lambda: varlen(adapter(settings(**ALIBI))),
    # the Megatron modules
    "B29": lambda: megatron()(*sbhd(), None, attention_bias=torch.zeros(1, 4, 16, 16)),
    "B34.mask-type": lambda: megatron()(*sbhd(), None, AttnMaskType.no_mask),
    "B21.no-packed-entry": lambda: PrimusTurboLocalAttention(
        gpt.fp8_config(), 1, AttnMaskType.causal, "self", settings=gpt.settings(enable_turbo_attention_float8=True))(
        *gpt.fp8_tensors(*thd()), None, packed_seq_params=thd_params()),
    "B21": lambda: megatron()(*sbhd(), None, packed_seq_params=thd_params(qkv_format="sbhd")),
    "B34.thd-bounds": lambda: megatron()(*thd(), None, packed_seq_params=PackedSeqParams(qkv_format="thd")),
    "B19.type": lambda: megatron()(*thd(), None, packed_seq_params=thd_params(cu_seqlens_q_padded=[0, 5, 12])),
    "B19": lambda: megatron()(*thd(), None, packed_seq_params=thd_params(cu_seqlens_q_padded=cu(0, 6, 12))),
    "B34.mask-with-thd": lambda: megatron()(*thd(), causal_mask(1, 12, 12)[None, None],
                                            packed_seq_params=thd_params()),
    "B34.window-alignment": lambda: megatron("flex-reference", AttnMaskType.no_mask, window_size=(2, 3))(
        sbhd(s=10)[0], *sbhd()[1:], None),
    "B34.bottom-right": lambda: megatron("flex-reference", AttnMaskType.causal_bottom_right)(
        sbhd(s=8)[0], *sbhd()[1:], None),
    "B34.top-left": lambda: megatron()(sbhd(s=8)[0], *sbhd()[1:], None),
    # the call's own inputs
    "B34.heads": lambda: adapter(settings())(*qkv(hkv=4)),
    "B34.qkv-type": lambda: adapter(settings())([[0.0]], *qkv()[1:]),
    "B34.dtype": lambda: adapter(settings())(*(t.long() for t in qkv())),
    "B34.mixed-dtypes": lambda: adapter(settings())(qkv()[0].float(), *qkv()[1:]),
    "B34.mixed-devices": lambda: adapter(settings())(qkv()[0].to("meta"), *qkv()[1:]),
    "B34.mixed-ranks": lambda: adapter(settings())(qkv()[0][0], *qkv()[1:]),
    "B34.qkv-shapes": lambda: adapter(settings())(*qkv()[:2], qkv(s=8)[2]),
    "B34.head-dim": lambda: adapter(settings())(*qkv(d=0)),
    "B34.head-dims": lambda: adapter(settings())(*qkv()[:2], qkv(d=16)[2]),
    "B34.bias-type": lambda: adapter(settings())(*qkv(), bias=torch.zeros(16, 16, dtype=torch.int32)),
    "B34.bias-kernel": lambda: adapter(turbo())(*qkv(), causal=True, bias=torch.zeros(2, 4, 16, 16,
                                                                                       dtype=torch.float64)),
    "B34.bias-shape": lambda: adapter(settings())(*qkv(), bias=torch.zeros(3, 5, dtype=torch.float64)),
    "B34.sink-type": lambda: adapter(settings(use_sink_attention=True))(*qkv(), sink=torch.zeros(4).int()),
    "B34.sink-shape": lambda: adapter(settings(use_sink_attention=True))(*qkv(), sink=torch.zeros(3)),
    "B34.alibi-type": lambda: adapter(settings())(*qkv(), alibi_slopes=[0.5] * 4),
    "B34.alibi-shape": lambda: adapter(settings())(*qkv(), alibi_slopes=torch.zeros(3)),
    "B34.alibi-dtype": lambda: adapter(turbo())(*qkv(), causal=True, alibi_slopes=slopes().double()),
    "B35.right": lambda: adapter(turbo(), facts(**FULL))(*qkv(dtype=BF16), causal=False, alibi_slopes=slopes()),
    "B35.lengths": lambda: adapter(turbo(**SYMMETRIC), facts(**FULL))(*qkv(dtype=torch.float32, skv=12)),
    "B35.lse": lambda: adapter(turbo())(*qkv(dtype=BF16), causal=True, return_lse=True, alibi_slopes=slopes()),
    "B34.packed-call": lambda: varlen(adapter(settings(), facts(packed=False))),
    "B34.dense-call": lambda: adapter(settings(), facts(packed=True))(*qkv()),
    "B25.dense-call": lambda: adapter(settings(reset_attention_mask=True), facts(packed=True))(*qkv()),
    "B34.dropout": lambda: adapter(settings())(*qkv(), dropout_p=1.5),
    # torch's FlexAttention (`primus_ext.backends.flex`)
    "B34.flex": lambda: adapter(settings(turbo_flex_attention_backend="flex"))(*qkv(), dropout_p=0.1),
    "B34.flex-trace": lambda: _untraceable_on_flex(),
    "B34.flex-cpu-grad": lambda: adapter(settings(turbo_flex_attention_backend="flex"))(*qkv(grad=True)),
    "B34.flex-learned": lambda: _learned_after_build(),
    "B34.hook-raised": lambda: adapter(settings(turbo_flex_attention_backend="reference",
                                                turbo_flex_attention_mask_mod="tests.flex_hooks:document_ids"),
                                       facts(seq_length=48))(*qkv(s=64)),  # a call longer than the 48 ids it reads
    "B34.learned-compile": lambda: _traced(adapter(settings(
        turbo_flex_attention_backend="reference", turbo_flex_attention_score_mod="tests.flex_hooks:relative_bias")),
        lambda run, q, k, v: run(q, k, v), *qkv()),
    "B34.scale": lambda: adapter(settings())(*qkv(), softmax_scale="0.3"),
    "B34.window": lambda: adapter(settings(), drop_in=True)(*qkv(), causal=True, window_size=(2.5, 0)),
    "B34.window-bound": lambda: adapter(settings(), drop_in=True)(*qkv(), causal=True, window_size=(-2, 0)),
    "B34.cu-type": lambda: varlen(adapter(settings()), bounds=[0, 4, 11]),
    "B34.cu-shape": lambda: varlen(adapter(settings()), bounds=cu(0, 4, 11)[None]),
    "B34.cu-dtype": lambda: varlen(adapter(settings()), bounds=cu(0, 4, 11).float()),
    "B34.cu-device": lambda: varlen(adapter(settings()), bounds=cu(0, 4, 11).to("meta")),
    "B34.max-seqlen-traced": lambda: _traced(  # without fullgraph, as tests/compile/test_compiled_step.py
        adapter(settings(), facts(packed=True)), lambda run, q, k, v: run.varlen(
            q, k, v, cu(0, 4, 11), cu(0, 4, 11), torch.tensor(7), torch.tensor(7)), *packed_qkv(11), fullgraph=False),
    "B34.max-seqlen-tensor": lambda: varlen(adapter(settings()), longest=torch.tensor(7.0)),
    "B34.max-seqlen": lambda: varlen(adapter(settings()), longest=0),
    "B34.shared-boundaries": lambda: varlen(adapter(settings()), q=packed_qkv(12)[0], bounds=cu(0, 4, 12)),
    "B34.document-count": lambda: adapter(settings()).varlen(*packed_qkv(11), cu(0, 4, 11), cu(0, 2, 4, 11), 7, 7),
    "B36.max-tensor": lambda: _equal_documents(torch.tensor(32), 0, 32, 64),
    "B36.unequal": lambda: _equal_documents(24, 0, 16, 40, 64),
    "B34.boundaries": lambda: varlen(adapter(settings()), bounds=cu(2, 4, 11)),
    # whose causal / window_size a call runs
    "B34.drop-in": lambda: adapter(settings(), drop_in="yes"),
    "B11": lambda: adapter(settings(**DOCUMENTS))(*qkv(), causal=True),
    "B34.call-flags": lambda: adapter(settings())(*qkv(), causal=False),
    "B34.causal": lambda: adapter(settings())(*qkv(), causal=torch.tensor([True, False])),
    "B34.traced-flags": lambda: _traced(adapter(settings(), drop_in=True), lambda run, q, k, v: run(
        q, k, v, causal=torch.tensor(True)), *qkv()),
    # each turbo call's kernel route
    "B34.layout": lambda: adapter(turbo())(qkv()[0].transpose(0, 1).contiguous().transpose(0, 1), *qkv()[1:],
                                           causal=True),
    "B33": lambda: _route_refused(),  # on gfx942 (ARCHES)
    # Primus-Turbo's fixed kernels
    "B17.documents-bias": lambda: adapter(turbo(**DOCUMENTS))(*qkv(), bias=torch.zeros(16, 16, dtype=torch.float64)),
    "B34.document-alignment": lambda: adapter(turbo()).varlen(*packed_qkv(11), cu(0, 4, 11), cu(0, 5, 11), 7, 7,
                                                              causal=True),
    # what Megatron hands core attention
    "B34.qkv-format": lambda: megatron()(*sbhd(), None, packed_seq_params=PackedSeqParams(qkv_format="bhsd")),
    "B34.mask-object": lambda: megatron()(*sbhd(), [[True]]),
    "B34.mask-on-layer": lambda: megatron("flex-reference", AttnMaskType.no_mask)(*sbhd(), causal_mask(1, 16, 16)
                                                                                  [None, None]),
    "B34.mask-shape": lambda: megatron()(*sbhd(), causal_mask(1, 16, 16)[None, None].float()),
    "B34.mask-values": lambda: megatron()(*sbhd(), torch.zeros(2, 1, 16, 16, dtype=torch.bool)),
    # context parallelism (rank 0 of 2)
    "cp-packed": lambda: cp_layer()(*thd(), None, packed_seq_params=thd_params()),
    "B34.cp-mask-on-layer": lambda: cp_layer(AttnMaskType.no_mask)(*sbhd(), causal_mask(1, 16, 32)[None, None]),
    "B34.cp-mask-shape": lambda: cp_layer()(*sbhd(), causal_mask(1, 16, 16)[None, None]),
    "B34.cp-mask-values": lambda: cp_layer()(*sbhd(), torch.zeros(2, 1, 16, 32, dtype=torch.bool)),
    "B22": lambda: cp_layer()(*sbhd(s=7), None),
    # an accepting rank of two, after rank 0 refused (the multi-process case: tests/megatron/test_rank_agreement.py)
    "B34.rank": lambda: other_rank_refused(),
    "B30.rng": lambda: tracker_reset_since_build(),
    "B30.compiled": lambda: compiled_dropout_at_tp2(),
    # reset_attention_mask on dense batches: the documents read from Megatron's mask
    "B25.no-mask": lambda: megatron(keys=RESET)(*sbhd(), None),
    "B25.mask-shape": lambda: megatron(keys=RESET)(*sbhd(), causal_mask(1, 16, 16)[None, None].float()),
    "B25.mask-values": lambda: megatron(keys=RESET)(*sbhd(), torch.zeros(2, 1, 16, 16, dtype=torch.bool)),
    "B25.max-documents-mask": lambda: megatron(keys=dict(RESET, reset_attention_mask_max_documents=1))(
        *sbhd(), causal_mask(1, 16, 16)[None, None]),
    # EOD documents as packed micro-batches
    "B25.tokens": lambda: pack_eod_micro_batch(torch.zeros(2, 16), eod_token=0, max_documents=4),
    "B25.max-documents": lambda: pack_eod_micro_batch(_eod_tokens(4), eod_token=0, max_documents=1),
    "B25.too-many-documents": lambda: pack_eod_micro_batch(_eod_tokens(4), eod_token=0, max_documents=4),
    # shared-prefix rows (B37)
    "shared-prefix.layout": lambda: SharedPrefixLayout.of([(4, 3)]),
    "shared-prefix.tokens": lambda: shared_prefix_attention(
        adapter(settings(packed_shared_prefix=True), facts(packed=True)), *packed_qkv(11),
        SharedPrefixLayout.of([(4, [3])])),
    "shared-prefix.positions": lambda: _unprepared_shared_row(),
    "shared-prefix.boundaries": lambda: _unprepared_shared_row(given=True),
    "shared-prefix.changed": lambda: _changed_layout(),
    "shared-prefix.position-ids": lambda: _other_position_ids(),
    "shared-prefix.call": lambda: shared_prefix_attention(adapter(settings(), facts(packed=True)), *packed_qkv(7),
                                                          SharedPrefixLayout.of([(4, [3])])),
}


def _equal_documents(longest: Any, *bounds: int):
    """A packed call on a layer declared ``packed_equal_documents`` (FlyDSL's shape on gfx950, B36)."""
    q, k, v = (t.to(BF16) for t in packed_qkv(64, 8, 1, 64))
    layer = dict(num_heads=8, num_kv_heads=1, head_dim=64, seq_length=64, dtype="bf16", packed=True)
    run = TurboFlexAttention(build_plan(turbo(turbo_arch="gfx950", use_sink_attention=True,
                                              packed_equal_documents=True), facts(**layer)))
    cu_seqlens = cu(*bounds)
    run.varlen(q, k, v, cu_seqlens, cu_seqlens, longest, longest, causal=True, sink=torch.zeros(8))


def _route_refused():
    """A sink layer on gfx942 called with a two-sided window (drop-in): AITER's sink backward drops the right
    bound, so the dispatch model refuses the call."""
    q, k, v = (t.bfloat16() for t in qkv(d=16))
    plan = build_plan(turbo(turbo_arch="gfx942", use_sink_attention=True), facts(head_dim=16, dtype="bf16",
                                                                              packed=False))
    TurboFlexAttention(plan, drop_in=True)(q, k, v, causal=False, window_size=(4, 4), sink=torch.zeros(4))


ARCHES = {"B33": "gfx942", "B36.max-tensor": "gfx950", "B36.unequal": "gfx950"}
"""The device the fake presents for triggers that need a known arch (else none: the arch is unknown)."""


def _unprepared_shared_row(given: bool = False) -> None:
    """A shared-prefix row's params that no prepared model marked (``given``: marked, with boundaries of its own),
    at a Megatron layer planned for them."""
    from primus_ext.megatron import pack_shared_prefix

    batch = pack_shared_prefix([(torch.arange(4), [torch.arange(3)])])
    layer = megatron("flex-reference", keys=dict(packed_sequences=True, packed_shared_prefix=True))
    if given:  # as a prepared model marks the row and its layers, but boundaries that are not the layout's
        params = batch.packed_seq_params
        params.positions_given = layer.core.shared_prefix_mark = 1
        params.cu_seqlens_q = params.cu_seqlens_kv = cu(0, 7)
    q, k, v = packed_qkv(7, d=16)
    layer(q, k, v, None, packed_seq_params=batch.packed_seq_params)


def _other_position_ids() -> None:
    """A prepared GPT's forward of a shared-prefix row given position_ids that are not the row's own."""
    from primus_ext.megatron import pack_shared_prefix, prepare_shared_prefix

    model = prepare_shared_prefix(gpt.build_gpt(gpt.settings(
        use_turbo_flex_attention=True, turbo_flex_attention_backend="reference", packed_sequences=True,
        packed_shared_prefix=True)))
    batch = pack_shared_prefix([(torch.arange(4), [torch.arange(3)])])
    model(batch.tokens, batch.position_ids.clone(), None, packed_seq_params=batch.packed_seq_params)


def _changed_layout() -> None:
    """A shared-prefix layout refilled between its row's forward and backward."""
    layout = SharedPrefixLayout.of([(4, [3]), (2, [1])])
    q, k, v = (t.requires_grad_(True) for t in packed_qkv(10))
    out = shared_prefix_attention(adapter(settings(packed_shared_prefix=True), facts(packed=True)), q, k, v, layout)
    layout.cu_cross_kv[1] = 3
    out.sum().backward()


def other_rank_refused() -> None:
    from primus_ext.megatron.rank_agreement import RankAgreement, _Checks

    agreement = RankAgreement(None)
    agreement.size, agreement.rank = 2, 1
    agreement._raise(_Checks(), [3, 0])


def tracker_reset_since_build() -> None:
    from primus_ext.megatron.dropout_rng import LayerDropoutRng

    with LayerDropoutRng(2, 0, 1).drawing(0.1, torch.device("cpu")):  # no tracker is seeded in this process
        pass


def compiled_dropout_at_tp2() -> None:
    from primus_ext.megatron.dropout_rng import LayerDropoutRng

    def step(x):
        with LayerDropoutRng(2, 0, 1).drawing(0.1, x.device):
            return x + 1

    torch._dynamo.reset()
    torch.compile(step, fullgraph=True, backend="eager")(torch.zeros(2))


def documented_call_codes() -> set[str]:
    text = DOCS.read_text().split("## Refused at call time")[1].split("\n## ")[0]
    return set(re.findall(r"^\| `([\w.-]+)` \|", text, flags=re.M))


def test_every_rule_has_a_trigger():
    assert set(TRIGGERS) == set(CALL_RULES), (sorted(set(CALL_RULES) - set(TRIGGERS)),
                                              sorted(set(TRIGGERS) - set(CALL_RULES)))


@pytest.mark.parametrize("code", sorted(TRIGGERS))
def test_each_rule_is_raised_with_its_code_and_documented(code):
    with fake_primus_turbo(**({"arch": ARCHES[code]} if code in ARCHES else {})):
        with pytest.raises(UnsupportedInputError) as err:
            TRIGGERS[code]()
    assert code in err.value.codes, (code, err.value.codes, str(err.value))
    assert code in documented_call_codes()
