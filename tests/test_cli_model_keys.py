"""``primus-ext check`` reads every model key with a typed reader, and refuses what megatron-core refuses.

Each malformed value exits 2 with our message naming the key (no traceback, no wrong plan): window values that
are strings, of three entries, floats or one number; a ``window_attn_skip_freq`` of 0, a string, a list of the
wrong length or a float; heads megatron-core does not divide by ``tensor_model_parallel_size``; a hidden size
the heads do not divide (Megatron-LM refuses it; megatron-core rounds the head dim down); a dropout that is a
word.  What megatron-core refuses is asked of megatron-core's own ``TransformerConfig``, so the two cannot
drift: the test reads megatron-core's message from megatron-core too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from megatron.core.transformer.transformer_config import TransformerConfig

from primus_ext.cli import main

BASE = {"use_turbo_attention": True, "use_turbo_flex_attention": True, "num_layers": 2, "hidden_size": 64,
        "num_attention_heads": 4, "seq_length": 64}
MALFORMED = {
    "window_size as a string": ({"window_size": "128,0"}, "window_size"),
    "window_size of three entries": ({"window_size": [128, 0, 5]}, "window_size"),
    "window_size of floats": ({"window_size": [12.5, 0]}, "window_size"),
    "window_size as one number": ({"window_size": 128}, "window_size"),
    "window_size of words": ({"window_size": ["a", "b"]}, "window_size"),
    "window_size below -1": ({"window_size": [-2, 0]}, "window_size"),
    "window_size empty": ({"window_size": []}, "window_size"),
    "window_size infinite": ({"window_size": [float("inf"), 0]}, "window_size"),
    "window_size a mapping": ({"window_size": {"left": 4}}, "window_size"),
    "window_attn_skip_freq a mapping": ({"window_size": [4, 0], "window_attn_skip_freq": {"a": 1}},
                                        "window_attn_skip_freq"),
    "window_attn_skip_freq of twos": ({"window_size": [4, 0], "window_attn_skip_freq": [2, 2]},
                                      "window_attn_skip_freq"),
    "window_attn_skip_freq 0": ({"window_size": [4, 0], "window_attn_skip_freq": 0}, "window_attn_skip_freq"),
    "window_attn_skip_freq a word": ({"window_size": [4, 0], "window_attn_skip_freq": "x"}, "window_attn_skip_freq"),
    "window_attn_skip_freq too short": ({"window_size": [4, 0], "window_attn_skip_freq": [1]},
                                        "window_attn_skip_freq"),
    "window_attn_skip_freq a float": ({"window_size": [4, 0], "window_attn_skip_freq": 1e300},
                                      "window_attn_skip_freq"),
    "attention_dropout a word": ({"attention_dropout": "high"}, "attention_dropout"),
    "attention_dropout 1": ({"attention_dropout": 1.0}, "attention_dropout"),
    "kv_channels 0": ({"kv_channels": 0}, "kv_channels"),
    "num_attention_heads a string": ({"num_attention_heads": "4"}, "num_attention_heads"),
    "num_layers 0": ({"num_layers": 0}, "num_layers"),
    "tensor_model_parallel_size true": ({"tensor_model_parallel_size": True}, "tensor_model_parallel_size"),
    "softmax_type misspelt": ({"softmax_type": "learned"}, "softmax_type"),
    "softmax_scale negative": ({"softmax_scale": -1.0}, "softmax_scale"),
    "cp_comm_type a number": ({"cp_comm_type": 2}, "cp_comm_type"),
    "hidden_size the heads do not divide": ({"hidden_size": 250}, "hidden_size"),
    "4 heads at TP 3": ({"tensor_model_parallel_size": 3}, "tensor_model_parallel_size"),
    "4 heads at TP 8": ({"tensor_model_parallel_size": 8}, "tensor_model_parallel_size"),
    "3 query groups at TP 2": ({"num_attention_heads": 6, "hidden_size": 96, "num_query_groups": 3,
                                "tensor_model_parallel_size": 2}, "num_query_groups"),
}


def _check(tmp_path: Path, capsys, keys: dict) -> tuple[int, str]:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({**BASE, **keys}))
    code = main(["check", str(path)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_model_key_exits_2_naming_it(tmp_path, capsys, case):
    keys, named = MALFORMED[case]
    code, text = _check(tmp_path, capsys, keys)
    assert code == 2, text
    assert f"[{named}" in text or f", {named}" in text, text
    assert "Traceback" not in text


def test_the_heads_refusal_is_megatron_cores_own(tmp_path, capsys):
    with pytest.raises(ValueError) as theirs:
        TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, tensor_model_parallel_size=3,
                          use_cpu_initialization=True)
    code, text = _check(tmp_path, capsys, {"tensor_model_parallel_size": 3})
    assert code == 2 and str(theirs.value) in text


def test_no_rank_is_planned_for_heads_megatron_core_would_not_split(tmp_path, capsys):
    """Regression: check exited 0 and printed rank head ranges that left heads 6-7 on no rank."""
    code, text = _check(tmp_path, capsys, {"num_attention_heads": 8, "tensor_model_parallel_size": 3})
    assert code == 2 and "rank 2: heads" not in text


def test_a_well_formed_yaml_still_runs(tmp_path, capsys):
    code, text = _check(tmp_path, capsys, {"window_size": [4, 0], "window_attn_skip_freq": 2,
                                           "tensor_model_parallel_size": 2, "attention_dropout": 0})
    assert code == 0, text


REVIEW = {
    "window bound 2**31": ({"window_size": [2 ** 31, 0]}, "window_size"),
    "window bound 2**63": ({"window_size": [2 ** 63, 0]}, "window_size"),
    "window bound 10**23": ({"window_size": [10 ** 23, 0]}, "window_size"),
    "seq_length 10**23": ({"seq_length": 10 ** 23}, "seq_length"),
    "bf16 and fp16": ({"bf16": True, "fp16": True}, "bf16"),
    "MLA without its head dims": ({"multi_latent_attention": True}, "qk_head_dim"),
}
"""Found by a hostile review: each exited 0 with a wrong plan, gave a traceback, or named other keys."""


@pytest.mark.parametrize("case", list(REVIEW))
def test_a_value_the_review_found_exits_2_naming_its_key(tmp_path, capsys, case):
    keys, named = REVIEW[case]
    code, text = _check(tmp_path, capsys, keys)
    assert code == 2 and "Traceback" not in text, text
    line = next(l for l in text.splitlines() if l.strip().startswith("- ["))
    assert named in line.split("]")[0], line


def test_sequence_parallel_at_tp_1_is_not_refused(tmp_path, capsys):
    """Megatron-LM's validate_args turns sequence_parallel off at TP 1 (Primus's language_model.yaml sets it true
    for every model): check refused every TP-1 Primus experiment, GPT-OSS-20B's included."""
    code, text = _check(tmp_path, capsys, {"sequence_parallel": True})
    assert code == 0, text
    code, text = _check(tmp_path, capsys, {"sequence_parallel": True, "tensor_model_parallel_size": 2})
    assert code == 0, text


