"""One regression test per finding of the front door's third newcomer review (issue: the front door, round two).

Each test is a mistake a user made that ``check`` / ``selftest`` / ``demo`` accepted as a plan other than the
one the config asked for, or answered without naming the user's key; each failed on the commit reviewed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from primus_ext.cli import main

ROOT = Path(__file__).resolve().parents[1]
GPT_OSS = ROOT / "configs" / "examples" / "gpt_oss_sinks.yaml"


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def _yaml(tmp_path: Path, drop: tuple[str, ...] = (), **keys) -> str:
    data = {k: v for k, v in yaml.safe_load(GPT_OSS.read_text()).items() if k not in drop}
    data.update(keys)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize("command", [["check"], ["selftest"], ["demo", "--steps", "1"]])
def test_a_learned_sink_and_an_off_by_one_softmax_are_two_sources_for_one_sink(tmp_path, capsys, command):
    """megatron-core's off-by-one softmax made the sink a fixed zero buffer: use_sink_attention trained nothing."""
    path = _yaml(tmp_path, softmax_type="off-by-one")
    code, _, err = _run(capsys, command[0], path, *command[1:])
    assert code == 2 and "[use_sink_attention, softmax_type]" in err and "two sources for one sink" in err, err


@pytest.mark.parametrize("softmax_type", ["vanilla", "learnable"])
def test_a_learned_sink_with_a_learned_softmax_is_planned(tmp_path, capsys, softmax_type):
    code, _, err = _run(capsys, "check", _yaml(tmp_path, softmax_type=softmax_type))
    assert code == 0, err


@pytest.mark.parametrize("window", [{}, {"sink_sliding_window": 0}])
def test_window_attn_skip_freq_without_window_size_is_refused(tmp_path, capsys, window):
    """With sink_sliding_window the key was ignored (every odd layer windowed whatever it said); with no window at
    all it picks nothing: megatron-core applies it to window_size only."""
    path = _yaml(tmp_path, window_attn_skip_freq=2, **window)
    for command in ("check", "selftest"):
        code, _, err = _run(capsys, command, path)
        assert code == 2 and "[window_attn_skip_freq, window_size, sink_sliding_window]" in err, (command, err)
        assert ("sink_window_even_layers_only" in err.split("Alternative")[0]) == (not window), err


def test_window_attn_skip_freq_with_window_size_is_planned(tmp_path, capsys):
    path = _yaml(tmp_path, drop=("sink_sliding_window",), window_size=[128, 0], window_attn_skip_freq=2)
    code, out, err = _run(capsys, "check", path)
    assert code == 0, err


@pytest.mark.parametrize("alias, key, value", [
    ("num_key_value_heads", "num_query_groups", 4), ("head_dim", "kv_channels", 64),
    ("attn_dropout", "attention_dropout", 0.1), ("turbo_owner", "turbo_flex_attention_owner", "primus_ext"),
    ("mask_mod", "turbo_flex_attention_mask_mod", "x:y"), ("num_heads", "num_attention_heads", 4),
    ("use_sinks", "use_sink_attention", True), ("attention_window", "window_size", [64, 0]),
    ("window", "window_size", [64, 0]), ("n_layer", "num_layers", 4)])
def test_another_framework_s_name_for_a_key_is_refused_naming_megatron_s(tmp_path, capsys, alias, key, value):
    """num_key_value_heads: 4 planned the YAML's 2 query groups; head_dim: 64 planned kv_channels 32; exit 0."""
    path = _yaml(tmp_path, **{alias: value})
    for command in ("check", "selftest"):
        code, _, err = _run(capsys, command, path)
        assert code == 2 and f"[{alias}]" in err and f"rename it to {key}" in err, (command, err)


def test_every_alias_names_a_key_the_plans_read():
    from primus_ext.megatron.validate import ALIASES
    from primus_ext.settings.model_keys import READERS
    from primus_ext.settings.settings import SETTING_KEYS

    assert set(ALIASES.values()) <= set(READERS) | set(SETTING_KEYS)
    assert not set(ALIASES) & (set(READERS) | set(SETTING_KEYS))


