"""Context parallelism without a world: the rows each rank holds, and what ``check`` says."""

from __future__ import annotations

import pytest
import torch

from tests.megatron.conftest import FakeGroup


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_the_rows_of_a_rank_are_the_positions_megatron_gives_it(cp):
    """`Ulysses.positions` (the mask rows) and `chunk_owner` (the reordering) are megatron-core's split."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    from primus_ext.backends.context_parallel import Ulysses, chunk_owner

    seq = 4 * cp
    got = {}
    for rank in range(cp):
        split = get_batch_on_this_cp_rank({"tokens": torch.arange(seq).view(1, seq)}, cp_group=FakeGroup(cp, rank))
        want = split["tokens"][0]
        assert torch.equal(Ulysses(None, cp, rank).positions(want.numel()), want), rank
        got[rank] = want.view(2, -1)
    chunks = [got[rank][half] for rank, half in (chunk_owner(k, cp) for k in range(2 * cp))]
    assert torch.equal(torch.cat(chunks), torch.arange(seq))


def test_check_says_every_cp_comm_type_runs_as_ulysses(tmp_path, capsys):
    """``primus-ext check``: per layer, what its cp_comm_type runs as (p2p and a2a+p2p: Ulysses, same numbers)."""
    import yaml

    from primus_ext.cli import main

    path = tmp_path / "cp.yaml"
    path.write_text(yaml.safe_dump(dict(
        num_layers=3, hidden_size=64, num_attention_heads=4, num_query_groups=2, seq_length=64,
        context_parallel_size=2, cp_comm_type=["p2p", "a2a+p2p", "a2a"], use_turbo_attention=True,
        use_turbo_flex_attention=True, turbo_flex_attention_backend="reference", use_sink_attention=True)))
    assert main(["check", str(path)]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("context parallel:")]
    assert len(notes) == 3, notes
    for layer, comm in ((1, "p2p"), (2, "a2a+p2p")):
        (note,) = [n for n in notes if n.startswith(f"context parallel: layer {layer}:")]
        assert f"cp_comm_type={comm} runs as Ulysses" in note and "the same numbers as a2a" in note
        assert "load-balanced chunks put in sequence order" in note and "cp-packed" in note
    (plain,) = [n for n in notes if n.startswith("context parallel: layer 3:")]
    assert "cp_comm_type=a2a runs as Ulysses" in plain and "the same numbers" not in plain
