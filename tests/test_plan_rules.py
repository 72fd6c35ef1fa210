"""Build-time refusals (the rule table) and call-time refusals of the adapter."""

from __future__ import annotations

import pytest
import torch

from primus_ext.errors import UnsupportedConfigError, UnsupportedInputError
from primus_ext.plan import RULES, build_plan
from primus_ext.testing import fake_primus_turbo

from . import oracle
from .helpers import adapter, facts, packed_qkv, qkv, settings


def refused(settings_obj, facts_obj=None, **kw) -> UnsupportedConfigError:
    with pytest.raises(UnsupportedConfigError) as err:
        build_plan(settings_obj, facts_obj or facts(), **kw)
    return err.value


def test_every_rule_has_settings_reason_and_alternative():
    codes = [r.code for r in RULES]
    assert len(codes) == len(set(codes))
    for rule in RULES:
        assert rule.settings and rule.reason and rule.alternative, rule.code


@pytest.mark.parametrize(
    "keys, layer, expected",
    [
        ({"use_turbo_attention": False}, {}, "use_turbo_attention"),                          # B3
        ({"sink_sliding_window": 8}, {"window_size": (4, 0)}, "sink_sliding_window"),          # B10
        ({"sink_sliding_window": 8,
          "turbo_flex_attention_mask_mod": "primus_ext.attention.masks:causal",
          "turbo_flex_attention_mask_mod_kwargs": {}}, {}, "turbo_flex_attention_mask_mod"),   # B11
        ({"turbo_flex_attention_mask_mod": "primus_ext.attention.masks:causal",
          "turbo_flex_attention_mask_mod_kwargs": {}}, {"packed": True}, "turbo_flex_attention_mask_mod"),  # B17
        ({}, {"context_parallel_size": 2, "attention_dropout": 0.1, "rng_tracker": False},
         "context_parallel_size"),  # B30-rng
        ({"enable_turbo_attention_float8": True}, {}, "enable_turbo_attention_float8"),         # B23
        ({"reset_attention_mask": True}, {}, "reset_attention_mask"),                           # B25
        ({}, {"return_attn_probs": True}, "return_attn_probs"),                                 # B26
        ({}, {"position_embedding_type": "alibi"}, "position_embedding_type"),                  # B27
        ({}, {"num_kv_heads": 3}, "num_query_groups"),
        ({}, {"attention_dropout": 1.0}, "attention_dropout"),
    ],
)
def test_refusals_name_the_setting(keys, layer, expected):
    err = refused(settings(**keys), facts(**layer))
    assert expected in err.settings
    assert expected in str(err)
    assert "Alternative:" in str(err)


def test_reset_attention_mask_points_at_thd_packing():
    assert "THD" in str(refused(settings(reset_attention_mask=True)))


def test_every_failure_is_reported_at_once():
    err = refused(settings(use_turbo_attention=False, reset_attention_mask=True,
                           enable_turbo_attention_float8=True), facts(context_parallel_size=2, attention_dropout=0.1,
                                                                            rng_tracker=False))
    assert {"use_turbo_attention", "reset_attention_mask", "enable_turbo_attention_float8",
            "context_parallel_size"} <= set(err.settings)
    assert len(err.reasons) >= 4 and "4 reasons" in str(err) or len(err.reasons) > 4


def test_bad_hook_is_refused_at_build_time_with_the_hook_string():
    err = refused(settings(turbo_flex_attention_mask_mod="no_such_module_xyz:mask"))
    assert "turbo_flex_attention_mask_mod" in err.settings and "no_such_module_xyz:mask" in str(err)


def test_flex_off_builds_a_direct_plan_and_refuses_hooks():
    """B1: with the switch off nothing of the flex path is consulted, and a hook, which the direct path would
    not run, is refused with the settings."""
    with pytest.raises(UnsupportedConfigError) as err:
        settings(use_turbo_flex_attention=False, turbo_flex_attention_mask_mod="no_such_module_xyz:mask")
    assert err.value.settings == ("turbo_flex_attention_mask_mod", "use_turbo_flex_attention")
    with fake_primus_turbo():
        plan = build_plan(settings(use_turbo_flex_attention=False, turbo_flex_attention_backend="flex"), facts())
    assert plan.path == "direct" and plan.mask_mod is None
    assert (plan.dense_entry, plan.packed_entry) == ("flash_attn_func", "flash_attn_varlen_func")


