"""No degenerate shape escapes as a foreign exception (B34): batch 0, sequence 0, head dim 0, tensors of a
rank other than thd's 3 / bshd's 4, value head dims other than the plan's, with and without a sink,
``return_lse`` and dropout, on every backend and entry (``__call__``, ``varlen``, the Megatron module, eager
and compiled).  Each is our error naming the argument, or the result the ``reference`` backend gives (an empty
output, still in the autograd graph)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType

from primus_ext.errors import PrimusExtError, UnsupportedInputError
from primus_ext.megatron import PrimusTurboLocalAttention
from primus_ext.testing import fake_primus_turbo

from .helpers import adapter, facts, settings
from .megatron import gpt

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

BACKENDS = ["reference", "flex", "turbo-gfx942", "turbo-gfx950"]
DENSE = {
    "batch0": ((0, 16, 4, 8), (0, 16, 2, 8), (0, 16, 2, 8)),
    "seq0": ((2, 0, 4, 8), (2, 0, 2, 8), (2, 0, 2, 8)),
    "head-dim0": ((2, 16, 4, 0), (2, 16, 2, 0), (2, 16, 2, 0)),
    "v-head-dim0": ((2, 16, 4, 8), (2, 16, 2, 8), (2, 16, 2, 0)),
    "v-head-dim16": ((2, 16, 4, 8), (2, 16, 2, 8), (2, 16, 2, 16)),
    "q-head-dim16": ((2, 16, 4, 16), (2, 16, 2, 16), (2, 16, 2, 8)),
    "rank0": ((), (), ()),
    "rank1": ((8,), (8,), (8,)),
    "rank2": ((4, 8), (2, 8), (2, 8)),
    "rank3": ((16, 4, 8), (16, 2, 8), (16, 2, 8)),
    "rank5": ((1, 2, 16, 4, 8), (1, 2, 16, 2, 8), (1, 2, 16, 2, 8)),
    "heads0": ((2, 16, 0, 8), (2, 16, 0, 8), (2, 16, 0, 8)),
}
PACKED = {
    "tokens0": ((0, 4, 8), (0, 2, 8), (0, 2, 8), [0, 0]),
    "tokens0-one-boundary": ((0, 4, 8), (0, 2, 8), (0, 2, 8), [0]),
    "head-dim0": ((16, 4, 0), (16, 2, 0), (16, 2, 0), [0, 16]),
    "v-head-dim16": ((16, 4, 8), (16, 2, 8), (16, 2, 16), [0, 16]),
    "v-head-dim0": ((16, 4, 8), (16, 2, 8), (16, 2, 0), [0, 16]),
    "rank4": ((1, 16, 4, 8), (1, 16, 2, 8), (1, 16, 2, 8), [0, 16]),
    "rank2": ((16, 8), (16, 8), (16, 8), [0, 16]),
    "rank0": ((), (), (), [0, 16]),
    "empty-document": ((16, 4, 8), (16, 2, 8), (16, 2, 8), [0, 0, 16]),
}
EXTRAS = {"plain": {}, "sink": {"sink": True}, "lse": {"return_lse": True}, "dropout": {"dropout_p": 0.1},
          "sink-lse": {"sink": True, "return_lse": True}}


def _installed(backend: str):
    arch = backend.partition("-")[2]
    return fake_primus_turbo(arch=arch) if arch else contextlib.nullcontext()


def _layer(backend: str, extra: dict, packed: bool = False):
    name, _, arch = backend.partition("-")
    keys = dict(turbo_flex_attention_backend=name, use_sink_attention=bool(extra.get("sink")))
    if arch:
        keys["turbo_arch"] = arch
    return adapter(settings(**keys), facts(dtype="bf16" if arch else "fp32", packed=packed,
                                           attention_dropout=0.1 if "dropout_p" in extra else 0.0))


def _tensors(shapes, backend: str, grad: bool):
    dtype = torch.bfloat16 if backend.startswith("turbo") else torch.float32
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_(grad) for s in shapes]


def _outcome(fn):
    """``("ours", codes)`` for our error, ``("ran", result)`` for a result; any other exception fails."""
    try:
        return "ran", fn()
    except PrimusExtError as err:
        assert err.settings, f"our error names no argument: {err}"
        return "ours", err.codes


def _same(got, want, values: bool = True) -> None:
    """The reference's shapes, and its values (not for dropout, which draws its own keep mask)."""
    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape, (g.shape, w.shape)
        if values or g.numel() == 0:
            torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)


