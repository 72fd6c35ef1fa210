"""B33: the model of Primus-Turbo's per-arch kernel dispatch, and the plan's refusals from it.

Each row restates one fact of Primus-Turbo's dispatch (``attention_impl.py`` at a6a16cd, cited in
`primus_ext.backends.dispatch`) as an expected outcome, written
here independently of `primus_ext.backends.dispatch`.
"""

from __future__ import annotations

import pytest

from primus_ext.backends.dispatch import DENSE, VARLEN, CallFeatures, route
from primus_ext.cli import main
from primus_ext.errors import UnsupportedConfigError
from primus_ext.plan import build_plan
from primus_ext.testing import fake_primus_turbo

from .helpers import facts, settings

FAST = dict(heads=32, kv_heads=4, head_dim=128, head_dim_v=128)  # GQA group 8, D 128: FlyDSL-shaped
SMALL = dict(heads=4, kv_heads=2, head_dim=64, head_dim_v=64)    # GQA group 2: never FlyDSL

# (arch, entry, dtype, shape, extra features) -> (backend or None, runs exactly)
CASES = [
    ("gfx950", DENSE, "bf16", FAST, {}, "FlyDSL", True),
    ("gfx942", DENSE, "bf16", FAST, {}, "AITER", True),                       # FlyDSL is gfx950 only
    ("gfx950", DENSE, "fp16", FAST, {}, "AITER", True),                       # FlyDSL is bf16 only
    ("gfx950", DENSE, "bf16", SMALL, {}, "AITER", True),                      # group 2 is outside 8..256
    ("gfx942", DENSE, "fp32", FAST, {}, None, False),                         # fp32 runs nowhere
    ("gfx950", DENSE, "fp64", FAST, {}, None, False),
    ("gfx942", VARLEN, "fp32", SMALL, {}, None, False),
    ("gfx942", VARLEN, "bf16", SMALL, {}, "AITER", True),
    ("gfx942", VARLEN, "bf16", FAST, {"sink": True, "equal_documents": True}, None, False),  # sink+varlen: FlyDSL only
    ("gfx950", VARLEN, "bf16", FAST, {"sink": True, "equal_documents": True}, "FlyDSL", True),
    ("gfx950", VARLEN, "bf16", FAST, {"sink": True, "equal_documents": None}, None, False),  # unequal documents
    ("gfx950", VARLEN, "bf16", SMALL, {"sink": True, "equal_documents": True}, None, False),  # group 2
    ("gfx942", DENSE, "bf16", SMALL, {"sink": True, "window": (4, 4), "causal": False}, "AITER", False),  # defect
    ("gfx950", DENSE, "bf16", FAST, {"sink": True, "window": (4, 4), "causal": False}, "AITER", False),
    ("gfx950", DENSE, "bf16", FAST, {"sink": True, "window": (128, 0)}, "FlyDSL", True),
    ("gfx950", DENSE, "bf16", FAST, {"sink": True, "window": (32, 0)}, "AITER", True),  # left < 64: not FlyDSL
    ("gfx942", DENSE, "bf16", SMALL, {"sink": True, "deterministic": True}, "AITER", False),  # AITER asserts
    ("gfx950", DENSE, "bf16", FAST, {"sink": True, "deterministic": True}, "FlyDSL", True),  # FlyDSL takes both
    ("gfx950", DENSE, "bf16", SMALL, {"sink": True, "deterministic": True}, "AITER", False),
    ("gfx942", DENSE, "bf16", dict(SMALL, head_dim=96, head_dim_v=96), {"sink": True}, "AITER", False),
    ("gfx950", DENSE, "bf16", FAST, {"dropout": 0.1}, "AITER", True),          # FlyDSL takes no dropout
    ("gfx950", DENSE, "bf16", FAST, {"alibi": True}, "AITER", True),
    ("gfx950", DENSE, "bf16", FAST, {"default_scale": False}, "AITER", True),
    ("gfx950", DENSE, "bf16", FAST, {"causal": False}, "AITER", True),
]


