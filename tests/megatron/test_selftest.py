"""B33: the on-device self-test runs each distinct route once against the reference backend."""

from __future__ import annotations

import pytest
from megatron.core.transformer.enums import AttnMaskType

from primus_ext.cli import main
from primus_ext.errors import UnsupportedConfigError
from primus_ext.megatron import PrimusTurboLocalAttention
from primus_ext.call import selftest
from primus_ext.testing import fake_primus_turbo

from . import gpt

FAULT = "sink_backward_ignores_right_window"
BAND = dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="turbo", use_sink_attention=True,
            turbo_flex_attention_mask_mod="primus_ext.attention.masks:sliding_window",
            turbo_flex_attention_mask_mod_kwargs={"left": 8, "right": 4})


def build(settings):
    return PrimusTurboLocalAttention(config=gpt.config(), layer_number=1, attn_mask_type=AttnMaskType.causal,
                                     attention_type="self", settings=settings)


def test_selftest_cli_passes_every_route_on_the_cpu_fake(capsys):
    assert main(["selftest"]) == 0
    assert "window(left=8, right=4), sink" in capsys.readouterr().out
    assert main(["selftest", "configs/examples/demo.yaml"]) == 0


def test_selftest_cli_catches_the_silent_sink_backward_defect(capsys):
    assert main(["selftest", "--fault", FAULT]) == 2
    captured = capsys.readouterr()
    assert "FAILED" in captured.out and "route [flex dense: window(left=8, right=4), sink" in captured.err


def test_model_build_is_refused_when_a_route_disagrees_with_the_reference():
    selftest.clear()
    with fake_primus_turbo(faults=(FAULT,)):
        with pytest.raises(UnsupportedConfigError, match="self-test of route") as err:
            build(gpt.settings(turbo_selftest="true", **BAND))
    assert "turbo_selftest" in err.value.settings
    selftest.clear()
    with fake_primus_turbo():
        build(gpt.settings(turbo_selftest="true", **BAND))  # the healthy kernels pass
    selftest.clear()
    with fake_primus_turbo(faults=(FAULT,)):
        build(gpt.settings(turbo_selftest="false", **BAND))  # opted out


def test_selftest_runs_each_distinct_route_once_per_process():
    selftest.clear()
    with fake_primus_turbo() as fake:
        build(gpt.settings(turbo_selftest="true", **BAND))
        calls = len(fake.calls)
        for _ in range(3):
            build(gpt.settings(turbo_selftest="true", **BAND))
        assert len(fake.calls) == calls


def test_auto_is_off_without_a_gpu():
    assert selftest.selftest_enabled("auto") is False
    assert selftest.selftest_enabled("true") and not selftest.selftest_enabled("false")


# -- the self-test reaches each kernel backend a layer's calls reach (issue: self-test reach) -------
GQA8_D64 = dict(hidden_size=512, num_attention_heads=8, num_query_groups=1, kv_channels=64)
GQA2_D64 = dict(hidden_size=256, num_attention_heads=4, num_query_groups=2, kv_channels=64)
REACH = [  # (arch, packed, shape, pin, backends the layer's calls reach)
    ("gfx942", False, GQA8_D64, None, {"AITER"}),
    ("gfx942", True, GQA8_D64, None, {"AITER"}),
    ("gfx950", False, GQA8_D64, None, {"FlyDSL"}),      # Megatron's sbhd storage, GQA 8: FlyDSL
    ("gfx950", False, GQA2_D64, None, {"AITER"}),       # GQA 2 leaves FlyDSL
    ("gfx950", True, GQA8_D64, None, {"FlyDSL", "AITER"}),  # equal documents FlyDSL, unequal AITER
    ("gfx950", False, GQA8_D64, "hipkittens", {"HipKittens"}),
]
CORRUPT = {"AITER": "aiter_corrupt_output", "FlyDSL": "flydsl_corrupt_output",
           "HipKittens": "hipkittens_corrupt_output"}


def build_on(arch, packed, shape, flex, **keys):
    import torch

    cfg = gpt.config(params_dtype=torch.bfloat16, bf16=True, **shape)
    cfg.packed_sequences = packed
    path = dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="turbo") if flex else {}
    return PrimusTurboLocalAttention(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                     attention_type="self",
                                     settings=gpt.settings(turbo_selftest="true", turbo_arch=arch, **path, **keys))


