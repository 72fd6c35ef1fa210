"""B37 at build time: a layer declared for shared-prefix rows refuses what the LSE merge cannot compute
exactly, every reason at once, and `check`'s routes name the cross call per arch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from primus_ext.errors import UnsupportedConfigError
from primus_ext.plan import build_plan
from primus_ext.testing import fake_primus_turbo

from .helpers import facts, settings


def _refused(keys: dict, **layer) -> set[str]:
    with pytest.raises(UnsupportedConfigError) as err:
        build_plan(settings(packed_shared_prefix=True, **keys), facts(**{"packed": True, **layer}))
    return set(err.value.codes)


@pytest.mark.parametrize("keys, layer, code", [
    ({}, dict(packed=False), "B37-packed"),
    ({}, dict(causal=False, attn_mask_type="no_mask"), "B37-causal"),
    (dict(sink_sliding_window=4, sink_window_even_layers_only=False), {}, "B37-window"),
    ({}, dict(window_size=(8, 0)), "B37-window"),
    (dict(turbo_flex_attention_mask_mod="primus_ext.attention.masks:causal"), {}, "B37-hooks"),
    ({}, dict(attention_dropout=0.1), "B37-dropout"),
    ({}, dict(context_parallel_size=2, cp_comm_type="a2a"), "B37-cp"),
    (dict(packed_equal_documents=True), {}, "B37-equal"),
])
def test_what_the_merge_cannot_compute_is_refused_at_build(keys, layer, code):
    assert code in _refused(keys, **layer)


def test_every_reason_is_given_at_once():
    codes = _refused(dict(sink_sliding_window=4, sink_window_even_layers_only=False, packed_equal_documents=True),
                     attention_dropout=0.1)
    assert {"B37-window", "B37-dropout", "B37-equal"} <= codes


def test_an_unknown_arch_is_refused_on_primus_turbo():
    with fake_primus_turbo():
        assert "B37-arch" in _refused(dict(turbo_flex_attention_backend="turbo"))


def test_the_direct_path_refuses_fp8():
    with fake_primus_turbo():
        codes = _refused(dict(use_turbo_flex_attention=False, use_turbo_attention=True,
                              enable_turbo_attention_float8=True, turbo_arch="gfx942"), dtype="bf16", head_dim=32)
    assert "B37-fp8" in codes


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_the_plan_routes_the_cross_call_per_arch(arch):
    with fake_primus_turbo(arch=arch):
        plan = build_plan(settings(packed_shared_prefix=True, turbo_flex_attention_backend="turbo", turbo_arch=arch),
                          facts(packed=True, dtype="bf16", head_dim=64))
    kinds = [k.split(":")[0] for k in plan.kernels]
    assert "packed" in kinds and "shared-prefix cross" in kinds, plan.kernels
    assert plan.shared_prefix and "shared-prefix rows" in plan.describe()


def test_a_plain_layer_is_not_a_shared_prefix_layer():
    plan = build_plan(settings(), facts(packed=True))
    assert not plan.shared_prefix and not any("shared-prefix" in k for k in plan.kernels)


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_check_shows_the_two_varlen_calls_and_the_merge_per_arch(capsys, arch):
    from primus_ext.cli import main

    example = Path(__file__).resolve().parent.parent / "configs" / "examples" / "shared_prefix.yaml"
    code = main(["check", str(example), "--arch", arch])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"kernels on {arch}" in out and "packed: AITER" in out and "shared-prefix cross: AITER" in out
    assert "shared-prefix rows: layers 1, 2: 2 varlen calls per row" in out and "merged through their LSEs" in out
    assert "shared prefix (thd)" in out and "each response also sees its whole prompt" in out


def test_check_refuses_what_cannot_be_merged_with_every_reason(capsys, tmp_path):
    from primus_ext.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("num_layers: 1\nhidden_size: 256\nnum_attention_heads: 8\nnum_query_groups: 4\nseq_length: 1024\n"
                   "attention_dropout: 0.1\nwindow_size: [128, 0]\npacked_sequences: true\npacked_shared_prefix: true\n"
                   "packed_equal_documents: true\nuse_turbo_attention: true\nuse_turbo_flex_attention: true\n"
                   "turbo_flex_attention_backend: flex\n")
    code = main(["check", str(bad)])
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert code == 2, text
    for said in ("a window cannot cut it", "each of the two calls would draw its own dropout",
                 "are not of one length", "torch's flex_attention has no dropout"):
        assert said in text, said


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_the_self_test_runs_a_tree_row_through_the_merge_and_catches_a_wrong_one(arch, monkeypatch):
    from primus_ext.backends import shared_prefix as merge
    from primus_ext.call.selftest_shared_prefix import shared_prefix_route

    with fake_primus_turbo(arch=arch):
        plan = build_plan(settings(packed_shared_prefix=True, turbo_flex_attention_backend="turbo", turbo_arch=arch),
                          facts(packed=True, dtype="bf16", head_dim=64))
        good = shared_prefix_route(plan, torch.device("cpu"), torch.bfloat16)
        assert good is not None and good.ok and good.backward_error == good.backward_error, good
        # a merge that forgets the prompt: each response's cross partial weighs nothing
        monkeypatch.setattr(merge, "merge_partials", lambda out_a, lse_a, out_b, lse_b: (out_a, lse_a))
        bad = shared_prefix_route(plan, torch.device("cpu"), torch.bfloat16)
    assert not bad.ok and "differ from exact math" in bad.error


def test_a_plan_without_shared_prefix_rows_has_no_such_self_test_route():
    from primus_ext.call.selftest_shared_prefix import shared_prefix_route

    assert shared_prefix_route(build_plan(settings(), facts(packed=True)), torch.device("cpu"), torch.float32) is None
