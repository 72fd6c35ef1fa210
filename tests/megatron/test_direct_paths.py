"""Direct-path entries under context parallelism (groups, B30-cp, cp-heads), the B28 invariant, and B20's
default layout.  tests/megatron/test_cp_groups.py runs CP 2 over two processes."""

from __future__ import annotations

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType

from primus_ext.backends.direct import DirectEntries, DirectRunner, singleton_ring_group
from primus_ext.errors import UnsupportedConfigError, UnsupportedInputError
from primus_ext.megatron import PrimusTurboLocalAttention
from primus_ext.testing import fake_primus_turbo
from tests import oracle
from tests.megatron import gpt
from tests.megatron.test_refusals import qkv_sbhd

DIRECT = gpt.settings()


@pytest.mark.parametrize("comm", ["a2a", "p2p"])
def test_context_parallel_uses_usp_entry_with_ulysses_over_cp_and_a_ring_of_one(comm):
    """Both comm types: ulysses_group = the CP group, ring_group = this rank's size-1 group.

    ``ring_group=None`` would be the WORLD group and ``ulysses_group=None`` crashes (the
    reference's section 3), so neither is ever None.
    """
    q, k, v = qkv_sbhd()
    with fake_primus_turbo() as fake:  # non-causal: causal layers at CP > 1 are refused (cp-causal)
        module = PrimusTurboLocalAttention(gpt.config(context_parallel_size=2, kv_channels=16), 1,
                                           AttnMaskType.no_mask, "self", cp_comm_type=comm, settings=DIRECT)
        module(q, k, v, None)
        with pytest.raises(UnsupportedInputError, match="packed_seq_params"):
            module(q[:, 0], k[:, 0], v[:, 0], None, packed_seq_params=PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=torch.tensor([0, 16], dtype=torch.int32),
                cu_seqlens_kv=torch.tensor([0, 16], dtype=torch.int32), max_seqlen_q=16, max_seqlen_kv=16))
    (call,) = fake.calls
    assert call.entry == "flash_attn_usp_func"
    assert call.args["ulysses_group"] is parallel_state.get_context_parallel_group()
    ring = call.args["ring_group"]
    assert ring is singleton_ring_group() and ring is not torch.distributed.group.WORLD
    assert torch.distributed.get_process_group_ranks(ring) == [torch.distributed.get_rank()]
    assert call.args["dropout_p"] == 0.0


def test_attention_dropout_with_context_parallel_is_refused_at_build_time():
    """B30-cp: the usp entries assert dropout_p == 0; the module is never built."""
    with fake_primus_turbo() as fake:
        with pytest.raises(UnsupportedConfigError, match="B30-cp|dropout_p == 0") as err:
            PrimusTurboLocalAttention(gpt.config(context_parallel_size=2, kv_channels=16, attention_dropout=0.1), 1,
                                      AttnMaskType.causal, "self", cp_comm_type="a2a", settings=DIRECT)
        assert "B30-cp" in err.value.codes
        assert {"attention_dropout", "context_parallel_size"} <= set(err.value.settings)
        assert "attention_dropout: 0.0" in str(err.value)
        # The same dropout at CP 1 builds (flash_attn_func takes dropout).
        PrimusTurboLocalAttention(gpt.config(kv_channels=16, attention_dropout=0.1), 1, AttnMaskType.causal,
                                  "self", settings=DIRECT)
    assert fake.calls == []


@pytest.mark.parametrize("heads, groups", [(4, 1), (2, 2), (6, 3)])
def test_heads_not_divisible_by_the_context_parallel_size_are_refused(heads, groups):
    """cp-heads: Ulysses splits both head counts across the CP group."""
    cfg = gpt.config(context_parallel_size=2, kv_channels=16, hidden_size=16 * heads, num_attention_heads=heads,
                     num_query_groups=groups)
    with fake_primus_turbo():
        if heads % 2 or groups % 2:
            with pytest.raises(UnsupportedConfigError) as err:
                PrimusTurboLocalAttention(cfg, 1, AttnMaskType.no_mask, "self", cp_comm_type="p2p", settings=DIRECT)
            assert "cp-heads" in err.value.codes
            assert {"num_attention_heads", "num_query_groups", "context_parallel_size"} <= set(err.value.settings)
        else:
            PrimusTurboLocalAttention(cfg, 1, AttnMaskType.no_mask, "self", cp_comm_type="p2p", settings=DIRECT)


def test_context_parallel_runner_needs_both_groups():
    """The usp entries get both groups, never None, and no other entry gets any."""
    usp = DirectEntries(dense="flash_attn_usp_func", packed=None, sink_dense=False, sink_packed=False,
                        takes_window=True)
    plain = DirectEntries(dense="flash_attn_func", packed=None, sink_dense=True, sink_packed=False,
                          takes_window=True)
    with fake_primus_turbo() as fake:
        for groups in ({}, {"ulysses_group": object()}, {"ulysses_group": object(), "ring_group": None}):
            with pytest.raises(AssertionError, match="invariant"):
                DirectRunner(fake.module, usp, groups)
        with pytest.raises(AssertionError, match="invariant"):
            DirectRunner(fake.module, plain, {"ulysses_group": object(), "ring_group": object()})
        DirectRunner(fake.module, usp, {"ulysses_group": object(), "ring_group": object()})


def test_process_groups_never_meet_the_varlen_binding():
    """B28: an internal invariant, checked loudly."""
    entries = DirectEntries(dense="flash_attn_func", packed="flash_attn_varlen_func", sink_dense=True,
                            sink_packed=True, takes_window=True)
    with fake_primus_turbo() as fake:
        with pytest.raises(AssertionError, match="invariant"):
            DirectRunner(fake.module, entries, {"ulysses_group": object()})


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