@pytest.mark.parametrize("flex", [False, True], ids=["direct", "flex-turbo"])
@pytest.mark.parametrize("arch, packed, shape, pin, reached", REACH,
                         ids=[f"{a}-{'packed' if p else 'dense'}-{'gqa8' if s is GQA8_D64 else 'gqa2'}-{pin or 'default'}"
                              for a, p, s, pin, _ in REACH])
def test_the_selftest_catches_a_fault_in_each_backend_the_layers_calls_reach(arch, packed, shape, pin, reached, flex,
                                                                            monkeypatch):
    """With Megatron's layouts and the model's dtype, the self-test runs the kernels the layer will:
    a corruption injected into each backend the layer's calls reach refuses the build, one injected
    into any other backend does not (it is not reached), and the healthy fake passes."""
    if pin:
        monkeypatch.setenv("PRIMUS_TURBO_ATTN_BACKEND", pin)
    selftest.clear()
    with fake_primus_turbo(arch=arch) as fake:
        build_on(arch, packed, shape, flex)
        assert {c.backend for c in fake.calls} == reached  # the self-test's calls reached these backends
    for backend, fault in CORRUPT.items():
        selftest.clear()
        with fake_primus_turbo(arch=arch, faults=(fault,)):
            if backend in reached:
                with pytest.raises(UnsupportedConfigError, match="self-test of route") as err:
                    build_on(arch, packed, shape, flex)
                assert "turbo_selftest" in err.value.settings
            else:
                build_on(arch, packed, shape, flex)


def test_selftest_cli_runs_the_fake_as_the_arch_asked(tmp_path, capsys):
    """``--arch gfx950`` dispatches the fake's calls as gfx950 does, so a FlyDSL fault is caught there
    and not on gfx942 (no FlyDSL)."""
    config = tmp_path / "flydsl.yaml"
    config.write_text("bf16: true\nnum_layers: 1\nhidden_size: 512\nnum_attention_heads: 8\nnum_query_groups: 1\n"
                      "kv_channels: 64\nseq_length: 256\npacked_sequences: false\nuse_turbo_attention: true\n")
    fault = ["--fault", "flydsl_corrupt_output", str(config)]
    assert main(["selftest", "--arch", "gfx950", *fault]) == 2
    assert "self-test of route" in capsys.readouterr().err
    assert main(["selftest", "--arch", "gfx942", *fault]) == 0
    assert main(["selftest", "--arch", "gfx950", str(config)]) == 0


# -- under autotune each candidate kernel backend is pinned for its own run (issue: autotune reach) ------
AUTOTUNED = [  # (packed, flex, backends that take the self-test's calls on gfx950 under autotune)
    (False, False, {"FlyDSL", "AITER", "HipKittens"}),  # dense, GQA 8, D 64: all three take it
    (True, False, {"FlyDSL", "AITER"}),                 # packed (equal documents declared: autotune's key has no
                                                        # document count): FlyDSL, AITER; HipKittens: no varlen
    (False, True, {"FlyDSL", "AITER", "HipKittens"}),
]


@pytest.mark.parametrize("packed, flex, reached", AUTOTUNED,
                         ids=[f"{'packed' if p else 'dense'}-{'flex-turbo' if f else 'direct'}"
                              for p, f, _ in AUTOTUNED])
def test_under_autotune_the_selftest_pins_and_catches_each_candidate_backend(packed, flex, reached):
    """Autotune may keep any backend that takes a call, so the self-test runs each route once per
    candidate, pinned: a corruption in any of them refuses the build, the healthy fake passes, and a
    backend no call reaches (HipKittens has no varlen kernel) is not blamed."""
    selftest.clear()
    keys = dict(use_turbo_autotune=True, packed_equal_documents=packed)
    with fake_primus_turbo(arch="gfx950") as fake:
        layer = build_on("gfx950", packed, GQA8_D64, flex, **keys)
        assert layer.plan.selection.autotune and layer.plan.selection.pin is None
        assert {c.backend for c in fake.calls} == reached
    for backend, fault in CORRUPT.items():
        selftest.clear()
        with fake_primus_turbo(arch="gfx950", faults=(fault,)):
            if backend in reached:
                with pytest.raises(UnsupportedConfigError, match=f"pinned {backend} ") as err:
                    build_on("gfx950", packed, GQA8_D64, flex, **keys)
                assert "turbo_selftest" in err.value.settings
            else:
                build_on("gfx950", packed, GQA8_D64, flex, **keys)


