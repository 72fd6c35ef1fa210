"""One test per bug the differential fuzzer found, named after the bug.

Each reproduces the shrunk failing case (or its essence) with fixed inputs, so the
bug stays fixed even if the fuzzer's strategies change.
"""

from __future__ import annotations

import pytest
import torch

from primus_ext.attention.flex import TurboFlexAttention
from primus_ext.errors import UnsupportedConfigError, UnsupportedInputError
from primus_ext.plan import build_plan
from primus_ext.testing.fake_turbo import fake_primus_turbo
from tests.helpers import adapter, facts, packed_qkv, qkv, settings

from . import oracle

TOL = dict(atol=1e-10, rtol=1e-10)
DOCS_HOOK = dict(turbo_flex_attention_mask_mod="tests.fuzz.user_hooks:documents",
                 turbo_flex_attention_mask_mod_kwargs={"lengths": [4, 6], "causal": True})


def refused(keys: dict, layer=None) -> UnsupportedConfigError:
    with pytest.raises(UnsupportedConfigError) as info:
        build_plan(settings(**keys), layer or facts())
    return info.value


def test_regression_direct_sink_with_non_power_of_two_head_dim():
    """The direct path built a sink layer with head_dim 6; flash_attn_func then raised a bare
    ValueError at the first forward.  Its sink path has the same head-dim limits as the flex
    entries, so the `sink-shape` rule now refuses it at build time."""
    direct = dict(use_turbo_flex_attention=False, use_sink_attention=True)
    with fake_primus_turbo():
        err = refused(direct, facts(head_dim=6))
        assert "sink-shape" in err.codes and "kv_channels" in err.settings
        assert "use_turbo_flex_attention: true" in str(err)
        build_plan(settings(**direct), facts(head_dim=8))  # a power of two builds
        build_plan(settings(use_turbo_flex_attention=False), facts(head_dim=6))  # no sink: no limit
