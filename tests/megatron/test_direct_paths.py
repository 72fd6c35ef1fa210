"""Direct-path entries under context parallelism, the B28 invariant, and B20's default layout."""

from __future__ import annotations

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType

from primus_ext.backends.direct import DirectEntries, DirectRunner
from primus_ext.errors import UnsupportedInputError
from primus_ext.megatron import PrimusTurboLocalAttention
from primus_ext.testing import fake_primus_turbo
from tests import oracle
from tests.megatron import gpt
from tests.megatron.test_refusals import qkv_sbhd

DIRECT = gpt.settings()


@pytest.mark.parametrize("comm, group_kw", [("a2a", "ulysses_group"), ("p2p", "ring_group")])
def test_context_parallel_uses_usp_entry_with_its_group(comm, group_kw):
    q, k, v = qkv_sbhd()
    with fake_primus_turbo() as fake:
        module = PrimusTurboLocalAttention(gpt.config(context_parallel_size=2, kv_channels=16), 1,
                                           AttnMaskType.causal, "self", cp_comm_type=comm, settings=DIRECT)
        module(q, k, v, None)
        with pytest.raises(UnsupportedInputError, match="packed_seq_params"):
            module(q[:, 0], k[:, 0], v[:, 0], None, packed_seq_params=PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=torch.tensor([0, 16], dtype=torch.int32),
                cu_seqlens_kv=torch.tensor([0, 16], dtype=torch.int32), max_seqlen_q=16, max_seqlen_kv=16))
    (call,) = fake.calls
    assert call.entry == "flash_attn_usp_func"
    assert call.args[group_kw] is parallel_state.get_context_parallel_group()
    other = "ring_group" if group_kw == "ulysses_group" else "ulysses_group"
    assert call.args[other] is None


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
