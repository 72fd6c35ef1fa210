"""Every configuration the Turbo attention modules cannot run exactly is refused at build time.

Each build-time case is checked twice: once by building a whole megatron-core
``GPTModel`` (the error has to survive megatron's ``build_module``, which re-raises
every construction error as ``type(e)(f"{e} when instantiating ...")``), and once by
constructing `PrimusTurboLocalAttention` directly with Megatron's core-attention
keywords.  Either way the error is raised by a constructor, so no forward ever ran.
Call-time refusals (what only the batch knows) go through the module's forward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import pytest
import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType

from primus_ext.errors import UnsupportedConfigError, UnsupportedInputError
from primus_ext.megatron import PrimusTurboLocalAttention, get_gpt_layer_primus_turbo_local_spec
from primus_ext.settings import TurboAttentionSettings
from primus_ext.testing.fake_turbo import fake_primus_turbo
from tests import oracle
from tests.megatron import gpt

FLEX = dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="reference")
PREFIX_HOOK = dict(turbo_flex_attention_mask_mod="primus_ext.attention.masks:prefix_lm",
                   turbo_flex_attention_mask_mod_kwargs={"prefix_length": 4})


def alibi_config(**overrides: Any):
    cfg = gpt.config(**overrides)
    cfg.position_embedding_type = "alibi"  # TransformerConfig has no such field; GPTModel reads it if set
    return cfg


@dataclass(frozen=True)
class Case:
    """One refused configuration and what the error must name."""

    id: str
    keys: dict
    settings_named: tuple[str, ...]
    words: tuple[str, ...] = ()
    config: Callable[[], Any] = gpt.config
    fake: bool = False  # the direct path needs (the fake) Primus-Turbo to get as far as its own rules
    mask_type: AttnMaskType = AttnMaskType.causal
    raw_settings: bool = field(default=False)  # keys as given, without use_turbo_attention added

    def settings(self) -> TurboAttentionSettings:
        if self.raw_settings:
            return TurboAttentionSettings.from_dict(self.keys)
        return gpt.settings(**self.keys)


CASES = [
    Case("B30-rng-flex", FLEX, ("attention_dropout", "context_parallel_size"),
         ("context_parallel_size=2",), config=lambda: gpt.config(context_parallel_size=2, attention_dropout=0.1)),
    Case("B23-fp8-flex", {**FLEX, "enable_turbo_attention_float8": True},
         ("use_turbo_flex_attention", "enable_turbo_attention_float8"), ("fp8",)),
    Case("B25-reset-mask-hook-flex", {**FLEX, "reset_attention_mask": True,
                                      "turbo_flex_attention_mask_mod": "primus_ext.attention.masks:causal",
                                      "turbo_flex_attention_mask_mod_kwargs": {}},
         ("reset_attention_mask",), ("varlen",)),
    Case("B25-reset-mask-direct-fp8", {"reset_attention_mask": True, "enable_turbo_attention_float8": True},
         ("reset_attention_mask",), ("no packed (varlen) entry",), fake=True),
    Case("B27-alibi-flex", FLEX, ("position_embedding_type",), ("ALiBi",), config=alibi_config),
    Case("B27-alibi-direct", {}, ("position_embedding_type",), ("ALiBi",), config=alibi_config, fake=True),
    Case("B3-flex-without-turbo", {"use_turbo_flex_attention": True, "turbo_flex_attention_backend": "reference"},
         ("use_turbo_flex_attention", "use_turbo_attention"), ("use_turbo_attention is false",), raw_settings=True),
    Case("B10-two-windows", {**FLEX, "sink_sliding_window": 4}, ("window_size", "sink_sliding_window"),
         ("two sources",), config=lambda: gpt.config(window_size=(4, 0))),
    Case("B10-two-windows-direct", {"sink_sliding_window": 4}, ("window_size", "sink_sliding_window"),
         ("two sources",), config=lambda: gpt.config(window_size=(4, 0)), fake=True),
    Case("skip-freq-window", {**FLEX, "sink_sliding_window": 4},
         ("window_attn_skip_freq", "window_size", "sink_sliding_window"), ("would be ignored",),
         config=lambda: gpt.config(window_attn_skip_freq=2)),
    Case("B10-sink", {**FLEX, "use_sink_attention": True}, ("use_sink_attention", "softmax_type"),
         ("two sources for one sink",), config=lambda: gpt.config(softmax_type="off-by-one")),
    Case("B11-hook-and-sink-window", {**FLEX, **PREFIX_HOOK, "sink_sliding_window": 4},
         ("turbo_flex_attention_mask_mod", "sink_sliding_window"), ("prefix_lm", "(4, 0)")),
    Case("B11-hook-and-config-window", {**FLEX, **PREFIX_HOOK}, ("turbo_flex_attention_mask_mod", "window_size"),
         ("prefix_lm", "(6, 0)"), config=lambda: gpt.config(window_size=(6, 0))),
    Case("B9-fp8-config-window", {"enable_turbo_attention_float8": True},
         ("enable_turbo_attention_float8", "window_size"), ("(-1, -1)", "(4, 0)"),
         config=lambda: gpt.config(window_size=(4, 0)), fake=True),
    Case("B9-fp8-sink-window", {"enable_turbo_attention_float8": True, "sink_sliding_window": 8},
         ("enable_turbo_attention_float8", "sink_sliding_window"), ("(8, 0)",), fake=True),
    Case("B13-sink-fp8-direct", {"enable_turbo_attention_float8": True, "use_sink_attention": True},
         ("use_sink_attention",), ("flash_attn_fp8_func", "sink"), fake=True),
    Case("B13-megatron-learnable-softmax-fp8", {"enable_turbo_attention_float8": True},
         ("use_sink_attention",), ("flash_attn_fp8_func",), config=lambda: gpt.config(softmax_type="learnable"),
         fake=True),
    Case("padding-mask-flex", FLEX, ("attn_mask_type",), ("padding",), mask_type=AttnMaskType.padding),
    Case("padding-mask-direct", {}, ("attn_mask_type",), ("padding",), mask_type=AttnMaskType.padding, fake=True),
]


def maybe_fake(on: bool):
    return fake_primus_turbo() if on else contextlib.nullcontext()


def local(settings: TurboAttentionSettings, cfg: Any = None, *, layer_number: int = 1,
          mask_type: AttnMaskType = AttnMaskType.causal) -> PrimusTurboLocalAttention:
    """The module exactly as Megatron's SelfAttention builds it (keywords, spec-bound settings)."""
    return PrimusTurboLocalAttention(config=cfg or gpt.config(), layer_number=layer_number,
                                     attn_mask_type=mask_type, attention_type="self", settings=settings)


