"""B33: the on-device self-test runs each distinct route once against the reference backend."""

from __future__ import annotations

import pytest
from megatron.core.transformer.enums import AttnMaskType

from primus_ext.cli import main
from primus_ext.errors import UnsupportedConfigError
from primus_ext.megatron import PrimusTurboLocalAttention
from primus_ext.plan import selftest
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
