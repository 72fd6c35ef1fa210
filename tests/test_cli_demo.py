"""`primus-ext demo`: trains a tiny megatron-core GPT on the flex and direct paths.

The end-to-end runs happen in a subprocess: the demo creates (and tears down) its own
gloo world, which must not meet the process group of tests/megatron.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from primus_ext.cli import demo, demo_model, main
from primus_ext.settings import TurboAttentionSettings

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "configs" / "examples" / "demo.yaml"
PARITY = re.compile(r"^parity, step by step from identical parameters, flex vs ([\w-]+): max relative loss "
                    r"difference (\S+), max relative gradient difference (\S+) \(steps (\d+)\)$", re.M)
HAS_TURBO = importlib.util.find_spec("primus_turbo") is not None


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "primus_ext", "demo", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def embedded_text() -> str:
    return importlib.resources.files("primus_ext.cli").joinpath("demo.yaml").read_text(encoding="utf-8")


def test_the_embedded_default_and_the_example_are_identical():
    assert embedded_text() == EXAMPLE.read_text(encoding="utf-8")


def test_default_config_is_flex_with_window_sinks_on_dense_bf16_rows():
    config, _ = demo.load_config(None)
    settings = TurboAttentionSettings.from_dict(config)  # the `demo:` mapping is not refused
    assert settings.use_turbo_flex_attention and settings.use_sink_attention
    assert settings.sink_sliding_window > 0 and settings.sink_window_even_layers_only
    assert settings.turbo_flex_attention_backend == "auto"
    # B33: a sink on packed batches has no Turbo kernel on most shapes, so the demo is dense,
    # and in bf16 as Megatron trains on Turbo (the CPU demo itself computes in float32).
    assert config["packed_sequences"] is False and config["bf16"] is True
    assert "demo" not in settings.to_dict()
    assert demo_model.DemoOptions.from_mapping(config["demo"], config["seq_length"]).steps == 30


def test_demo_trains_both_paths_and_prints_parity_and_plans():
    proc = run_cli("--steps", "3")
    out = proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr
    match = PARITY.search(out)
    assert match, out
    assert match.group(1) == "direct" and float(match.group(2)) < 1e-5 and float(match.group(3)) < 1e-4
    assert match.group(4) == "3"
    # progress bar (final state) and the per-run summary
    assert re.search(r"^.*flex .*3/3 .*loss=\d+\.\d+, [\d,]+ tok/s", out, re.M), out
    assert re.search(r"direct .*3/3 .*loss=", out), out
    assert re.search(r"^flex path: loss \d+\.\d+ -> \d+\.\d+ over 3 steps", out, re.M), out
    # the plan of each layer: a window and a sink on layer 1, plain causal with a sink on layer 2
    assert re.search(r"^  layer 1: flex \| .*mask=window\(left=4, right=0\) \| sink", out, re.M), out
    assert re.search(r"^  layer 2: flex \| .*mask=causal \| sink", out, re.M), out
    if not HAS_TURBO:
        assert "direct path: Primus-Turbo flash_attn_* (CPU fake)" in out
        assert "direct kernels: flash_attn_func x6" in out  # 3 steps x 2 layers, dense rows
    assert "on cpu in float32 (the YAML's bf16 applies on a GPU)" in out or HAS_TURBO, out


def test_demo_on_packed_batches(tmp_path):
    config = tmp_path / "packed.yaml"
    config.write_text(EXAMPLE.read_text().replace("packed_sequences: false", "packed_sequences: true"))
    proc = run_cli(str(config), "--steps", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "THD packed" in proc.stdout
    assert float(PARITY.search(proc.stdout).group(2)) < 1e-5
    if not HAS_TURBO:
        assert "direct kernels: flash_attn_varlen_func x4" in proc.stdout


def _hook_config(tmp_path, left: int, right: int):
    path = tmp_path / "hook.yaml"
    text = EXAMPLE.read_text().replace("use_sink_attention: true", "use_sink_attention: false")
    text = text.replace("sink_sliding_window: 4", "sink_sliding_window: 0").replace(
        "turbo_flex_attention_backend: auto", "turbo_flex_attention_backend: turbo")
    path.write_text(text + "turbo_flex_attention_mask_mod: primus_ext.attention.masks:sliding_window\n"
                    f"turbo_flex_attention_mask_mod_kwargs: {{left: {left}, right: {right}}}\n")
    return path


@pytest.mark.parametrize("left, right, partner", [(4, 0, "direct"), (4, 4, "reference")])
def test_a_hook_is_compared_with_the_path_that_computes_it(tmp_path, left, right, partner):
    """A hook proven a causal window runs on the direct path as window_size; a two-sided one,
    which the direct path cannot express, is compared with the exact reference backend."""
    proc = run_cli(str(_hook_config(tmp_path, left, right)), "--steps", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    match = PARITY.search(proc.stdout)
    assert match and match.group(1) == partner, proc.stdout
    assert "cannot express" not in proc.stdout or partner == "reference"


def test_the_loss_falls_over_the_default_steps():
    # The README's promise: the default 30 steps visibly learn the counting corpus.
    proc = run_cli()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first, last = map(float, re.search(r"^flex path: loss (\S+) -> (\S+) over 30 steps", proc.stdout,
                                       re.M).groups())
    assert last < 0.5 * first, proc.stdout


def test_packed_batches_hold_whole_documents_with_restarting_positions():
    opts = demo_model.DemoOptions()
    batch = demo_model.make_batches(opts, 1, packed=True, seq_length=64)[0]
    cu = batch.cu_seqlens
    assert cu.dtype == torch.int32 and int(cu[0]) == 0 and int(cu[-1]) == opts.tokens_per_step
    assert batch.tokens.shape == batch.labels.shape == batch.positions.shape == (1, opts.tokens_per_step)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        assert batch.positions[0, start:end].tolist() == list(range(end - start))
        tokens, labels = batch.tokens[0, start:end], batch.labels[0, start:end]
        stride = int((labels[0] - tokens[0]) % opts.vocab_size)
        assert stride in demo_model.STRIDES
        assert torch.equal(labels, (tokens + stride) % opts.vocab_size)  # each label is the next count
    params = batch.packed_seq_params()
    assert params.qkv_format == "thd" and params.cu_seqlens_q is cu


def test_batches_are_the_same_for_the_same_seed():
    opts = demo_model.DemoOptions()
    a, b = (demo_model.make_batches(opts, 2, packed=True, seq_length=64) for _ in range(2))
    assert all(torch.equal(x.tokens, y.tokens) and torch.equal(x.cu_seqlens, y.cu_seqlens) for x, y in zip(a, b))


@pytest.mark.parametrize("mapping, words", [
    ({"stepz": 3}, "unknown key(s) under `demo`: stepz"),
    ({"steps": "many"}, "demo.steps must be a number"),
    ({"max_doc_len": 100}, "max_doc_len <= seq_length"),
])
def test_bad_demo_keys_exit_2_with_the_key_named(tmp_path, capsys, mapping, words):
    config, _ = demo.load_config(None)
    config["demo"] = {**config["demo"], **mapping}
    import yaml

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["demo", str(path)]) == 2
    assert words in capsys.readouterr().err


def test_a_config_without_the_flex_path_exits_2(tmp_path, capsys):
    path = tmp_path / "off.yaml"
    path.write_text(EXAMPLE.read_text().replace("use_turbo_flex_attention: true", "use_turbo_flex_attention: false"))
    assert main(["demo", str(path)]) == 2
    assert "use_turbo_flex_attention: true" in capsys.readouterr().err


def test_a_refused_layer_exits_2_with_its_reason(tmp_path):
    # A mask hook with packed batches: the document kernel takes no mask_mod (refused at build).
    path = tmp_path / "hook.yaml"
    path.write_text(EXAMPLE.read_text().replace(
        "use_sink_attention: true",
        'use_sink_attention: true\nturbo_flex_attention_mask_mod: "primus_ext.attention.masks:causal"\n'
        "turbo_flex_attention_mask_mod_kwargs: {}"))
    proc = run_cli(str(path), "--steps", "1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "primus_ext cannot build this attention (layer 1)" in proc.stderr
    assert "turbo_flex_attention_mask_mod" in proc.stderr and "when instantiating" not in proc.stderr
    assert "parity," not in proc.stdout


def _steps(losses, grad=1.0):
    return [demo_model.Step({}, loss, {"w": torch.full((2,), grad)}) for loss in losses]


def test_a_loss_mismatch_exits_1(monkeypatch, capsys):
    """The parity verdict, with the two training runs replaced by canned steps."""
    import contextlib

    runs = iter([(_steps([2.0, 1.0]), []), (_steps([2.0, 1.1]), [])])
    monkeypatch.setattr(demo_model, "single_process_world", contextlib.nullcontext)
    monkeypatch.setattr(demo, "_run", lambda *a, **k: next(runs))
    monkeypatch.setattr(demo, "_partner", lambda plans, s, cfg: ("direct", s, cfg, ""))
    assert demo.run_demo(None, 2) == 1
    captured = capsys.readouterr()
    assert "max relative loss difference 9.09e-02" in captured.out
    assert "MISMATCH" in captured.err and "step 2" in captured.err


def test_a_gradient_mismatch_alone_exits_1(monkeypatch, capsys):
    import contextlib

    runs = iter([(_steps([2.0, 1.0], grad=1.0), []), (_steps([2.0, 1.0], grad=1.01), [])])
    monkeypatch.setattr(demo_model, "single_process_world", contextlib.nullcontext)
    monkeypatch.setattr(demo, "_run", lambda *a, **k: next(runs))
    monkeypatch.setattr(demo, "_partner", lambda plans, s, cfg: ("direct", s, cfg, ""))
    assert demo.run_demo(None, 2) == 1
    assert "max relative gradient difference 9.90e-03" in capsys.readouterr().out


CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))
REFUSED = {"refused.yaml"}  # the deliberately refused example


@pytest.mark.parametrize("command", ["check", "demo"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_every_config_passes_check_and_demo(config, command, capsys):
    """Exit 0 for every config (a module fragment is explained), 2 with reasons for refused.yaml."""
    args = [command, str(config)] + (["--steps", "2"] if command == "demo" else [])
    code = main(args)
    out, err = capsys.readouterr()
    if config.name in REFUSED:
        assert code == 2 and err.strip(), out + err
        return
    assert code == 0, out + err
    assert "MISMATCH" not in err and "Traceback" not in err
    if "modules" in config.parts:
        assert "a module fragment" in out


@pytest.mark.parametrize("content, words", [
    (b"\xff\xfe num_layers: 2", "not UTF-8 text"),
    (b"", "the file is empty"),
    (b"num_layers: 2\nnum_layers: 3\n", "appears twice"),
    (b"- a\n- b\n", "must hold a mapping"),
])
@pytest.mark.parametrize("command", ["check", "demo"])
def test_unreadable_files_get_a_clear_error_not_a_traceback(tmp_path, capsys, content, words, command):
    path = tmp_path / "cfg.yaml"
    path.write_bytes(content)
    assert main([command, str(path)]) == 2
    assert words in capsys.readouterr().err


def test_eod_documents_demo_is_compared_with_megatrons_dense_mask(capsys):
    """Issue 12: EOD rows converted to THD train like megatron-core's own dense reset_attention_mask."""
    assert main(["demo", str(ROOT / "configs" / "examples" / "eod_documents.yaml"), "--steps", "3"]) == 0
    out = capsys.readouterr().out
    match = PARITY.search(out)
    assert match and match.group(1) == "dense-mask" and float(match.group(3)) < 1e-4, out
    assert "converted to packed THD" in out