def _call(layer, tensors, extra, cu=None):
    kw = {k: v for k, v in extra.items() if k != "sink"}
    if extra.get("sink"):
        kw["sink"] = torch.zeros(4)
    if cu is None:
        return layer(*tensors, **kw)
    bounds = torch.tensor(cu, dtype=torch.int32)
    return layer.varlen(*tensors, bounds, bounds, None, None, **kw)


@pytest.mark.parametrize("extra", list(EXTRAS))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", list(DENSE))
def test_a_degenerate_dense_call_is_our_error_or_the_references_result(shape, backend, extra):
    with _installed(backend):
        kind, layer = _outcome(lambda: _layer(backend, EXTRAS[extra]))
        if kind == "ours":  # refused at build (a sink layer no kernel takes there): ours
            return
        tensors = _tensors(DENSE[shape], backend, grad=False)
        kind, got = _outcome(lambda: _call(layer, tensors, EXTRAS[extra]))
    if kind == "ran":
        want = _call(_layer("reference", EXTRAS[extra]), [t.float() for t in tensors], EXTRAS[extra])
        _same(got, want, values="dropout_p" not in EXTRAS[extra])


@pytest.mark.parametrize("extra", list(EXTRAS))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", list(PACKED))
def test_a_degenerate_packed_call_is_our_error_or_the_references_result(shape, backend, extra):
    *shapes, cu = PACKED[shape]
    with _installed(backend):
        kind, layer = _outcome(lambda: _layer(backend, EXTRAS[extra], packed=True))
        if kind == "ours":
            return
        tensors = _tensors(shapes, backend, grad=False)
        kind, got = _outcome(lambda: _call(layer, tensors, EXTRAS[extra], cu))
    if kind == "ran":
        want = _call(_layer("reference", EXTRAS[extra], packed=True), [t.float() for t in tensors], EXTRAS[extra], cu)
        _same(got, want, values="dropout_p" not in EXTRAS[extra])


@pytest.mark.parametrize("backend", ["reference", "turbo-gfx942"])
def test_an_empty_batch_stays_in_the_autograd_graph(backend):
    with _installed(backend):
        layer = _layer(backend, {"sink": True})
        q, k, v = _tensors(DENSE["batch0"], backend, grad=True)
        sink = torch.zeros(4, requires_grad=True)
        out = layer(q, k, v, sink=sink)
        out.sum().backward()
    assert out.shape == (0, 16, 4, 8)
    assert q.grad.shape == q.shape and float(k.grad.abs().sum()) == 0.0 and float(sink.grad.abs().sum()) == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_empty_batch_compiles(backend):
    with _installed(backend):
        layer = _layer(backend, {})
        tensors = _tensors(DENSE["batch0"], backend, grad=False)
        torch._dynamo.reset()
        out = torch.compile(lambda q, k, v: layer(q, k, v), fullgraph=True, backend="aot_eager")(*tensors)
    assert out.shape == (0, 16, 4, 8)


def test_another_value_head_dim_on_a_sink_layer_is_our_error_not_the_kernels():
    """Regression: the same shape is refused at build; a call bringing it reached the fake's upstream
    ValueError."""
    with fake_primus_turbo(arch="gfx942"):
        layer = _layer("turbo-gfx942", {"sink": True})
        q, k, _ = _tensors(DENSE["batch0"], "turbo-gfx942", grad=False)
        q, k, v = _tensors(DENSE["v-head-dim16"], "turbo-gfx942", grad=False)
        with pytest.raises(UnsupportedInputError) as err:
            layer(q, k, v, sink=torch.zeros(4))
    assert err.value.codes == ("B34.head-dims",)


MEGATRON = {"direct": {}, "reference": dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="reference"),
            "turbo": dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="turbo"),
            "flex": dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="flex")}
SBHD = {"seq0": (0, 2), "batch0": (16, 0)}