def build_gpt(settings: TurboAttentionSettings, cfg: Any, mask_type: AttnMaskType = AttnMaskType.causal) -> GPTModel:
    spec = get_gpt_layer_primus_turbo_local_spec(settings)
    spec.submodules.self_attention.params["attn_mask_type"] = mask_type
    torch.manual_seed(0)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=gpt.VOCAB,
                    max_sequence_length=gpt.SEQ * 4, position_embedding_type="learned_absolute")


def assert_names(err: Exception, case: Case) -> None:
    assert isinstance(err, UnsupportedConfigError)
    for key in case.settings_named:
        assert key in err.settings, (key, err.settings)
        assert key in str(err)
    for word in case.words:
        assert word in str(err), (word, str(err))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_refused_when_gpt_model_is_built(case: Case):
    with maybe_fake(case.fake) as fake:
        with pytest.raises(UnsupportedConfigError) as info:
            build_gpt(case.settings(), case.config(), case.mask_type)
        if fake is not None:
            assert fake.calls == []  # nothing reached a kernel: the refusal came before any forward
    assert_names(info.value, case)
    assert "when instantiating" in str(info.value)  # it did travel through megatron's build_module
    assert str(info.value).count("primus_ext cannot build this attention") == 1


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_refused_when_core_attention_is_built(case: Case):
    with maybe_fake(case.fake):
        with pytest.raises(UnsupportedConfigError) as info:
            local(case.settings(), case.config(), mask_type=case.mask_type)
    assert_names(info.value, case)


