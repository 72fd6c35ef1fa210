"""B31: a user hook runs on a fixed kernel only when proven equal to its pattern.

Every hook here is held to an independent float64 oracle that evaluates the hook as
written, cell by cell (`tests.oracle`); or the build refuses it on ``turbo`` naming
what the hook reads.  The unsound cases are the ones grid probing used to accept.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from primus_ext.hooks.proof import PROOFS, prove_mask
from primus_ext.attention.library import library_pattern
from primus_ext.attention.pattern import Pattern
from primus_ext.call.adapter import TurboFlexAttention
from primus_ext.cli.check import _plans as check_plans
from primus_ext.errors import UnsupportedConfigError, UnsupportedInputError
from primus_ext.megatron.facts import layer_facts
from primus_ext.plan import build_plan
from primus_ext.settings import TurboAttentionSettings
from primus_ext.testing import fake_primus_turbo

from . import oracle, proof_hooks
from .helpers import facts, qkv, settings

HOOKS = "tests.proof_hooks"
TOL = dict(atol=1e-10, rtol=1e-10)


def mask_settings(name: str, backend: str):
    return settings(turbo_flex_attention_backend=backend, turbo_flex_attention_mask_mod=f"{HOOKS}:{name}")


def score_settings(name: str, backend: str):
    return settings(turbo_flex_attention_backend=backend, turbo_flex_attention_score_mod=f"{HOOKS}:{name}")


def run(config, *args, **kwargs):
    return TurboFlexAttention(build_plan(config, facts()))(*args, **kwargs)


# ----------------------------------------------------------------------------- unsound cases
UNSOUND_MASKS = {
    "doc_ids": "DOC_IDS",  # a captured tensor indexed by position: its length bounds it
    "head_three": "depends on the head index",
    "batch_two": "depends on the batch index",
    "batch_one": "depends on the batch index",
    "wrapped_window": "not proven",  # functools.wraps copies nothing that counts
    "far_row": "the hook blocks attention, window(left=-1, right=1) allows it",
    "near_row": "the hook blocks attention, window(left=-1, right=3) allows it",
    "branchy": "outside the provable subset: it uses the attribute .sum",
}


@pytest.mark.parametrize("name", sorted(UNSOUND_MASKS))
def test_unprovable_mask_is_refused_on_turbo_with_what_it_reads(name):
    with fake_primus_turbo():
        with pytest.raises(UnsupportedConfigError) as err:
            build_plan(mask_settings(name, "turbo"), facts())
    text = str(err.value)
    # a hook that also raises as torch calls it is refused for that too (rule torch-call)
    assert UNSOUND_MASKS[name] in text and {r.code for r in err.value.reasons} - {"torch-call"} == {"B31"}
    assert "turbo_flex_attention_backend: reference" in text


@pytest.mark.parametrize("name", sorted(set(UNSOUND_MASKS) - {"branchy"}))
def test_unprovable_mask_is_evaluated_exactly_on_reference(name):
    q, k, v = qkv()
    out = run(mask_settings(name, "reference"), q, k, v)
    expected = oracle.attention(q, k, v, oracle.hook(getattr(proof_hooks, name)))
    torch.testing.assert_close(out, expected, **TOL)


def test_wrapper_of_a_library_mask_is_not_the_library_mask():
    assert library_pattern(proof_hooks.wrapped_window) is None
    assert library_pattern(proof_hooks._library_window) == Pattern(4, 0)
    assert prove_mask(proof_hooks.wrapped_window, num_heads=4).pattern is None


def test_captured_doc_ids_updated_in_place_are_read_at_every_call_on_reference():
    q, k, v = qkv()
    layer = TurboFlexAttention(build_plan(mask_settings("doc_ids", "reference"), facts()))
    saved = proof_hooks.DOC_IDS.clone()
    try:
        for cut in (6, 11, 3):  # the data loader writes new boundaries each step
            proof_hooks.DOC_IDS.copy_((torch.arange(16) >= cut).long())
            expected = oracle.attention(q, k, v, oracle.hook(proof_hooks.doc_ids))
            torch.testing.assert_close(layer(q, k, v), expected, **TOL)
    finally:
        proof_hooks.DOC_IDS.copy_(saved)


UNSOUND_SCORES = ("distance_penalty", "clipped_alibi", "hard_clamp")


@pytest.mark.parametrize("name", UNSOUND_SCORES)
def test_score_differing_only_far_away_or_at_large_scores_is_refused_on_turbo(name):
    # a clamp of the score is refused before any solver query: a step outside the score's float32 allow-list
    why = "computes with the score by clamp" if name == "hard_clamp" else "neither the identity nor ALiBi"
    with fake_primus_turbo():
        with pytest.raises(UnsupportedConfigError, match=why):
            build_plan(score_settings(name, "turbo"), facts())


@pytest.mark.parametrize("name", UNSOUND_SCORES)
def test_unprovable_score_is_evaluated_exactly_on_reference(name):
    q, k, v = qkv(s=24)
    q = q * 60  # scores beyond +-100 and distances beyond 16 are reached
    out = run(score_settings(name, "reference"), q, k, v, causal=True)
    expected = oracle.attention(q, k, v, oracle.causal(), score_mod=getattr(proof_hooks, name))
    torch.testing.assert_close(out, expected, **TOL)


# ----------------------------------------------------------------------------- ordinary hooks run on Turbo
ORDINARY = {
    # name: (proven pattern, entry that runs it)
    "causal": (Pattern(-1, 0), "flash_attn_func"),
    "full": (Pattern(-1, -1), "flash_attn_func"),
    "gym_window": (Pattern(8, 0), "flash_attn_func"),
    "titan_window": (Pattern(7, 0), "flash_attn_func"),
    "global_window": (Pattern(8, 0), "flash_attn_func"),
    "head_independent": (Pattern(-1, 0), "flash_attn_func"),
    "band": (Pattern(3, 3), "flash_attn_func"),
    "chunked": (Pattern(-1, 0, chunk=4), "flash_attn_varlen_func"),
    "constant_documents": (Pattern(-1, 0, cuts=(6,)), "flash_attn_varlen_func"),
}


@pytest.mark.parametrize("name", sorted(ORDINARY))
def test_ordinary_mask_is_proven_and_runs_on_its_kernel(name):
    pattern, entry = ORDINARY[name]
    q, k, v = qkv()
    with fake_primus_turbo() as fake:
        plan = build_plan(mask_settings(name, "turbo"), facts())
        assert plan.pattern == pattern
        out = TurboFlexAttention(plan)(q, k, v)
        assert [c.entry for c in fake.calls] == [entry]
        call = fake.calls[0]
        if entry == "flash_attn_func":  # the proven window, in flash convention
            causal, window = pattern.right == 0, pattern.window
            assert (call.args["causal"], call.args["window_size"]) == (
                (causal, (-1, -1)) if window in ((-1, -1), (-1, 0)) else (causal, window))
        else:
            bounds = pattern.at_length(16).boundaries
            expected_cu = list(bounds) + [16 + b for b in bounds[1:]]
            assert call.args["cu_seqlens_q"].tolist() == expected_cu
    expected = oracle.attention(q, k, v, oracle.hook(getattr(proof_hooks, name)))
    torch.testing.assert_close(out, expected, **TOL)


@pytest.mark.parametrize("name", ["alibi_list", "alibi_tensor"])
def test_alibi_score_is_proven_and_runs_with_its_slopes(name):
    q, k, v = qkv()
    with fake_primus_turbo() as fake:
        plan = build_plan(score_settings(name, "turbo"), facts())
        assert plan.alibi_slopes == tuple(proof_hooks.ALIBI_SLOPES)
        out = TurboFlexAttention(plan)(q, k, v, causal=True)
        (call,) = fake.calls_to("flash_attn_func")
        assert call.args["alibi_slopes"].tolist() == proof_hooks.ALIBI_SLOPES
    expected = oracle.attention(q, k, v, oracle.causal(), alibi=proof_hooks.ALIBI_SLOPES)
    torch.testing.assert_close(out, expected, **TOL)


# ----------------------------------------------------------------------------- proofs that rely on values
def test_rebinding_a_global_the_proof_read_refuses_the_next_turbo_call():
    q, k, v = qkv()
    with fake_primus_turbo():
        layer = TurboFlexAttention(build_plan(mask_settings("global_window", "turbo"), facts()))
        layer(q, k, v)
        try:
            proof_hooks.WINDOW = 4
            with pytest.raises(UnsupportedInputError, match="WINDOW"):
                layer(q, k, v)
        finally:
            proof_hooks.WINDOW = 8
        layer(q, k, v)  # holds again once the value is back


def test_changing_a_captured_slope_tensor_in_place_refuses_the_next_turbo_call():
    q, k, v = qkv()
    with fake_primus_turbo():
        layer = TurboFlexAttention(build_plan(score_settings("alibi_tensor", "turbo"), facts()))
        layer(q, k, v, causal=True)
        proof_hooks.SLOPE_TENSOR.mul_(2)
        try:
            with pytest.raises(UnsupportedInputError, match="SLOPE_TENSOR"):
                layer(q, k, v, causal=True)
        finally:
            proof_hooks.SLOPE_TENSOR.div_(2)
        # a new build proves the (restored) values again
        assert build_plan(score_settings("alibi_tensor", "turbo"), facts()).alibi_slopes == tuple(
            proof_hooks.ALIBI_SLOPES)


def test_reference_runs_a_proven_hook_with_changing_inputs_itself():
    q, k, v = qkv()
    layer = TurboFlexAttention(build_plan(mask_settings("global_window", "reference"), facts()))
    try:
        proof_hooks.WINDOW = 2
        torch.testing.assert_close(layer(q, k, v), oracle.attention(q, k, v, oracle.window(2, 0)), **TOL)
    finally:
        proof_hooks.WINDOW = 8


# ----------------------------------------------------------------------------- cost and agreement
def test_one_proof_per_hook_for_a_whole_model():
    config = settings(turbo_flex_attention_mask_mod="primus_ext.attention.masks:chunked",
                      turbo_flex_attention_mask_mod_kwargs={"chunk_size": 13})
    before = PROOFS["mask_mod"]
    plans = [build_plan(config, facts(layer_number=n)) for n in range(1, 97)]
    assert PROOFS["mask_mod"] - before == 1
    assert {p.pattern for p in plans} == {Pattern(-1, 0, chunk=13)}


@pytest.mark.parametrize("name", sorted(ORDINARY) + sorted(UNSOUND_MASKS))
def test_verdict_does_not_depend_on_the_sequence_length(name):
    def verdict(seq_length):
        with fake_primus_turbo():
            try:
                return build_plan(mask_settings(name, "turbo"), facts(seq_length=seq_length)).pattern
            except UnsupportedConfigError as exc:
                return str(exc)

    assert verdict(None) == verdict(16) == verdict(131072)


EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "configs" / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_check_and_the_megatron_build_reach_the_same_verdict(path):
    """`check` reads seq_length from the YAML; a Megatron build has none (TransformerConfig)."""
    config = yaml.safe_load(path.read_text())
    config.pop("demo", None)
    cfg = TurboAttentionSettings.from_dict(config)

    def verdicts(source):
        out = []
        for layer in range(1, int(config.get("num_layers") or 1) + 1):
            try:
                out.append(build_plan(cfg, layer_facts(source, layer)).describe())
            except UnsupportedConfigError as exc:
                out.append(str(exc))
        return out

    without_length = SimpleNamespace(**{k: v for k, v in config.items() if k != "seq_length"})
    with fake_primus_turbo():
        assert verdicts(config) == verdicts(without_length)
    assert [o.describe() if hasattr(o, "describe") else str(o)
            for _, o in check_plans(cfg, config)] == verdicts(config)


def test_a_module_attribute_the_proof_read_is_an_assumption(tmp_path, monkeypatch):
    (tmp_path / "cfg_w.py").write_text("W = 6\n")
    (tmp_path / "attr_hook.py").write_text(
        "import cfg_w\n\ndef window(b, h, q, kv):\n    return (kv <= q) & (q - kv <= cfg_w.W)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import attr_hook
    import cfg_w

    proof = prove_mask(attr_hook.window, num_heads=4)
    assert proof.pattern == Pattern(6, 0) and any("cfg_w.W" in r for r in proof.reads)
    monkeypatch.setattr(cfg_w, "W", 2)
    assert not all(a.holds() for a in proof.assumptions)
    assert prove_mask(attr_hook.window, num_heads=4).pattern == Pattern(2, 0)  # proven again


def test_proving_works_under_a_profiler():
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        assert prove_mask(lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= 11).pattern == Pattern(11, -1)
    finally:
        profiler.disable()


@pytest.mark.parametrize("name", ["uint8_window", "bool_sum", "half_causal"])
def test_hooks_whose_torch_semantics_differ_from_integers_are_not_proven(name):
    assert prove_mask(getattr(proof_hooks, name), num_heads=4).pattern is None
    q, k, v = qkv()
    out = run(mask_settings(name, "reference"), q, k, v)
    torch.testing.assert_close(out, oracle.attention(q, k, v, oracle.hook(getattr(proof_hooks, name))), **TOL)


@pytest.mark.parametrize("name", ["class_window", "captured_class_window"])
def test_a_class_attribute_is_outside_the_provable_subset(name):
    """A class's attribute can be rebound between calls: the hook is dynamic, refused on turbo with the
    construct and its line, and evaluated as written on reference."""
    with fake_primus_turbo():
        with pytest.raises(UnsupportedConfigError) as err:
            build_plan(mask_settings(name, "turbo"), facts())
        assert "the class " in str(err.value) and "proof_hooks.py:" in str(err.value)
        q, k, v = qkv()
        TurboFlexAttention(build_plan(mask_settings(name, "reference"), facts()))(q, k, v)


def test_a_torch_function_cannot_be_named_as_a_hook():
    with pytest.raises(UnsupportedConfigError, match="torch"):
        build_plan(settings(turbo_flex_attention_mask_mod="torch:set_printoptions"), facts())


@pytest.mark.parametrize("name", ["float_window", "requires_grad_full"])
def test_float_index_arithmetic_and_tensor_attributes_are_not_proven(name):
    assert prove_mask(getattr(proof_hooks, name), num_heads=4).pattern is None


def test_an_infinite_fill_is_refused_on_turbo_and_runs_on_reference():
    with fake_primus_turbo():
        with pytest.raises(UnsupportedConfigError):
            build_plan(score_settings("infinite_fill", "turbo"), facts())
    build_plan(score_settings("infinite_fill", "reference"), facts())


@pytest.mark.parametrize("name, change", [
    ("tensor_width", lambda: proof_hooks.WIDTH.data.fill_(0)),  # bypasses the version counter
])
def test_changing_what_a_proof_read_refuses_the_next_turbo_call(name, change):
    q, k, v = qkv()
    saved = (proof_hooks.CapturedConfig.W, proof_hooks.WIDTH.clone())
    with fake_primus_turbo():
        layer = TurboFlexAttention(build_plan(mask_settings(name, "turbo"), facts()))
        layer(q, k, v)
        try:
            change()
            with pytest.raises(UnsupportedInputError, match="B31"):
                layer(q, k, v)
        finally:
            proof_hooks.CapturedConfig.W = saved[0]
            proof_hooks.WIDTH.data.copy_(saved[1])


def test_closures_over_values_equal_in_python_but_different_in_torch_do_not_share_a_proof():
    assert prove_mask(proof_hooks.signed_zero(0.0), num_heads=4).pattern == Pattern(-1, -1)
    assert prove_mask(proof_hooks.signed_zero(-0.0), num_heads=4).pattern == Pattern(-1, 0)


def test_an_object_equal_to_a_library_mask_is_not_it():
    from primus_ext.attention import masks

    lib = masks.causal()

    class Impostor:
        def __hash__(self):
            return hash(lib)

        def __eq__(self, other):
            return True

    assert library_pattern(Impostor()) is None


def test_a_call_with_more_heads_than_planned_is_refused():
    q, k, v = qkv(hq=8, hkv=2)
    with fake_primus_turbo():
        layer = TurboFlexAttention(build_plan(mask_settings("head_four_and_up", "turbo"), facts()))
        with pytest.raises(UnsupportedInputError, match="num_attention_heads"):
            layer(q, k, v)


LIBRARY_HOOKS = {  # the factories docs/mask_hooks.md lists, with arguments
    "full": {}, "causal": {}, "sliding_window": {"left": 16, "right": 0},
    "packed_documents": {"cu_seqlens": [0, 100, 512]}, "prefix_lm": {"prefix_length": 64},
    "chunked": {"chunk_size": 64},
}


@pytest.mark.parametrize("factory", sorted(LIBRARY_HOOKS))
def test_each_documented_library_hook_gets_one_verdict_at_any_length(factory):
    config = settings(turbo_flex_attention_backend="turbo",
                      turbo_flex_attention_mask_mod=f"primus_ext.attention.masks:{factory}",
                      turbo_flex_attention_mask_mod_kwargs=LIBRARY_HOOKS[factory])

    def verdict(seq_length):
        with fake_primus_turbo():
            try:
                return build_plan(config, facts(seq_length=seq_length)).pattern
            except UnsupportedConfigError as exc:
                return str(exc)

    assert verdict(None) == verdict(512) == verdict(65536)


def test_a_score_hook_widening_the_dtype_runs_on_reference_in_the_input_dtype(tmp_path, monkeypatch):
    (tmp_path / "wide_score.py").write_text(
        "import torch\nSLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)\n"
        "def alibi_f64(score, b, h, q_idx, kv_idx):\n    return score + SLOPES[h] * (kv_idx - q_idx)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    q, k, v = qkv(dtype=torch.float32)
    out = run(settings(turbo_flex_attention_score_mod="wide_score:alibi_f64"), q, k, v, causal=True)
    assert out.dtype == torch.float32
    expected = oracle.attention(q, k, v, oracle.causal(), alibi=[0.5, 0.25, 0.125, 0.0625])
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_a_proof_shared_by_fingerprint_still_checks_the_new_closures_own_cells():
    def make(width):
        def mask(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx - kv_idx <= width)

        def widen(new):
            nonlocal width
            width = new

        return mask, widen

    first, _ = make(5)
    second, widen = make(5)
    assert prove_mask(first, num_heads=4).pattern == Pattern(5, 0)
    proof = prove_mask(second, num_heads=4)  # found by fingerprint: equal code and closure values
    assert proof.pattern == Pattern(5, 0)
    widen(9)
    assert not all(a.holds() for a in proof.assumptions)
    assert prove_mask(second, num_heads=4).pattern == Pattern(9, 0)
