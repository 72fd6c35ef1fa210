"""docs/capabilities.md is true: every row is built and run, and must match the table."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from primus_ext.call.adapter import TurboFlexAttention
from primus_ext.errors import UnsupportedConfigError
from primus_ext.plan import LayerFacts, build_plan
from primus_ext.settings import TurboAttentionSettings
from primus_ext.testing import fake_primus_turbo

DOC = Path(__file__).resolve().parent.parent / "docs" / "capabilities.md"
SEQ = 256
MASKS = "primus_ext.attention.masks:"
NO_MASK = {"causal": False, "attn_mask_type": "no_mask"}
FP8_DIMS = {"head_dim": 32}
ALIBI_SINK = "ALiBi score hook + learned sinks (no arch checked; refused on gfx942 and gfx950, B33 below)"  # the fp8 backward asserts head dims >= 32 and even (rule fp8-head-dim)


def table() -> dict[str, list[str]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0] not in ("pattern", "---"):
            rows[cells[0]] = cells[2:]
    return rows


@dataclass
class Row:
    keys: dict = field(default_factory=dict)
    facts: dict = field(default_factory=dict)
    hook: bool = False
    build: str = "newest"


ROWS = {
    "causal": Row(),
    "causal sliding window (W, 0)": Row({"sink_sliding_window": 128}),
    "window with both bounds": Row({"turbo_flex_attention_mask_mod": MASKS + "sliding_window",
                                    "turbo_flex_attention_mask_mod_kwargs": {"left": 4, "right": 4}}, hook=True),
    "packed documents (THD input)": Row(facts={"packed": True}),
    "packed documents as a mask hook": Row({"turbo_flex_attention_mask_mod": MASKS + "packed_documents",
                                            "turbo_flex_attention_mask_mod_kwargs": {"cu_seqlens": [0, 100, SEQ]}},
                                           hook=True),
    "prefix-LM": Row({"turbo_flex_attention_mask_mod": MASKS + "prefix_lm",
                      "turbo_flex_attention_mask_mod_kwargs": {"prefix_length": 8}}, hook=True),
    "chunked local attention": Row({"turbo_flex_attention_mask_mod": MASKS + "chunked",
                                    "turbo_flex_attention_mask_mod_kwargs": {"chunk_size": 16}}, hook=True),
    "ALiBi as a score hook": Row({"turbo_flex_attention_score_mod": "tests.hook_examples:alibi"}, hook=True),
    "logit softcap": Row({"turbo_flex_attention_score_mod": "tests.hook_examples:softcap"}, hook=True),
    "ALiBi score hook, full attention": Row({"turbo_flex_attention_score_mod": "tests.hook_examples:alibi"},
                                            facts=NO_MASK, hook=True),
    "symmetric ALiBi score hook, full attention": Row(
        {"turbo_flex_attention_score_mod": "tests.hook_examples:symmetric_alibi"}, facts=NO_MASK, hook=True),
    # no arch is modelled in this table; on gfx942 / gfx950 the row is refused (tests/test_alibi_kernels.py)
    ALIBI_SINK: Row({"turbo_flex_attention_score_mod": "tests.hook_examples:alibi",
                                             "use_sink_attention": True}, hook=True),
    "fp8 + deterministic": Row({"enable_turbo_attention_float8": True, "deterministic_mode": True}, facts=FP8_DIMS),
    "context parallel, non-causal": Row(facts={"context_parallel_size": 2, "cp_comm_type": "a2a", **NO_MASK}),
    "context parallel + sinks + window": Row({"use_sink_attention": True, "sink_sliding_window": 128},
                                             facts={"context_parallel_size": 2, "cp_comm_type": "p2p"}),
    "context parallel + fp8": Row({"enable_turbo_attention_float8": True}, facts={"context_parallel_size": 2, **FP8_DIMS}),
    "context parallel + dropout": Row(facts={"context_parallel_size": 2, "attention_dropout": 0.1}),
    "context parallel + dropout, no RNG tracker": Row(facts={"context_parallel_size": 2, "attention_dropout": 0.1,
                                                             "rng_tracker": False}),
    "two-sided window on a causal layer": Row(facts={"window_size": (4, 4)}),
    "learned sinks": Row({"use_sink_attention": True}),
    "learned sinks + fp8": Row({"use_sink_attention": True, "enable_turbo_attention_float8": True}, facts=FP8_DIMS),
    "fp8": Row({"enable_turbo_attention_float8": True}, facts=FP8_DIMS),
    "context parallel": Row(facts={"context_parallel_size": 2, "cp_comm_type": "a2a"}),
    "packed + context parallel": Row(facts={"context_parallel_size": 2, "cp_comm_type": "a2a", "packed": True}),
    # Megatron's modules (megatron_mask): the core hands the adapter the mask's documents as THD
    "Megatron's document mask, dense batches": Row({"reset_attention_mask": True}, facts={"megatron_mask": True}),
    "document mask + context parallel": Row({"reset_attention_mask": True}, facts={
        "megatron_mask": True, "context_parallel_size": 2, "cp_comm_type": "a2a"}),
    "document mask + hooks": Row({"reset_attention_mask": True, "turbo_flex_attention_mask_mod": MASKS + "prefix_lm",
                                  "turbo_flex_attention_mask_mod_kwargs": {"prefix_length": 8}},
                                 facts={"megatron_mask": True}, hook=True),
    "documents from EOD, packed THD": Row({"reset_attention_mask": True}, facts={"packed": True}),
    "RL shared-prefix rows (no arch known here: turbo_arch names it, or the device)": Row(
        {"packed_shared_prefix": True}, facts={"packed": True}),
    "RL shared-prefix rows + window": Row({"packed_shared_prefix": True, "sink_sliding_window": 128,
                                           "sink_window_even_layers_only": False}, facts={"packed": True}),
    "ALiBi position embedding": Row(facts={"position_embedding_type": "alibi"}),
    "deterministic": Row({"deterministic_mode": True}),
    "deterministic, Primus-Turbo main": Row({"deterministic_mode": True}, build="main"),
    "packed documents, Primus-Turbo main": Row(facts={"packed": True}, build="main"),
    "causal sliding window, Primus-Turbo main": Row({"sink_sliding_window": 128}, build="main"),
    "packed sinks, build without varlen `sink`": Row({"use_sink_attention": True}, facts={"packed": True},
                                                     build="old"),
}
COLUMNS = ("turbo", "reference", "flex", "direct")


def outcome(row: Row, column: str) -> str:
    if column == "direct" and row.hook:
        return "n/a (hooks are flex-only)"
    keys: dict[str, Any] = {"use_turbo_attention": True, "use_turbo_flex_attention": column != "direct",
                            "turbo_flex_attention_backend": column if column in ("turbo", "flex") else "reference",
                            **row.keys}
    facts = LayerFacts(**{"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "seq_length": SEQ, **row.facts})
    with fake_primus_turbo(build=row.build) as fake:
        try:
            plan = build_plan(TurboAttentionSettings.from_dict(keys), facts)
        except UnsupportedConfigError as err:
            return "refused: " + ", ".join(err.codes)
        if column == "reference":
            return "runs"
        if column == "direct":
            return "runs: " + (plan.packed_entry if facts.packed or plan.mask_documents else plan.dense_entry)
        run = TurboFlexAttention(plan)
        if column == "flex":  # torch's real flex_attention, forward only (it has no CPU backward)
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _call(run, plan, facts)
            return "runs"
        return _call(run, plan, facts, fake)


def _call(run: TurboFlexAttention, plan: Any, facts: LayerFacts, fake: Any = None) -> str:
    """One call of ``plan`` as the layer makes it: ``runs: <the fake's entry>``, or ``runs`` off the fake."""
    sink = torch.zeros(4) if plan.sink else None
    hooked = plan.mask_mod is not None
    args = dict(causal=plan.causal and not hooked, window_size=(-1, -1) if hooked else plan.window, sink=sink)
    if facts.packed or plan.mask_documents:
        q = k = v = torch.randn(SEQ, 4, 16)
        cu = torch.tensor([0, 100, SEQ], dtype=torch.int32)
        run.varlen(q, k[:, :2], v[:, :2], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=156, max_seqlen_k=156, **args)
    else:
        q = torch.randn(1, SEQ, 4, 16)
        run(q, q[:, :, :2], q[:, :, :2], **args)
    return "runs: " + fake.calls[-1].entry if fake is not None else "runs"


def test_every_documented_row_is_tested():
    assert set(table()) == set(ROWS)


@pytest.mark.parametrize("name", list(ROWS))
def test_row_matches_the_code(name):
    documented = table()[name]
    for column, expected in zip(COLUMNS, documented):
        got = outcome(ROWS[name], column)
        if expected.startswith("refused: "):
            assert got.startswith("refused: ") and expected.split(": ")[1] in got, (column, got)
        else:
            assert got == expected, (column, got)