def test_selftest_cli_under_autotune_catches_a_fault_in_every_candidate(tmp_path, capsys):
    config = tmp_path / "autotune.yaml"
    config.write_text("bf16: true\nnum_layers: 1\nhidden_size: 512\nnum_attention_heads: 8\nnum_query_groups: 1\n"
                      "kv_channels: 64\nseq_length: 256\npacked_sequences: false\nuse_turbo_attention: true\n"
                      "use_turbo_autotune: true\n")
    assert main(["selftest", "--arch", "gfx950", str(config)]) == 0
    table = capsys.readouterr().out
    assert all(f"pinned {b} (autotune candidate)" in table for b in CORRUPT)
    for backend, fault in CORRUPT.items():
        assert main(["selftest", "--arch", "gfx950", "--fault", fault, str(config)]) == 2, fault
        assert f"pinned {backend} (autotune candidate)] (kernels" in capsys.readouterr().err


def _manager():
    from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager, PrecisionType

    return GlobalBackendManager, BackendType, PrecisionType


@pytest.mark.parametrize("fault", [None, "aiter_corrupt_output"], ids=["passes", "refuses"])
def test_the_selftest_restores_the_backend_setting_in_force_before_it(fault, monkeypatch):
    """The pins are the self-test's own: a code setting for another precision survives it, and where
    nothing was set in code the environment rules again after it, whether the build passes or not."""
    for in_code in (True, False):
        selftest.clear()
        with fake_primus_turbo(arch="gfx950", faults=(fault,) if fault else ()):
            manager, backend, precision = _manager()
            if in_code:
                manager.set_attn_backend(backend.AITER, precision=precision.FP8)
            else:
                monkeypatch.setenv("PRIMUS_TURBO_ATTN_BACKEND", "fp8:aiter")
            if fault:
                with pytest.raises(UnsupportedConfigError, match="pinned AITER"):
                    build_on("gfx950", False, GQA8_D64, False, use_turbo_autotune=True)
            else:
                build_on("gfx950", False, GQA8_D64, False, use_turbo_autotune=True)
            assert manager.get_attn_backend(precision.FP8) is backend.AITER
            assert manager.get_attn_backend(precision.BF16_FP16_FP32) is None
            if not in_code:  # no code setting was left behind: the environment is read again
                monkeypatch.setenv("PRIMUS_TURBO_ATTN_BACKEND", "fp8:hipkittens")
                assert manager.get_attn_backend(precision.FP8) is backend.HIPKITTENS
                monkeypatch.delenv("PRIMUS_TURBO_ATTN_BACKEND")


def test_pinned_backend_restores_after_an_error_and_through_the_public_call(monkeypatch):
    """`pinned_backend` restores on an exception too; on a manager whose code setting it cannot read
    (upstream's ``set_attn_backend(None)`` clears it) it restores through the public call."""
    with fake_primus_turbo(arch="gfx950"):
        manager, backend, precision = _manager()
        with pytest.raises(RuntimeError):
            with selftest.pinned_backend("HipKittens"):
                assert manager.get_attn_backend(precision.BF16_FP16_FP32) is backend.HIPKITTENS
                raise RuntimeError("the kernel failed")
        assert manager._attn_backend is None

    class Upstream:  # set_attn_backend(None) resets to the environment; the setting is not readable
        _pins: dict = {}

        @classmethod
        def set_attn_backend(cls, value=None, precision=None):
            cls._pins = {} if value is None else {"all": value}

        @classmethod
        def get_attn_backend(cls, precision):
            return cls._pins.get("all")

    core = type("core", (), dict(GlobalBackendManager=Upstream, BackendType=backend, PrecisionType=precision))
    monkeypatch.setattr(selftest, "_core", lambda: core)
    for before in (None, backend.FLYDSL):
        Upstream.set_attn_backend(before)
        with selftest.pinned_backend("AITER"):
            assert Upstream.get_attn_backend(None) is backend.AITER
        assert Upstream.get_attn_backend(None) is before


