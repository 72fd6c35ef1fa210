"""Which backend a hook layer gets (docs/mask_hooks.md, the three classes), and the flex refusals.

``auto``: proven -> turbo where Primus-Turbo imports; admitted -> flex on a GPU (a device, or
``turbo_arch`` naming one, as ``check --arch`` plans), reference on the CPU; dynamic -> reference.
Explicit choices win: ``flex`` with a dynamic hook and ``turbo`` with an unproven one are refused.
"""

from __future__ import annotations

import io

import pytest
import yaml

from primus_ext.cli.check import run_check
from primus_ext.errors import UnsupportedConfigError
from primus_ext.plan import build_plan
from primus_ext.settings import BACKEND_CHOICES
from primus_ext.testing import fake_primus_turbo

from .helpers import facts, settings

HOOKS = "tests.flex_hooks:"
ADMITTED = [("mask", "prefix_lm"), ("mask", "dilated_window"), ("mask", "document_ids"), ("score", "softcap")]


def plan_for(kind: str, hook: str, backend: str = "auto", **keys):
    with fake_primus_turbo(build="main"):
        return build_plan(settings(**{f"turbo_flex_attention_{kind}_mod": HOOKS + hook,
                                      "turbo_flex_attention_backend": backend, **keys}), facts(seq_length=48))


def test_flex_is_a_choice_of_the_setting():
    assert "flex" in BACKEND_CHOICES


@pytest.mark.parametrize("kind, hook", ADMITTED)
def test_auto_runs_admitted_hooks_on_reference_on_the_cpu_and_flex_for_a_gpu(kind, hook):
    assert plan_for(kind, hook).backend == "reference"
    on_gpu = plan_for(kind, hook, turbo_arch="gfx942")
    assert on_gpu.backend == "flex" and "FlexAttention" in on_gpu.backend_reason


def test_auto_keeps_proven_hooks_on_turbo_and_dynamic_ones_on_reference():
    proven = plan_for("mask", "x", turbo_flex_attention_mask_mod="primus_ext.attention.masks:causal",
                      turbo_flex_attention_mask_mod_kwargs={}, turbo_arch="gfx942")
    assert proven.backend == "turbo"
    dynamic = plan_for("mask", "typed_causal", turbo_arch="gfx942")
    assert dynamic.backend == "reference" and "dynamic" in dynamic.backend_reason


def test_auto_avoids_flex_where_it_lacks_dropout_or_determinism():
    assert plan_for("mask", "prefix_lm", turbo_arch="gfx942", deterministic_mode=True).backend == "reference"


@pytest.mark.parametrize("keys, code", [
    ({"turbo_flex_attention_mask_mod": HOOKS + "typed_causal"}, "flex-dynamic"),
    ({"deterministic_mode": True}, "flex-deterministic"),
    ({"turbo_flex_attention_score_mod": HOOKS + "relative_bias"}, "hook-learned"),
])
def test_explicit_flex_refusals(keys, code):
    with pytest.raises(UnsupportedConfigError) as err:
        build_plan(settings(turbo_flex_attention_backend="flex", **keys), facts())
    assert code in err.value.codes
    assert "turbo_flex_attention_backend" in str(err.value) and "reference" in str(err.value)


def test_fp8_is_refused_on_flex_as_on_the_whole_flex_path():
    with pytest.raises(UnsupportedConfigError) as err:
        build_plan(settings(turbo_flex_attention_backend="flex", enable_turbo_attention_float8=True), facts())
    assert "B23" in err.value.codes


def test_context_parallel_builds_on_flex():
    """Ulysses hands the flex backend whole sequences of a rank's heads (tests/megatron/test_cp_ulysses.py)."""
    chosen = build_plan(settings(turbo_flex_attention_backend="flex", turbo_flex_attention_mask_mod=HOOKS + "prefix_lm"),
                        facts(seq_length=48, context_parallel_size=2))
    assert chosen.backend == "flex"