@pytest.mark.parametrize("command", [["check"], ["selftest"], ["demo", "--steps", "1"]])
def test_extends_in_a_flat_yaml_is_refused(tmp_path, capsys, command):
    """extends: [base.yaml] in a Megatron YAML was ignored: the base file's keys never reached the plan."""
    (tmp_path / "base.yaml").write_text("num_query_groups: 8\n")
    path = _yaml(tmp_path, extends=["base.yaml"])
    code, _, err = _run(capsys, command[0], path, *command[1:])
    assert code == 2 and "[extends]" in err and "not a Primus experiment" in err, err


TREE = ROOT / "tests" / "megatron" / "primus_tree"
EXP = TREE / "examples" / "megatron" / "configs" / "tiny_gpt-pretrain.yaml"


def _model_file(tmp_path: Path, overrides_drop: tuple[str, ...], **keys) -> tuple[Path, Path]:
    import shutil

    root = tmp_path / "primus"
    shutil.copytree(TREE, root)
    model = root / "primus" / "configs" / "models" / "megatron" / "tiny_gpt.yaml"
    model.write_text(model.read_text() + "".join(f"{k}: {yaml.safe_dump(v).splitlines()[0]}\n" for k, v in keys.items()))
    exp = root / EXP.relative_to(TREE)
    data = yaml.safe_load(exp.read_text())
    for key in overrides_drop:
        data["modules"]["pre_trainer"]["overrides"].pop(key)
    exp.write_text(yaml.safe_dump(data, sort_keys=False))
    return root, exp


@pytest.mark.parametrize("key, value, drop", [("use_sink_attention", True, ("use_sink_attention",)),
                                              ("seq_length", 256, ("seq_length",))])
def test_a_model_file_key_the_module_file_sets_is_refused(tmp_path, capsys, monkeypatch, key, value, drop):
    """Primus adds a model file's key only where the module file lacks it: use_sink_attention: true in the model
    file planned no sink (primus_turbo.yaml's false won) with exit 0."""
    for name in ("PRIMUS_SEQ_LENGTH", "PRIMUS_TP", "PRIMUS_MODEL", "TOKENIZED_DATA_PATH", "PRIMUS_PATCHES"):
        monkeypatch.delenv(name, raising=False)
    root, exp = _model_file(tmp_path, drop, **{key: value})
    code, _, err = _run(capsys, "check", str(exp), "--primus-root", str(root))
    assert code == 2 and f"[{key}]" in err and "models/megatron/tiny_gpt.yaml" in err and "overrides" in err, err
    root, exp = _model_file(tmp_path / "kept", (), **{key: value})  # overrides set it: the model file's value is moot
    code, out, err = _run(capsys, "check", str(exp), "--primus-root", str(root))
    assert code == 0, err


@pytest.mark.parametrize("keys", [{"bf16": False, "params_dtype": "bf16"}, {"params_dtype": "fp32"},
                                  {"bf16": False, "fp16": True, "params_dtype": "torch.bfloat16"}])
def test_a_params_dtype_megatron_lm_overwrites_is_refused(tmp_path, capsys, keys):
    """bf16: false with params_dtype: bf16 planned bf16 kernels; Megatron-LM's validate_args trains it in fp32."""
    path = _yaml(tmp_path, **keys)
    for command in ("check", "selftest"):
        code, _, err = _run(capsys, command, path)
        assert code == 2 and "[params_dtype, bf16, fp16]" in err and "Megatron-LM" in err, (command, err)


def test_a_params_dtype_that_agrees_with_bf16_is_planned(tmp_path, capsys):
    code, _, err = _run(capsys, "check", _yaml(tmp_path, params_dtype="bfloat16"))
    assert code == 0, err