@pytest.mark.parametrize("arch, entry, dtype, shape, extra, backend, exact", CASES)
def test_each_dispatch_fact(arch, entry, dtype, shape, extra, backend, exact):
    found = route(CallFeatures(arch=arch, entry=entry, dtype=dtype, **shape, **extra))
    assert found.backend == backend
    assert found.ok is exact
    assert bool(found.problem()) is not exact


def turbo(**keys):
    return settings(turbo_flex_attention_backend="turbo", **keys)


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_sink_on_packed_batches_with_group_two_has_no_kernel_on_either_arch(arch):
    with fake_primus_turbo():
        with pytest.raises(UnsupportedConfigError) as err:
            build_plan(turbo(use_sink_attention=True, turbo_arch=arch), facts(packed=True, dtype="bf16"))
    assert err.value.codes == ("B33",) and arch in str(err.value) and "use_sink_attention" in err.value.settings


def test_sink_with_a_right_window_bound_is_refused_for_its_silent_backward():
    hook = dict(turbo_flex_attention_mask_mod="primus_ext.attention.masks:sliding_window",
                turbo_flex_attention_mask_mod_kwargs={"left": 4, "right": 4})
    with fake_primus_turbo():
        with pytest.raises(UnsupportedConfigError, match="silently wrong"):
            build_plan(turbo(use_sink_attention=True, turbo_arch="gfx942", **hook), facts(packed=False, dtype="bf16"))
        build_plan(turbo(turbo_arch="gfx942", **hook), facts(packed=False, dtype="bf16"))  # no sink: fine


def test_fp32_model_on_turbo_is_refused_with_the_dtype_alternative():
    with fake_primus_turbo():
        with pytest.raises(UnsupportedConfigError, match="bf16") as err:
            build_plan(turbo(turbo_arch="gfx942"), facts(packed=False, dtype="fp32"))
    assert "bf16" in err.value.settings


def test_direct_path_is_checked_too():
    with fake_primus_turbo():
        with pytest.raises(UnsupportedConfigError, match="deterministic"):
            build_plan(settings(use_turbo_flex_attention=False, use_sink_attention=True, deterministic_mode=True,
                                turbo_arch="gfx942"), facts(packed=False, dtype="bf16"))


def test_plan_says_which_kernel_backend_runs_and_why_a_fallback():
    with fake_primus_turbo():
        fast = build_plan(turbo(turbo_arch="gfx950"), facts(packed=False, dtype="bf16", num_heads=32,
                                                           num_kv_heads=4, head_dim=128))
        slow = build_plan(turbo(turbo_arch="gfx950"), facts(packed=False, dtype="bf16"))
    assert fast.kernels == ("dense: FlyDSL",)
    assert slow.kernels[0].startswith("dense: AITER (slower fallback: FlyDSL")


def test_without_an_arch_nothing_is_assumed():
    with fake_primus_turbo():
        plan = build_plan(turbo(), facts(packed=True, dtype="fp32"))
    assert plan.arch is None and plan.kernels == ()


def test_check_arch_answers_for_a_turbo_machine_without_primus_turbo(tmp_path, capsys):
    config = tmp_path / "cluster.yaml"
    config.write_text("use_turbo_attention: true\nuse_turbo_flex_attention: true\nbf16: true\n"
                      "num_layers: 2\nhidden_size: 4096\nnum_attention_heads: 32\nnum_query_groups: 4\n"
                      "kv_channels: 128\nseq_length: 4096\nuse_sink_attention: true\npacked_sequences: true\n")
    assert main(["check", str(config), "--arch", "gfx950"]) == 2  # documents of unknown lengths
    err = capsys.readouterr().err
    assert "gfx950 (MI355)" in err and "equal length" in err
    config.write_text(config.read_text().replace("packed_sequences: true", "packed_sequences: false"))
    assert main(["check", str(config), "--arch", "gfx950"]) == 0
    assert "kernels on gfx950 (Primus-Turbo build a6a16cd): layers 1, 2: dense: FlyDSL" in capsys.readouterr().out
    assert main(["check", str(config), "--arch", "gfx942"]) == 0
    assert "dense: AITER (slower fallback: FlyDSL runs only on gfx950)" in capsys.readouterr().out