def test_explicit_flex_refuses_dropout():
    with pytest.raises(UnsupportedConfigError) as err:
        build_plan(settings(turbo_flex_attention_backend="flex"), facts(attention_dropout=0.1))
    assert "flex-dropout" in err.value.codes


def test_explicit_turbo_still_refuses_an_unproven_hook():
    with pytest.raises(UnsupportedConfigError) as err:
        plan_for("mask", "prefix_lm", backend="turbo", turbo_arch="gfx942")
    assert "B31" in err.value.codes


def test_check_with_arch_shows_flex_for_admitted_hooks(tmp_path):
    config = {"use_turbo_attention": True, "use_turbo_flex_attention": True, "num_layers": 2, "hidden_size": 64,
              "num_attention_heads": 4, "seq_length": 64, "turbo_flex_attention_mask_mod": HOOKS + "prefix_lm"}
    path = tmp_path / "prefix.yaml"
    path.write_text(yaml.safe_dump(config))
    out, err = io.StringIO(), io.StringIO()
    assert run_check(str(path), out=out, err=err, arch="gfx942") == 0, err.getvalue()
    rows = [line.split() for line in out.getvalue().splitlines() if line[:1].isdigit()]
    assert rows and all(row[1:3] == ["flex", "flex"] for row in rows), out.getvalue()
    out = io.StringIO()
    assert run_check(str(path), out=out, err=io.StringIO()) == 0
    rows = [line.split() for line in out.getvalue().splitlines() if line[:1].isdigit()]
    assert rows and all(row[2] == "reference" for row in rows), out.getvalue()


def test_a_layer_built_to_run_on_a_cpu_plans_reference_even_with_turbo_arch():
    """`check --arch gfx942` plans a cluster (flex); a module built here without a GPU runs reference, not a
    flex layer whose first backward would be refused (B34.flex-cpu-grad)."""
    with fake_primus_turbo(build="main"):
        built = build_plan(settings(turbo_flex_attention_mask_mod=HOOKS + "prefix_lm", turbo_arch="gfx942",
                                    turbo_flex_attention_backend="auto"),
                           facts(seq_length=48, runs_here=True))
    assert built.backend == "reference" and "no GPU here" in built.backend_reason
    assert plan_for("mask", "prefix_lm", turbo_arch="gfx942").backend == "flex"


@pytest.mark.parametrize("backend", ["flex", "reference", "auto"])
def test_a_per_head_table_shorter_than_the_heads_is_refused_at_build(backend):
    with pytest.raises(UnsupportedConfigError) as err:
        build_plan(settings(turbo_flex_attention_backend=backend, turbo_flex_attention_score_mod=HOOKS + "head_bias"),
                   facts(seq_length=48, num_heads=8, num_kv_heads=2))
    assert "hook-range" in err.value.codes and "num_attention_heads" in str(err.value)
    assert build_plan(settings(turbo_flex_attention_backend=backend, turbo_flex_attention_score_mod=HOOKS + "head_bias"),
                      facts(seq_length=48, num_heads=4, num_kv_heads=2)).backend in ("flex", "reference")


def test_a_token_table_shorter_than_the_call_is_refused_at_the_call_not_at_build():
    """Positions are the call's (the plan depends on no sequence length): the build of a 64-token layer over
    48 captured ids holds, a 64-token call is refused with our error, not an IndexError."""
    from primus_ext.call import TurboFlexAttention
    from primus_ext.errors import UnsupportedInputError

    from .helpers import qkv

    chosen = build_plan(settings(turbo_flex_attention_backend="reference",
                                 turbo_flex_attention_mask_mod=HOOKS + "document_ids"), facts(seq_length=64))
    with pytest.raises(UnsupportedInputError) as err:
        TurboFlexAttention(chosen)(*qkv(s=64))
    assert "B34.hook-raised" in err.value.codes and "IndexError" in str(err.value)