@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("path", list(MEGATRON))
@pytest.mark.parametrize("shape", [*SBHD, "tokens0", "v-head-dim"])
def test_a_degenerate_megatron_call_is_our_error_or_empty(shape, path, sink):
    bf16 = path in ("direct", "turbo")  # Primus-Turbo's kernels take bf16 / fp16
    dtype = torch.bfloat16 if bf16 else torch.float32
    with fake_primus_turbo(arch="gfx942"):
        kind, module = _outcome(lambda: PrimusTurboLocalAttention(
            gpt.config(kv_channels=16, bf16=bf16, params_dtype=dtype), 1, AttnMaskType.causal, "self",
            settings=gpt.settings(use_sink_attention=sink, packed_sequences=shape == "tokens0", **MEGATRON[path])))
        if kind == "ours":
            return
        module.eval()
        params = None
        if shape in SBHD:
            s, b = SBHD[shape]
            q, k, v = (torch.randn(s, b, n, 16, dtype=dtype) for n in (4, 2, 2))
        elif shape == "tokens0":
            q, k, v = (torch.randn(0, n, 16, dtype=dtype) for n in (4, 2, 2))
            cu = torch.tensor([0, 0], dtype=torch.int32)
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=1,
                                     max_seqlen_kv=1)
        else:
            q, k, v = (torch.randn(16, 2, n, d, dtype=dtype) for n, d in ((4, 16), (2, 16), (2, 8)))
        with torch.no_grad():
            kind, got = _outcome(lambda: module(q, k, v, None, packed_seq_params=params))
    if kind == "ran":
        assert got.numel() == 0


@pytest.mark.parametrize("backend", ["reference", "flex", "turbo"])
@pytest.mark.parametrize("fact", [dict(num_heads=0), dict(num_kv_heads=0), dict(head_dim=0), dict(head_dim_v=0),
                                  dict(seq_length=0)])
def test_a_layer_of_no_head_or_head_dim_is_refused_at_build(backend, fact):
    """Regression: reference and flex built a plan for 0 heads or head dim 0."""
    from primus_ext.errors import UnsupportedConfigError
    from primus_ext.plan import build_plan

    with fake_primus_turbo(arch="gfx942"):
        with pytest.raises(UnsupportedConfigError) as err:
            build_plan(settings(turbo_flex_attention_backend=backend), facts(**fact))
    assert "layer-shape" in err.value.codes


# -- found by a hostile review of the crossings
@pytest.mark.parametrize("backend", BACKENDS)
def test_q_and_k_of_different_batch_sizes_are_our_error(backend):
    """Regression: torch's RuntimeError from SDPA (reference, turbo) or a hook refusal naming hooks the layer
    has not (flex)."""
    with _installed(backend):
        layer = _layer(backend, {})
        q, = _tensors([(2, 16, 4, 8)], backend, grad=False)
        k, v = _tensors([(3, 16, 2, 8), (3, 16, 2, 8)], backend, grad=False)
        with pytest.raises(UnsupportedInputError) as err:
            layer(q, k, v)
    assert err.value.codes == ("B34.qkv-shapes",)


@pytest.mark.parametrize("path", list(MEGATRON))
def test_a_megatron_call_of_two_batch_sizes_or_3d_without_packing_is_our_error(path):
    """Regression: the direct path read a 3-D query's strides as sbhd (ValueError), and q and k of two batch sizes
    reached SDPA."""
    bf16 = path in ("direct", "turbo")
    dtype = torch.bfloat16 if bf16 else torch.float32
    with fake_primus_turbo():
        module = PrimusTurboLocalAttention(gpt.config(kv_channels=16, bf16=bf16, params_dtype=dtype), 1,
                                           AttnMaskType.causal, "self", settings=gpt.settings(**MEGATRON[path]))
        module.eval()
        with torch.no_grad():
            for shapes, code in ((((16, 4, 16), (16, 2, 16), (16, 2, 16)), "B34.dense-rank"),
                                 (((16, 2, 4, 16), (16, 3, 2, 16), (16, 3, 2, 16)), "B34.qkv-shapes")):
                q, k, v = (torch.randn(s, dtype=dtype) for s in shapes)
                with pytest.raises(UnsupportedInputError) as err:
                    module(q, k, v, None)
                assert code in err.value.codes


@pytest.mark.parametrize("backend", ["reference", "flex", "turbo"])
@pytest.mark.parametrize("window", [(2 ** 31, 0), (2 ** 63, 0), (2 ** 64, 0)])
def test_a_layer_window_past_int32_is_refused_at_build(backend, window):
    """Regression: (2**63, 0) built and every key was masked; 2**64 raised OverflowError at the call."""
    from primus_ext.errors import UnsupportedConfigError
    from primus_ext.plan import build_plan

    with fake_primus_turbo():
        with pytest.raises(UnsupportedConfigError) as err:
            build_plan(settings(turbo_flex_attention_backend=backend), facts(window_size=window))
    assert "window-bound" in err.value.codes