def test_sink_window_on_even_layers_only_is_refused_per_layer():
    """B9 with sink_window_even_layers_only: layer 1 has the window (refused), layer 2 has none (built)."""
    keys = dict(enable_turbo_attention_float8=True, sink_sliding_window=8, sink_window_even_layers_only=True)
    with fake_primus_turbo():
        with pytest.raises(UnsupportedConfigError, match="layer 1"):
            local(gpt.settings(**keys), gpt.fp8_config(), layer_number=1)
        assert local(gpt.settings(**keys), gpt.fp8_config(), layer_number=2).plan.dense_entry == "flash_attn_fp8_func"


def test_several_refusals_give_one_error_listing_every_reason():
    keys = {**FLEX, "enable_turbo_attention_float8": True, "reset_attention_mask": True}
    expected = {"context_parallel_size", "enable_turbo_attention_float8", "reset_attention_mask",
                "position_embedding_type"}
    with pytest.raises(UnsupportedConfigError) as direct:
        local(gpt.settings(**keys), alibi_config(context_parallel_size=2, attention_dropout=0.1))
    assert len(direct.value.reasons) == 4
    assert expected <= set(direct.value.settings)
    assert "4 reasons" in str(direct.value)

    with pytest.raises(UnsupportedConfigError) as model:
        build_gpt(gpt.settings(**keys), alibi_config(context_parallel_size=2, attention_dropout=0.1))
    assert [r.render() for r in model.value.reasons] == [r.render() for r in direct.value.reasons]
    message = str(model.value)
    assert "4 reasons" in message and all(f"  {i}. [" in message for i in range(1, 5))


# ------------------------------------------------------------------------- call time
def qkv_sbhd(s: int = 16, b: int = 2, hq: int = 4, hkv: int = 2, d: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(s, b, hq, d, generator=gen), torch.randn(s, b, hkv, d, generator=gen),
            torch.randn(s, b, hkv, d, generator=gen))


def qkv_thd(t: int = 12, hq: int = 4, hkv: int = 2, d: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(t, hq, d, generator=gen), torch.randn(t, hkv, d, generator=gen),
            torch.randn(t, hkv, d, generator=gen))


def thd_params(bounds=(0, 5, 12), padded: Optional[tuple] = None, fmt: Optional[str] = "thd") -> PackedSeqParams:
    cu = torch.tensor(bounds, dtype=torch.int32)
    pad = torch.tensor(padded, dtype=torch.int32) if padded is not None else None
    longest = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(qkv_format=fmt, cu_seqlens_q=cu, cu_seqlens_kv=cu.clone(), cu_seqlens_q_padded=pad,
                           cu_seqlens_kv_padded=pad, max_seqlen_q=longest, max_seqlen_kv=longest)


PATHS = {"flex": (FLEX, False), "direct": ({}, True)}


@pytest.mark.parametrize("path", PATHS)
def test_attention_bias_is_refused_at_call_time_naming_alibi(path):
    keys, fake = PATHS[path]
    with maybe_fake(fake):
        module = local(gpt.settings(**keys))
        q, k, v = qkv_sbhd()
        with pytest.raises(UnsupportedInputError) as info:
            module(q, k, v, None, AttnMaskType.causal, attention_bias=torch.zeros(1, 4, 16, 16))
    assert {"position_embedding_type", "attention_bias"} <= set(info.value.settings)
    assert "ALiBi" in str(info.value)


@pytest.mark.parametrize("path", PATHS)
def test_cu_seqlens_with_sbhd_format_is_refused(path):
    """B21: boundaries present but qkv_format='sbhd' would silently attend across documents."""
    keys, fake = PATHS[path]
    with maybe_fake(fake) as turbo:
        module = local(gpt.settings(**keys))
        q, k, v = qkv_sbhd()
        with pytest.raises(UnsupportedInputError) as info:
            module(q, k, v, None, packed_seq_params=thd_params(bounds=(0, 10, 32), fmt="sbhd"))
        if turbo is not None:
            assert turbo.calls == []
    assert info.value.settings == ("packed_seq_params",)
    assert "qkv_format='sbhd'" in str(info.value) and "cu_seqlens" in str(info.value)