def test_check_s_header_shows_mla_s_heads_and_head_dims_as_the_layers_read_them(tmp_path, capsys):
    """The header said 8 query heads / 2 key-value groups under MLA, whose layers have 8 key-value heads."""
    path = _yaml(tmp_path, drop=("use_sink_attention", "sink_sliding_window"), multi_latent_attention=True,
                 qk_head_dim=64, qk_pos_emb_head_dim=64, v_head_dim=64, seq_length=64)
    code, out, err = _run(capsys, "check", path)
    assert code == 0, err
    assert out.splitlines()[0].endswith("8 query heads / 8 key-value groups, head dims q/k 128, v 64"), out


@pytest.mark.parametrize("keys, named, says", [
    ({"fp16": True}, "[bf16, fp16]", "keep one: bf16: true"),
    ({"cp_comm_type": ["a2a", "p2p"]}, "[cp_comm_type]", "lists 2 layers, but num_layers is 4")])
def test_megatron_s_refusals_name_the_keys_and_what_to_write(tmp_path, capsys, keys, named, says):
    """Both answered with megatron-core's message and a generic alternative about heads and TP."""
    code, _, err = _run(capsys, "check", _yaml(tmp_path, **keys))
    assert code == 2 and named in err and says in err and "divisible by tensor_model_parallel_size" not in err, err


@pytest.mark.parametrize("key, value", [("lr", -1), ("steps", 0), ("vocab_size", 2), ("tokens_per_step", 1)])
def test_a_demo_value_out_of_range_is_refused_naming_its_key(tmp_path, capsys, key, value):
    """demo: {lr: -1} was refused naming [demo] and all four bounds at once."""
    path = _yaml(tmp_path, demo={key: value})
    code, _, err = _run(capsys, "demo", path, "--steps", "1")
    assert code == 2 and f"[demo.{key}]" in err and f"for example {key}:" in err, err


def test_a_failed_selftest_names_the_layers_it_tested(capsys):
    """It said "layer 0 self-test"; Megatron's layers are numbered from 1."""
    code, _, err = _run(capsys, "selftest", str(GPT_OSS), "--fault", "aiter_corrupt_output", "--arch", "gfx942")
    assert code == 2 and "(layers 1-4 self-test)" in err and "layer 0" not in err, err


def test_the_demo_with_reset_attention_mask_on_dense_rows_points_at_the_demo_key(tmp_path, capsys):
    """It failed at the first call pointing at Megatron's dataloader (create_attention_mask_in_dataloader)."""
    path = _yaml(tmp_path, reset_attention_mask=True, packed_sequences=False, use_sink_attention=False)
    code, out, err = _run(capsys, "demo", path, "--steps", "1")
    assert code == 2 and "[reset_attention_mask]" in err and "eod_documents: true" in err, err
    assert "step 1" not in out


@pytest.mark.parametrize("argv", [["demo", "--steps", "0"], ["check", str(GPT_OSS), "--seq-len", "0"]])
def test_a_command_line_option_error_does_not_say_the_attention_cannot_be_built(capsys, argv):
    code, _, err = _run(capsys, *argv)
    assert code == 2 and err.startswith("primus-ext: cannot use this command-line option: [--"), err
    assert "cannot build this attention" not in err


# -- third review ----------------------------------------------------------------------------------------
DEMO = ROOT / "configs" / "examples" / "demo.yaml"


def _demo_yaml(tmp_path: Path, **keys) -> str:
    data = {**yaml.safe_load(DEMO.read_text()), **keys}
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_the_demo_turns_sequence_parallel_off_at_tp_1_as_check_does(tmp_path, capsys):
    """check accepted sequence_parallel: true at TP 1 (Megatron-LM turns it off); the demo crashed in
    megatron-core's ModelParallelConfig with a ValueError traceback."""
    path = _demo_yaml(tmp_path, sequence_parallel=True)
    code, out, err = _run(capsys, "demo", path, "--steps", "1")
    assert code == 0, err


