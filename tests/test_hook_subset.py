"""Issue-26 classes: hooks whose trace is not the function that runs.

Each hostile hook (`tests.hostile_hooks`) either builds and then equals an independent
float64 evaluation of the hook *as torch calls it* (``torch.vmap`` over 0-d index tensors,
from torch itself, not primus_ext), on ``reference`` and on ``turbo`` (the CPU fake), or
the build refuses it with our error naming the construct and its source line.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.nn.attention.flex_attention import _vmap_for_bhqkv, and_masks, or_masks

from primus_ext.hooks.proof import prove_mask, prove_score
from primus_ext.hooks.subset import outside_subset
from primus_ext.call.adapter import TurboFlexAttention
from primus_ext.errors import UnsupportedConfigError, UnsupportedInputError
from primus_ext.plan import build_plan
from primus_ext.testing import fake_primus_turbo

from . import hostile_hooks, oracle, review_hooks
from .helpers import facts, qkv, settings

HOOKS = "tests.hostile_hooks"
DYNAMIC = {  # hook -> the construct the refusal names
    "type_check": "the class torch.fx.Proxy", "try_item": "a try block", "compiling": "torch.compiler.is_compiling",
    "dunder_class": "the attribute .__class__", "environment": "os.environ", "clock": "a call of time.time",
    "rng": "random.randint", "stdlib": "a nested function or lambda", "class_alias": "the class Config",
    "object_attribute": "the value CONFIG", "nested": "a nested function or lambda",
}
NOT_PROVEN = {"uint8_wrap": "uint8 values that wrap", "int16_wrap": "int16 values that wrap",
              "cast_index": "torch.int32", "bf16_score": "bfloat16, which rounds", "fp16_score": "float16, which rounds"}
PROVEN = {"default_width", "int32_window", "fp64_score"}


def torch_mask(hook, batch: int, heads: int, s: int) -> torch.Tensor:
    """The hook's mask as torch computes it (create_block_mask's vmap), float64-independent of primus_ext."""
    grid = [torch.arange(n) for n in (batch, heads, s, s)]
    return _vmap_for_bhqkv(hook, prefix=())(*grid)


def torch_scores(hook, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    batch, s, hq, d = q.shape
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(hq // k.shape[2], 2)) / d ** 0.5
    grid = [torch.arange(n) for n in (batch, hq, s, s)]
    return _vmap_for_bhqkv(hook, prefix=(0,))(scores, *grid).double()  # float64 inputs: float64 scores


def expected_output(name: str, q, k, v) -> torch.Tensor:
    hook = getattr(hostile_hooks, name)
    if name in hostile_hooks.SCORES:
        table = torch_scores(hook, q, k)
        return oracle.attention(q, k, v, oracle.causal(), score_mod=lambda score, b, h, i, j: table[b, h, i, j])
    mask = torch_mask(hook, q.shape[0], q.shape[2], q.shape[1])
    return oracle.attention(q, k, v, lambda b, h, i, j: bool(mask[b, h, i, j]))


def config(name: str, backend: str):
    key = "turbo_flex_attention_score_mod" if name in hostile_hooks.SCORES else "turbo_flex_attention_mask_mod"
    extra = dict(turbo_flex_attention_mask_mod="primus_ext.attention.masks:causal",
                 turbo_flex_attention_mask_mod_kwargs={}) if key.endswith("score_mod") else {}
    return settings(turbo_flex_attention_backend=backend, **{key: f"{HOOKS}:{name}"}, **extra)


ALL = hostile_hooks.MASKS + hostile_hooks.SCORES


@pytest.mark.parametrize("backend", ["reference", "turbo"])
@pytest.mark.parametrize("name", ALL)
def test_a_hostile_hook_equals_the_hook_as_torch_calls_it_or_is_refused_naming_the_construct(name, backend):
    q, k, v = qkv(s=12)
    with fake_primus_turbo():
        try:
            layer = TurboFlexAttention(build_plan(config(name, backend), facts()))
        except UnsupportedConfigError as err:
            text = str(err)
            assert backend == "turbo" or name in ("try_item",), text  # reference evaluates the rest exactly
            want = DYNAMIC.get(name) or NOT_PROVEN.get(name) or "vmap"
            assert want in text, text
            if name in DYNAMIC:
                assert "hostile_hooks.py:" in text  # the construct's source line
            return
        assert name not in DYNAMIC or backend == "reference", "a dynamic hook ran on a fixed kernel"
        assert name not in NOT_PROVEN or backend == "reference"
        out = layer(q, k, v)
    torch.testing.assert_close(out, expected_output(name, q, k, v), atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("name", sorted(DYNAMIC))
def test_each_dynamic_hook_names_its_construct(name):
    outside = outside_subset(getattr(hostile_hooks, name), "mask_mod")
    assert outside is not None and DYNAMIC[name] in outside.describe()
    assert prove_mask(getattr(hostile_hooks, name), num_heads=4).hook_class == "dynamic"


@pytest.mark.parametrize("name", sorted(PROVEN))
def test_value_preserving_widths_and_casts_are_still_proven(name):
    hook = getattr(hostile_hooks, name)
    proof = prove_score(hook, num_heads=4) if name in hostile_hooks.SCORES else prove_mask(hook, num_heads=4)
    assert proof.hook_class == "proven", proof.reason


def test_replacing_a_default_argument_after_the_build_refuses_the_next_turbo_call():
    q, k, v = qkv(s=12)
    hook = hostile_hooks.default_width
    saved = hook.__defaults__
    with fake_primus_turbo():
        layer = TurboFlexAttention(build_plan(config("default_width", "turbo"), facts()))
        layer(q, k, v)
        try:
            hook.__defaults__ = (0,)
            with pytest.raises(UnsupportedInputError, match="default arguments of default_width"):
                layer(q, k, v)
        finally:
            hook.__defaults__ = saved


def test_the_environment_is_read_as_torch_reads_it_on_reference(monkeypatch):
    monkeypatch.setenv("PRIMUS_EXT_TEST_WINDOW", "1")
    q, k, v = qkv(s=12)
    layer = TurboFlexAttention(build_plan(config("environment", "reference"), facts()))
    torch.testing.assert_close(layer(q, k, v), expected_output("environment", q, k, v), atol=1e-9, rtol=1e-9)
    assert os.environ["PRIMUS_EXT_TEST_WINDOW"] == "1"


# ----------------------------------------------------------------------------- torch's combinators
def _causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def _near(b, h, q_idx, kv_idx):
    return q_idx - kv_idx <= 5


def _far_right(b, h, q_idx, kv_idx):
    return kv_idx - q_idx <= 2


@pytest.mark.parametrize("combine, parts, want", [
    (and_masks, (_causal, _near), "window(left=5, right=0)"),
    (and_masks, (_near, _far_right), "window(left=5, right=2)"),
    (or_masks, (_causal, _causal), "causal"),
])
def test_and_masks_and_or_masks_over_admitted_masks_are_proven(combine, parts, want):
    proof = prove_mask(combine(*parts), num_heads=4)
    assert proof.pattern is not None and proof.pattern.describe() == want, proof.reason


def test_and_masks_over_a_dynamic_part_is_dynamic():
    proof = prove_mask(and_masks(_causal, hostile_hooks.environment), num_heads=4)
    assert proof.hook_class == "dynamic" and "os.environ" in proof.reason


# ----------------------------------------------------------------------------- the hostile review's cases
NOT_PROVEN_REVIEW = {  # hook -> what the refusal names
    "to_tensor_dtype": "float32", "score_to_score_dtype": "", "float_bucketize": "bucketize",
    "conditional_callee": "chosen by a branch", "branch_local": "chosen by a branch",
    "key_argument": "a function passed as an argument", "int_subclass": "a Sneaky",
    "tensor_subclass": "Evil", "huge_int_score": "computes with the score by mul",
    "module_in_local": "held in a local variable", "dict_subclass_globals": "Globals as the globals",
    "keyword_override": "inside a tuple", "module_argument": "a module passed as an argument",
    "add_overflow": "overflows int64",
}


@pytest.mark.parametrize("name", sorted(NOT_PROVEN_REVIEW) + ["module_cell"])
def test_a_review_hook_is_not_proven(name):
    hook = review_hooks.module_cell() if name == "module_cell" else getattr(review_hooks, name)
    score = "score" in hook.__code__.co_varnames[:1]
    proof = prove_score(hook, num_heads=4) if score else prove_mask(hook, num_heads=4)
    assert proof.hook_class != "proven", proof.reason
    assert NOT_PROVEN_REVIEW.get(name, "held in the captured variable") in proof.reason


@pytest.mark.parametrize("name, change", [
    ("builtin_abs", lambda: setattr(review_hooks, "abs", lambda x: x * 0)),
    ("plain", lambda: setattr(review_hooks.plain, "__code__", review_hooks._other.__code__)),
    ("combined", lambda: setattr(review_hooks.combined.__closure__[0], "cell_contents", (review_hooks._other,))),
    ("second_window", lambda: setattr(review_hooks.second_window, "__defaults__", (40,))),
])
def test_a_change_no_call_check_saw_before_now_fails_an_assumption(name, change, monkeypatch):
    hook = getattr(review_hooks, name)
    if name == "second_window":
        assert prove_mask(review_hooks.first_window, num_heads=4).pattern is not None  # shares its fingerprint
    saved = (hook.__code__, hook.__defaults__, hook.__closure__[0].cell_contents if hook.__closure__ else None)
    proof = prove_mask(hook, num_heads=4)
    assert proof.pattern is not None and all(a.holds() for a in proof.assumptions)
    try:
        change()
        assert not all(a.holds() for a in proof.assumptions)
    finally:
        monkeypatch.delattr(review_hooks, "abs", raising=False)
        hook.__code__, hook.__defaults__ = saved[0], saved[1]
        if saved[2] is not None:
            hook.__closure__[0].cell_contents = saved[2]


def test_reference_computes_the_promotion_torch_computes():
    q, k, v = qkv(s=12)
    layer = TurboFlexAttention(build_plan(settings(turbo_flex_attention_mask_mod="tests.review_hooks:promotion"),
                                          facts()))
    mask = torch_mask(review_hooks.promotion, 2, 4, 12)
    expected = oracle.attention(q, k, v, lambda b, h, i, j: bool(mask[b, h, i, j]))
    torch.testing.assert_close(layer(q, k, v), expected, atol=1e-9, rtol=1e-9)