@pytest.mark.parametrize("path", PATHS)
def test_padded_cu_seqlens_that_differ_are_refused(path):
    """B19: the kernel takes one pair of boundaries; padding would be attended as tokens."""
    keys, fake = PATHS[path]
    with maybe_fake(fake):
        module = local(gpt.settings(**keys))
        q, k, v = qkv_thd()
        with pytest.raises(UnsupportedInputError) as info:
            module(q, k, v, None, packed_seq_params=thd_params(padded=(0, 6, 12)))
        assert "cu_seqlens_q_padded" in info.value.settings
        # Padded boundaries equal to the plain ones are fine, and give the per-document result.
        out = module(q, k, v, None, packed_seq_params=thd_params(padded=(0, 5, 12)))
    want = oracle.packed_attention(q, k, v, [0, 5, 12])
    assert out.shape == (12, 4 * 16)
    torch.testing.assert_close(out.double(), want.reshape(12, -1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("params", [thd_params(), PackedSeqParams()], ids=["thd", "empty-but-present"])
def test_packed_params_on_a_path_without_a_packed_kernel_are_refused(params):
    """Direct fp8 has no varlen entry: packed params (even empty ones, B21) are refused, not ignored."""
    with fake_primus_turbo() as fake:
        module = local(gpt.settings(enable_turbo_attention_float8=True), gpt.fp8_config())
        assert module.plan.packed_entry is None
        q, k, v = gpt.fp8_tensors(*(qkv_thd() if params.qkv_format == "thd" else qkv_sbhd()))
        with pytest.raises(UnsupportedInputError) as info:
            module(q, k, v, None, packed_seq_params=params)
        assert fake.calls == []
    assert "packed_seq_params" in info.value.settings
    assert "flash_attn_fp8_func" in str(info.value)


@pytest.mark.parametrize("path", PATHS)
def test_plain_dense_call_is_unchanged(path):
    """B29: a compliant module given an ordinary dense call computes causal attention, nothing else."""
    keys, fake = PATHS[path]
    with maybe_fake(fake) as turbo:
        module = local(gpt.settings(**keys))
        q, k, v = qkv_sbhd()
        out = module(q, k, v, None, AttnMaskType.causal, attention_bias=None, packed_seq_params=None)
        if turbo is not None:
            (call,) = turbo.calls_to("flash_attn_func")
            assert call.args["causal"] is True and call.args["window_size"] == (-1, -1)
            assert call.args["dropout_p"] == 0.0 and call.args["sink"] is None
    want = oracle.attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), oracle.causal())
    assert out.shape == (16, 2, 4 * 16)
    torch.testing.assert_close(out.double(), want.transpose(0, 1).reshape(16, 2, -1), atol=1e-5, rtol=1e-5)


def test_the_module_yaml_as_the_readme_uses_it_leaves_megatrons_own_attention():
    """configs/modules/megatron/primus_ext_attention.yaml has use_turbo_attention: false: the spec keeps
    megatron-core's DotProductAttention instead of building (and refusing) a Turbo layer."""
    from pathlib import Path

    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from primus_ext.megatron import get_gpt_layer_primus_turbo_local_spec
    from primus_ext.settings import TurboAttentionSettings

    path = Path(__file__).resolve().parents[2] / "configs" / "modules" / "megatron" / "primus_ext_attention.yaml"
    settings = TurboAttentionSettings.from_yaml(path)
    spec = get_gpt_layer_primus_turbo_local_spec(settings)
    assert spec.submodules.self_attention.submodules.core_attention is DotProductAttention
    on = get_gpt_layer_primus_turbo_local_spec(settings.replace(use_turbo_attention=True))
    assert on.submodules.self_attention.submodules.core_attention.func is PrimusTurboLocalAttention