@pytest.mark.parametrize("command", ["check", "selftest"])
def test_num_query_groups_with_group_query_attention_false_is_refused(tmp_path, capsys, command):
    """Planned 8 key-value heads without a word while the YAML listed num_query_groups: 2 (Megatron-LM drops it)."""
    path = _yaml(tmp_path, group_query_attention=False)
    code, _, err = _run(capsys, command, path)
    assert code == 2 and "[num_query_groups, group_query_attention]" in err and "group_query_attention: true" in err
    code, _, err = _run(capsys, command, _yaml(tmp_path, group_query_attention=False, num_query_groups=8))
    assert code == 0, err  # as many groups as heads: nothing dropped


@pytest.mark.parametrize("outer, inner", [("overrides", {"use_sink_attention": False, "sink_sliding_window": 64}),
                                          ("turbo", {"use_turbo_flex_attention": False}),
                                          ("language_model", {"num_query_groups": 8}),
                                          ("model", {"num_layers": 2})])
@pytest.mark.parametrize("command", [["check"], ["selftest"], ["demo", "--steps", "1"]])
def test_planned_keys_nested_in_a_flat_yaml_are_refused(tmp_path, capsys, outer, inner, command):
    """A Primus overrides: block copied into a flat YAML planned (and trained) without its keys, exit 0."""
    path = _demo_yaml(tmp_path, **{outer: inner})
    code, _, err = _run(capsys, command[0], path, *command[1:])
    assert code == 2 and f"[{outer}]" in err and "top level" in err, err


def test_the_settings_api_refuses_our_keys_nested_under_another(tmp_path):
    from primus_ext.errors import UnsupportedConfigError
    from primus_ext.settings import TurboAttentionSettings

    with pytest.raises(UnsupportedConfigError) as err:
        TurboAttentionSettings.from_yaml(_demo_yaml(tmp_path, overrides={"use_sink_attention": False}))
    assert err.value.settings == ("overrides",)


@pytest.mark.parametrize("demo, says", [({"use_sink_attention": False}, "[demo]"), ({"lr": -1}, "[demo.lr]")])
def test_check_and_selftest_refuse_what_the_demo_refuses_of_its_own_mapping(tmp_path, capsys, demo, says):
    """A Turbo key under demo: was refused by demo and planned (sinks on) by check and selftest."""
    path = _demo_yaml(tmp_path, demo=demo)
    for command in (["check"], ["selftest"], ["demo", "--steps", "1"]):
        code, _, err = _run(capsys, command[0], path, *command[1:])
        assert code == 2 and says in err, (command, err)


@pytest.mark.parametrize("freq", [1, [0, 0, 0, 0]])
def test_a_window_that_window_attn_skip_freq_gives_to_no_layer_is_refused(tmp_path, capsys, freq):
    """window_size: [64, 0] with window_attn_skip_freq: 1 planned full attention on every layer, exit 0."""
    path = _yaml(tmp_path, drop=("sink_sliding_window",), window_size=[64, 0], window_attn_skip_freq=freq)
    for command in ("check", "selftest"):
        code, _, err = _run(capsys, command, path)
        assert code == 2 and "[window_size, window_attn_skip_freq]" in err and "none of the model" in err, err


@pytest.mark.parametrize("command", ["check", "selftest"])
def test_turbo_only_keys_with_both_switches_off_are_refused(tmp_path, capsys, command):
    """Sinks and a sink window with both switches off: 'nothing of primus_ext to plan', exit 0, while
    Megatron's own attention (which the spec providers then build) has neither."""
    path = _yaml(tmp_path, use_turbo_attention=False, use_turbo_flex_attention=False)
    code, _, err = _run(capsys, command, path)
    assert code == 2 and "[use_sink_attention, use_turbo_attention]" in err and "sink_sliding_window: 128" in err