def test_a_huge_seq_len_option_is_ours(tmp_path, capsys):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(BASE))
    assert main(["check", str(path), "--seq-len", str(10 ** 23)]) == 2
    assert "--seq-len" in capsys.readouterr().err


def test_group_query_attention_off_plans_one_key_value_head_per_query_head(tmp_path, capsys):
    """Megatron-LM passes num_query_groups on only with group_query_attention: a YAML keeping the number with
    GQA off builds MHA there (check planned 2 groups, and refused 3 groups at TP 2 though Megatron builds it)."""
    code, text = _check(tmp_path, capsys, {"group_query_attention": False, "num_query_groups": 4})
    assert code == 0 and "4 query heads / 4 key-value groups, head dim" in text, text
    # a number of groups the run would not get is refused (gqa-off), not planned as written nor dropped unsaid
    code, text = _check(tmp_path, capsys, {"group_query_attention": False, "num_query_groups": 3,
                                           "tensor_model_parallel_size": 2})
    assert code == 2 and "[num_query_groups, group_query_attention]" in text, text


def test_multi_latent_attention_is_planned_with_its_own_head_dims(tmp_path, capsys):
    from primus_ext.megatron.facts import layer_facts

    config = {**BASE, "multi_latent_attention": True, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64,
              "v_head_dim": 128, "hidden_size": 512}
    facts = layer_facts(config, 1)
    assert (facts.head_dim, facts.v_dim) == (192, 128)