def test_a_pinned_candidate_that_cannot_take_the_call_is_skipped_not_failed():
    """Upstream's ``ValueError("User specified backend ... cannot handle ...")`` says the backend does not
    take the call, so autotune cannot keep it either: a skipped row, no failure.  A sink keeps HipKittens
    out of the candidates; pinned anyway, it is skipped."""
    import torch

    selftest.clear()
    with fake_primus_turbo(arch="gfx950"):
        layer = build_on("gfx950", False, GQA8_D64, False, use_turbo_autotune=True, use_sink_attention=True)
        assert set(selftest.candidates(layer.plan, False, None, torch.bfloat16)) == {"FlyDSL", "AITER"}
        found = selftest.check_route(layer.plan, False, torch.device("cpu"), torch.bfloat16, pinned="HipKittens")
        assert found.ok and found.pinned == "HipKittens" and "cannot handle" in found.skipped


# -- the flex backend's routes (torch's FlexAttention) are self-tested through the layer's adapter -------
FLEX = dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="flex", use_sink_attention=True,
            turbo_flex_attention_mask_mod="tests.flex_hooks:prefix_lm")


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_a_flex_layer_is_self_tested_at_build_forward_only_on_the_cpu(monkeypatch):
    """On the CPU, torch's kernel has no backward: the build checks the forward, passes, and says so; a
    wrong forward still refuses the build; with the autograd stand-in the backward is checked too."""
    from primus_ext.backends import flex as flex_module
    from primus_ext.call import selftest_flex

    from ..flex_standin import flex_standin
    from ..test_selftest_flex import broken

    seen = []

    def spy(plans, **keys):  # the rows the layer's build got
        found = selftest.self_test(plans, **keys)
        seen.extend(found)
        return found

    monkeypatch.setattr("primus_ext.megatron.core.self_test", spy)
    selftest.clear()
    layer = build(gpt.settings(turbo_selftest="true", **FLEX))
    assert layer.plan.backend == "flex"
    (row,) = seen
    assert row.ok and row.unchecked == selftest_flex.FORWARD_ONLY
    assert "mask_mod tests.flex_hooks:prefix_lm" in row.route and row.forward_error < 1e-5
    selftest.clear()
    with monkeypatch.context() as patch:
        patch.setattr(flex_module, "flex_attention", broken(flex_module.flex_attention, "forward"))
        with pytest.raises(UnsupportedConfigError, match="self-test of route \\[flex dense on FlexAttention"):
            build(gpt.settings(turbo_selftest="true", **FLEX))
    for where in ("backward", None):  # the stand-in in place of torch's kernel: gradients checked
        selftest.clear()
        kernel = broken(flex_standin, where) if where else flex_standin
        monkeypatch.setattr(selftest_flex, "flex_backend", lambda _=None, k=kernel: flex_module.FlexBackend(kernel=k))
        seen.clear()
        if where:
            with pytest.raises(UnsupportedConfigError, match="backward differ"):
                build(gpt.settings(turbo_selftest="true", **FLEX))
        else:
            build(gpt.settings(turbo_selftest="true", **FLEX))
            assert seen[0].ok and not seen[0].unchecked and seen[0].backward_error < 1e-5
    selftest.clear()


# -- FlyDSL varlen takes any equal-document batch, one document included, on the detected build ---------------
MHA_D128 = dict(hidden_size=1024, num_attention_heads=8, num_query_groups=8, kv_channels=128)


@pytest.mark.parametrize("build, shape, reached", [
    ("a6a16cd", GQA8_D64, {"FlyDSL", "AITER"}),
    ("a6a16cd", MHA_D128, {"AITER"}),            # group 1: AITER only before PT #509
    ("pt509", MHA_D128, {"FlyDSL", "AITER"}),    # PT #509: FlyDSL takes MHA (Hq*D = 1024)
])
def test_the_selftest_reaches_flydsl_varlen_on_one_document_batches_of_the_detected_build(build, shape, reached):
    selftest.clear()
    with fake_primus_turbo(arch="gfx950", kernels=build) as fake:
        layer = build_on("gfx950", True, shape, False)
        assert layer.plan.turbo_build.name == build
        varlen = [c for c in fake.calls if c.entry == "flash_attn_varlen_func"]
    assert {c.backend for c in varlen} == reached
    one = [c for c in varlen if c.args["cu_seqlens_q"].numel() == 2]
    assert one and {c.backend for c in one} == ({"FlyDSL"} if "FlyDSL" in reached else {"AITER"})
    if "FlyDSL" in reached:
        selftest.clear()
        with fake_primus_turbo(arch="gfx950", kernels=build, faults=("flydsl_corrupt_output",)):
            with pytest.raises(UnsupportedConfigError, match="turbo_selftest"):
                build_on("gfx950", True, shape, False)