def test_the_spec_provider_refuses_turbo_only_keys_when_it_builds_megatron_s_own_attention():
    from primus_ext.errors import UnsupportedConfigError
    from primus_ext.megatron import PrimusTurboLocalSpecProvider
    from primus_ext.settings import TurboAttentionSettings

    with pytest.raises(UnsupportedConfigError) as err:
        PrimusTurboLocalSpecProvider(TurboAttentionSettings(use_sink_attention=True)).core_attention()
    assert err.value.codes == ("turbo-off",)
    PrimusTurboLocalSpecProvider(TurboAttentionSettings()).core_attention()  # nothing asked of Turbo: Megatron's


def test_check_says_which_flex_keys_the_direct_path_does_not_use(tmp_path, capsys):
    """turbo_flex_attention_backend: reference with flex off planned Turbo's flash entries without a word."""
    path = _yaml(tmp_path, use_turbo_flex_attention=False, turbo_flex_attention_backend="reference")
    code, out, err = _run(capsys, "check", path, "--arch", "gfx942")
    assert code == 0, err
    assert "not used: turbo_flex_attention_backend: reference (use_turbo_flex_attention is false" in out


@pytest.mark.parametrize("tokens", [10, 100])
def test_a_dense_demo_step_that_is_not_whole_rows_is_refused(tmp_path, capsys, tokens):
    """demo.tokens_per_step: 10 trained 64 tokens a step (one row of seq_length 64), printed only as a shape."""
    path = _demo_yaml(tmp_path, demo={"tokens_per_step": tokens})
    code, _, err = _run(capsys, "demo", path, "--steps", "1")
    assert code == 2 and "[demo.tokens_per_step]" in err and "multiple of seq_length" in err, err


def test_convert_checkpoint_refuses_a_missing_src_and_a_dtype_it_would_not_apply(tmp_path, capsys):
    """A mistyped SRC was called 'not a torch_dist checkpoint'; --params-dtype bf16 --to primus wrote float32."""
    code, _, err = _run(capsys, "convert-checkpoint", str(tmp_path / "nope"), str(tmp_path / "out"), "--to", "primus")
    assert code == 2 and "[SRC]" in err and "does not exist" in err, err
    (tmp_path / "ck").mkdir()
    code, _, err = _run(capsys, "convert-checkpoint", str(tmp_path / "ck"), str(tmp_path / "out"), "--to", "primus",
                        "--params-dtype", "bf16")
    assert code == 2 and "[--params-dtype]" in err, err


def test_an_arch_option_that_contradicts_the_yaml_s_turbo_arch_is_refused(tmp_path, capsys):
    """--arch gfx950 planned gfx950 without a word over the YAML's turbo_arch: gfx942, refused on that device."""
    path = _yaml(tmp_path, turbo_arch="gfx942")
    code, _, err = _run(capsys, "check", path, "--arch", "gfx950")
    assert code == 2 and "[--arch]" in err and "turbo_arch: gfx942" in err, err
    code, _, err = _run(capsys, "check", path, "--arch", "gfx942")
    assert code == 0, err


def test_a_factory_s_unknown_keyword_is_answered_with_the_ones_it_takes(tmp_path, capsys):
    path = _yaml(tmp_path, drop=("sink_sliding_window",),
                 turbo_flex_attention_mask_mod="primus_ext.attention.masks:sliding_window",
                 turbo_flex_attention_mask_mod_kwargs={"window": 64})
    code, _, err = _run(capsys, "check", path)
    assert code == 2 and "(it takes left, right=0)" in err, err


def test_reset_attention_mask_with_a_hook_offers_only_what_keeps_the_hook_working(tmp_path, capsys):
    """The alternative offered packed_sequences: true (which B17 refuses for a hook) and packed_equal_documents."""
    path = _yaml(tmp_path, drop=("sink_sliding_window",), reset_attention_mask=True,
                 turbo_flex_attention_mask_mod="primus_ext.attention.masks:prefix_lm",
                 turbo_flex_attention_mask_mod_kwargs={"prefix_length": 64})
    code, _, err = _run(capsys, "check", path)
    alternative = err.split("Alternative:", 1)[1]
    assert code == 2 and "remove the hooks" in alternative, err
    assert "packed_sequences: true" not in alternative and "packed_equal_documents" not in alternative