def test_direct_path_without_primus_turbo_is_refused():
    err = refused(settings(use_turbo_flex_attention=False))
    assert "use_turbo_attention" in err.settings and "reference" in str(err)


@pytest.mark.parametrize("fp8, cp, dense, packed", [
    (False, 1, "flash_attn_func", "flash_attn_varlen_func"),
    (False, 2, "flash_attn_func", "flash_attn_varlen_func"),  # Ulysses around the per-rank entries
    (True, 1, "flash_attn_fp8_func", None),
])
def test_direct_entries_follow_fp8_and_context_parallel(fp8, cp, dense, packed):
    with fake_primus_turbo():
        plan = build_plan(settings(use_turbo_flex_attention=False, enable_turbo_attention_float8=fp8),
                          facts(context_parallel_size=cp, cp_comm_type="a2a", causal=False, attn_mask_type="no_mask",
                                head_dim=32))
    assert (plan.dense_entry, plan.packed_entry) == (dense, packed)


@pytest.mark.parametrize("keys, layer, expected", [
    ({"enable_turbo_attention_float8": True, "sink_sliding_window": 4}, {}, "enable_turbo_attention_float8"),  # B9
    ({"enable_turbo_attention_float8": True}, {"window_size": (4, 0)}, "window_size"),                        # B9
    ({"use_sink_attention": True, "enable_turbo_attention_float8": True}, {}, "use_sink_attention"),          # B13
    ({"enable_turbo_attention_float8": True}, {"context_parallel_size": 2, "cp_comm_type": "p2p"},
     "context_parallel_size"),                                                                                 # cp-fp8
    ({}, {"context_parallel_size": 2, "cp_comm_type": "p2p", "packed": True}, "context_parallel_size"),  # cp-packed
    ({}, {"context_parallel_size": 2, "cp_comm_type": "ring"}, "cp_comm_type"),
    ({}, {"attn_mask_type": "padding"}, "attn_mask_type"),
])
def test_direct_path_refusals(keys, layer, expected):
    with fake_primus_turbo():
        err = refused(settings(use_turbo_flex_attention=False, **keys), facts(**layer))
    assert expected in err.settings


def test_direct_varlen_without_sink_refuses_sinks_only_for_packed_layers():
    with fake_primus_turbo(varlen_sink=False):
        err = refused(settings(use_turbo_flex_attention=False, use_sink_attention=True), facts(packed=True))
        assert "use_sink_attention" in err.settings
        build_plan(settings(use_turbo_flex_attention=False, use_sink_attention=True), facts(packed=False))


# -- refusals that depend on the Turbo build ---------------------------------

def turbo(**keys):
    return settings(turbo_flex_attention_backend="turbo", **keys)


def test_unrecognised_mask_refused_for_turbo_but_runs_on_reference():
    keys = dict(turbo_flex_attention_mask_mod="primus_ext.attention.masks:prefix_lm",
                turbo_flex_attention_mask_mod_kwargs={"prefix_length": 4})
    with fake_primus_turbo():
        err = refused(turbo(**keys))
    assert "turbo_flex_attention_backend" in err.settings and "reference" in str(err)
    assert build_plan(settings(**keys), facts()).pattern is None


