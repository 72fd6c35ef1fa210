"""Direct-path entries under context parallelism (the per-rank entries, B30-rng, cp-heads, the process
group), and B20's default layout.  tests/megatron/test_cp_ulysses.py runs CP 2 and 4 over processes."""

from __future__ import annotations

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType

from primus_ext.backends.direct import choose_direct
from primus_ext.errors import UnsupportedConfigError, UnsupportedInputError
from primus_ext.megatron import PrimusTurboLocalAttention
from primus_ext.testing import fake_primus_turbo
from tests import oracle
from tests.megatron import gpt
from tests.megatron.test_refusals import qkv_sbhd

DIRECT = gpt.settings()
FLEX = gpt.settings(use_turbo_flex_attention=True, turbo_flex_attention_backend="reference")


def test_context_parallel_runs_the_per_rank_entries_never_the_usp_ones():
    """Ulysses runs around flash_attn_func / flash_attn_varlen_func; the usp entries join shards in rank
    order (not Megatron's) and take no sink, so they are never chosen."""
    with fake_primus_turbo() as fake:
        for fp8 in (False, True):
            entries = choose_direct(fake.module, fp8=fp8, context_parallel=True)
            assert entries.ulysses and not entries.dense.endswith("_usp_func")
            assert entries.dense == ("flash_attn_fp8_func" if fp8 else "flash_attn_func")
        assert choose_direct(fake.module, fp8=False, context_parallel=True).packed == "flash_attn_varlen_func"
        assert choose_direct(fake.module, fp8=False, context_parallel=True).sink_dense


@pytest.mark.parametrize("settings", [DIRECT, FLEX], ids=["direct", "flex"])
def test_a_context_parallel_size_the_process_groups_do_not_make_is_refused_at_build(settings):
    """B22: this world's CP group has one rank; a layer planned for a split in two would see another one."""
    with fake_primus_turbo() as fake:
        with pytest.raises(UnsupportedConfigError) as err:
            PrimusTurboLocalAttention(gpt.config(context_parallel_size=2, kv_channels=16), 1, AttnMaskType.causal,
                                      "self", cp_comm_type="a2a", settings=settings)
    assert err.value.codes == ("B22",) and "context_parallel_size" in err.value.settings
    assert "1 rank" in str(err.value) and "initialize_model_parallel" in str(err.value)
    assert fake.calls == []


@pytest.mark.parametrize("settings", [DIRECT, FLEX], ids=["direct", "flex"])
def test_attention_dropout_with_context_parallel_and_no_rng_tracker_is_refused_at_build_time(settings):
    """B30-rng on both paths: without megatron-core's seeded RNG tracker every rank's generator is seeded
    alike, so the head shards would drop the same positions (with it they draw apart: test_dropout_rng.py)."""
    with fake_primus_turbo() as fake:
        with pytest.raises(UnsupportedConfigError) as err:
            PrimusTurboLocalAttention(gpt.config(context_parallel_size=2, kv_channels=16, attention_dropout=0.1), 1,
                                      AttnMaskType.causal, "self", cp_comm_type="a2a", settings=settings)
        assert "B30-rng" in err.value.codes
        assert {"attention_dropout", "context_parallel_size", "tensor_model_parallel_size"} <= set(err.value.settings)
        assert "attention_dropout: 0.0" in str(err.value) and "model_parallel_cuda_manual_seed" in str(err.value)
        # The same dropout at CP 1 and TP 1 builds (flash_attn_func takes dropout).
        PrimusTurboLocalAttention(gpt.config(kv_channels=16, attention_dropout=0.1), 1, AttnMaskType.causal,
                                  "self", settings=settings)
    assert fake.calls == []


@pytest.mark.parametrize("settings", [DIRECT, FLEX], ids=["direct", "flex"])
@pytest.mark.parametrize("heads, groups", [(4, 1), (2, 2), (6, 3)])
def test_heads_not_divisible_by_the_context_parallel_size_are_refused(settings, heads, groups):
    """cp-heads: Ulysses splits both head counts across the CP group (here refused before the group check)."""
    cfg = gpt.config(context_parallel_size=2, kv_channels=16, hidden_size=16 * heads, num_attention_heads=heads,
                     num_query_groups=groups)
    with fake_primus_turbo():
        with pytest.raises(UnsupportedConfigError) as err:
            PrimusTurboLocalAttention(cfg, 1, AttnMaskType.no_mask, "self", cp_comm_type="p2p", settings=settings)
    if heads % 2 or groups % 2:
        assert "cp-heads" in err.value.codes
        assert {"num_attention_heads", "num_query_groups", "context_parallel_size"} <= set(err.value.settings)
    else:
        assert err.value.codes == ("B22",)  # the plan builds; this one-process world has no CP group of 2


def test_a_packed_call_never_reaches_a_kernel_without_its_entry():
    """B21 with fp8 (no varlen entry): packed params are refused, not ignored."""
    q, k, v = gpt.fp8_tensors(*qkv_sbhd())
    bounds = torch.tensor([0, 16], dtype=torch.int32)
    with fake_primus_turbo() as fake:
        module = PrimusTurboLocalAttention(gpt.fp8_config(), 1, AttnMaskType.no_mask, "self",
                                           settings=gpt.settings(enable_turbo_attention_float8=True))
        with pytest.raises(UnsupportedInputError, match="packed_seq_params"):
            module(q[:, 0], k[:, 0], v[:, 0], None, packed_seq_params=PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=16, max_seqlen_kv=16))
    assert fake.calls == []


def test_qkv_format_none_falls_back_to_the_module_default():
    """B20: PackedSeqParams(qkv_format=None) without boundaries is the dense sbhd default."""
    q, k, v = qkv_sbhd()
    with fake_primus_turbo():
        module = PrimusTurboLocalAttention(gpt.config(kv_channels=16), 1, AttnMaskType.causal, "self",
                                           settings=DIRECT)
        out = module(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format=None))
        same = module(q, k, v, None)
        with pytest.raises(UnsupportedInputError, match="packed_seq_params"):
            bounds = torch.tensor([0, 16], dtype=torch.int32)
            module(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format=None, cu_seqlens_q=bounds,
                                                                     cu_seqlens_kv=bounds))
    assert out.shape == (16, 2, 4 * 16)
    torch.testing.assert_close(out, same)
    expected = oracle.attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), oracle.causal())
    torch.testing.assert_close(out.double(), expected.transpose(0, 1).reshape(16, 2, -1), atol=1e-5, rtol=1e-5)