def test_softcap_and_other_score_mods_refused_for_turbo(tmp_path, monkeypatch):
    (tmp_path / "scores_mod.py").write_text(
        "import torch\n"
        "def softcap(score, b, h, q, kv):\n    return 30.0 * torch.tanh(score / 30.0)\n"
        "def squared(score, b, h, q, kv):\n    return score * score\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with fake_primus_turbo():
        cap = refused(turbo(turbo_flex_attention_score_mod="scores_mod:softcap"))
        other = refused(turbo(turbo_flex_attention_score_mod="scores_mod:squared"))
    assert "softcap" in str(cap) and "turbo_flex_attention_score_mod" in cap.settings
    assert "turbo_flex_attention_score_mod" in other.settings
    build_plan(settings(turbo_flex_attention_score_mod="scores_mod:softcap"), facts())


def test_sink_needs_power_of_two_head_dim_on_turbo():
    with fake_primus_turbo():
        err = refused(turbo(use_sink_attention=True), facts(head_dim=12))
    assert "kv_channels" in err.settings


@pytest.mark.parametrize("build", ["main", "old"])
def test_builds_without_flex_entries_run_windows_and_documents_on_the_flash_entries(build):
    """Primus-Turbo main has no flex layer: a window goes to flash_attn_func, packed
    documents to flash_attn_varlen_func, with the same numbers as the oracle."""
    q, k, v = qkv()
    tq, tk, tv = packed_qkv(12)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    with fake_primus_turbo(build=build) as fake:
        run = adapter(turbo(sink_sliding_window=4))
        out = run(q, k, v, causal=True, window_size=(4, 0))
        packed = run.varlen(tq, tk, tv, causal=True, window_size=(4, 0), cu_seqlens_q=cu, cu_seqlens_k=cu,
                     max_seqlen_q=7, max_seqlen_k=7)
        assert [c.entry for c in fake.calls] == ["flash_attn_func", "flash_attn_varlen_func"]
        assert fake.calls[0].args["window_size"] == (4, 0) and fake.calls[0].args["causal"] is True
    torch.testing.assert_close(out, oracle.attention(q, k, v, oracle.window(4, 0)), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(packed, oracle.packed_attention(tq, tk, tv, [0, 5, 12], left=4, right=0),
                               atol=1e-10, rtol=1e-10)


# -- call-time refusals -------------------------------------------------------

def test_return_attn_probs_refused_at_call():
    q, k, v = qkv()
    with pytest.raises(UnsupportedInputError, match="return_attn_probs"):
        adapter(settings())(q, k, v, causal=True, return_attn_probs=True)


def test_packed_with_bias_refused():
    q, k, v = packed_qkv(6)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(UnsupportedInputError, match="bias"):
        adapter(settings()).varlen(q, k, v, bias=torch.zeros(6, 6, dtype=q.dtype), causal=True,
                            cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6, max_seqlen_k=6)


def test_hook_plus_call_time_causal_is_not_composed():
    run = adapter(settings(turbo_flex_attention_mask_mod="primus_ext.attention.masks:prefix_lm",
                           turbo_flex_attention_mask_mod_kwargs={"prefix_length": 4}))
    q, k, v = qkv()
    with pytest.raises(UnsupportedInputError, match="turbo_flex_attention_mask_mod"):
        run(q, k, v, causal=True)


def test_sink_tensor_without_planned_sink_refused():
    q, k, v = qkv()
    with pytest.raises(UnsupportedInputError, match="use_sink_attention"):
        adapter(settings())(q, k, v, causal=True, sink=torch.zeros(4))


def test_causal_with_unequal_lengths_refused_on_turbo_only():
    q, k, v = qkv(s=8, skv=12)
    with fake_primus_turbo():
        with pytest.raises(UnsupportedInputError, match="causal"):
            adapter(turbo())(q, k, v, causal=True)
    adapter(settings())(q, k, v, causal=True)  # reference: top-left, exact


def test_user_window_wider_than_any_build_length_is_proven_at_its_width(tmp_path, monkeypatch):
    (tmp_path / "wide.py").write_text(
        "def window(b, h, q, kv):\n    return (kv <= q) & (q - kv <= 40)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with fake_primus_turbo():
        run = adapter(turbo(turbo_flex_attention_mask_mod="wide:window"), facts(seq_length=16))
        assert run.plan.pattern.window == (40, 0)  # a proof, not a 16x16 grid
        q, k, v = qkv(s=64)
        torch.testing.assert_close(run(q, k, v), oracle.attention(q, k, v, oracle.window(40, 0)),
                                   atol=1e-10, rtol=1e-10)


def test_fp8_with_deterministic_mode_is_refused_because_the_fp8_entries_drop_it():
    """flash_attn_fp8_func and flash_attn_fp8_usp_func take `deterministic` and never pass it to their
    kernel (upstream, with file and line in the reason): the backward would not be deterministic."""
    layer = facts(causal=False, attn_mask_type="no_mask", head_dim=32)
    for cp in (1, 2):
        with fake_primus_turbo():
            err = refused(settings(use_turbo_flex_attention=False, enable_turbo_attention_float8=True,
                                   deterministic_mode=True), facts(context_parallel_size=cp, cp_comm_type="a2a",
                                                                   causal=False, attn_mask_type="no_mask",
                                                                   head_dim=32))
        assert "B24-fp8" in err.codes and "flash_attn_interface.py l.505-565" in str(err)
    with fake_primus_turbo():  # either switch alone still builds
        build_plan(settings(use_turbo_flex_attention=False, enable_turbo_attention_float8=True), layer)
        build_plan(settings(use_turbo_flex_attention=False, deterministic_mode=True), layer)


def test_packed_sequences_is_the_layers_packing_on_every_reader():
    assert build_plan(settings(packed_sequences=True), facts()).packed is True
    assert build_plan(settings(packed_sequences=False), facts()).packed is False
    assert build_plan(settings(), facts(packed=True)).packed is True
    err = refused(settings(packed_sequences=False), facts(packed=True))
    assert "packed_sequences" in err.settings and "two sources" in str(err)
    # reset_attention_mask runs as EOD documents once the batches are declared packed (B25)
    assert build_plan(settings(reset_attention_mask=True, packed_sequences=True), facts()).eod_documents
    assert "B25" in refused(settings(reset_attention_mask=True), facts()).codes


# -- what build_plan once refused inline, now rules of the table: collected with the others -----------------
@pytest.mark.parametrize("window", [(4,), (4, 0, 5), (12.5, 0), (4, -2), (True, 0), 128, "ab"])
def test_a_malformed_window_is_rule_window_shape(window):
    err = refused(settings(), facts(window_size=window))
    assert err.codes == ("window-shape",) and tuple(err.settings) == ("window_size",)


def test_inline_refusals_are_collected_with_every_other_reason():
    """A malformed window, a packing given twice and a bad dropout: one error naming all three."""
    err = refused(settings(packed_sequences=False), facts(window_size=(4, 0, 1), packed=True, attention_dropout=1.5))
    assert {"window-shape", "packed-sources", "dropout"} <= set(err.codes), err.codes


def test_a_packed_attribute_of_another_type_is_rule_packed_type():
    err = refused(settings(), facts(packed="yes"))
    assert err.codes == ("packed-type",) and "str 'yes'" in str(err)


def test_an_arch_the_dispatch_model_lacks_is_rule_arch_unmodelled(monkeypatch):
    import primus_ext.plan.build as build

    monkeypatch.setattr(build, "resolve_arch", lambda setting: ("gfx90a", "the device (gfx90a)"))
    with fake_primus_turbo():
        err = refused(settings(turbo_flex_attention_backend="turbo"))
        assert err.codes == ("arch-unmodelled",) and "gfx90a" in str(err) and "turbo_arch" in err.settings
        err = refused(settings(use_turbo_flex_attention=False))  # the direct path too
        assert err.codes == ("arch-unmodelled",)
    assert build_plan(settings(turbo_flex_attention_backend="reference"), facts()).backend == "reference"


def test_a_window_given_as_an_iterator_is_read_once():
    plan = build_plan(settings(), facts(window_size=iter([4, 0]), causal=False))
    assert plan.window == (4, 0)


def test_a_hook_torch_cannot_call_is_refused_naming_that_hook_only():
    err = refused(settings(turbo_flex_attention_mask_mod="tests.proof_hooks:branchy"), facts())
    assert "torch-call" in err.codes and "turbo_flex_attention_score_mod" not in err.settings
