"""`primus-ext demo`: trains a tiny megatron-core GPT on the flex path and compares it with a second
implementation (the direct path, the reference backend, or torch's flex_attention).

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
PARITY = re.compile(r"^parity, step by step from identical parameters, flex vs (?P<partner>[\w-]+) "
                    r"\((?P<mine>[^()]+) vs (?P<theirs>[^()]+)\): max relative loss difference (?P<loss>\S+), "
                    r"max relative gradient difference (?P<grad>\S+) \(steps (?P<steps>\d+)(?:; (?P<note>[^()]+))?\)$",
                    re.M)
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
    assert match["partner"] == "direct" and float(match["loss"]) < 1e-5 and float(match["grad"]) < 1e-4
    assert match["steps"] == "3" and match["note"] is None
    # the first line names the two implementations compared
    assert match["theirs"].startswith("Primus-Turbo flash_attn_*"), out
    assert match["mine"] == ("turbo backend" if HAS_TURBO else "reference backend"), out
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
    assert float(PARITY.search(proc.stdout)["loss"]) < 1e-5
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
    assert match and match["partner"] == partner, proc.stdout
    assert "cannot express" not in proc.stdout or partner == "reference"


PREFIX_LM = ROOT / "configs" / "examples" / "prefix_lm_hook.yaml"  # a mask hook on the reference backend


def _softcap_config(tmp_path):
    """The default demo (sinks, windows; auto) with a soft-cap score hook, which auto runs on reference here."""
    path = tmp_path / "softcap.yaml"
    path.write_text(EXAMPLE.read_text() + 'turbo_flex_attention_score_mod: "tests.hook_examples:softcap"\n')
    return path


@pytest.mark.parametrize("make", [lambda tmp: PREFIX_LM, _softcap_config], ids=["prefix-lm", "softcap-sinks"])
def test_a_hook_only_reference_runs_is_compared_with_torch_flex_attention(tmp_path, capsys, make):
    """The flex backend (torch's flex_attention) is the second implementation of a hook the reference
    backend ran; on the CPU the comparison is the loss only (torch's flex_attention has no CPU backward)."""
    assert main(["demo", str(make(tmp_path)), "--steps", "2"]) == 0
    out = capsys.readouterr().out
    match = PARITY.search(out)
    assert match, out
    assert match["partner"] == demo.FLEX and match["mine"] == "reference backend", out
    assert match["theirs"] == "torch's flex_attention", out
    assert float(match["loss"]) < 1e-4, out  # float32: two implementations' rounding
    assert "compared with: torch-flex (the hook ran on the exact reference backend" in out, out
    if "on cpu" in out:
        assert match["grad"] == "n/a" and match["note"].startswith(demo.FORWARD_ONLY), out
        assert "torch-flex path: loss" in out and "forward only (no gradients)" in out, out
    else:  # a GPU: loss and gradients, as for every other partner
        assert float(match["grad"]) < 1e-3 and match["note"] is None, out


def test_a_torch_flex_comparison_detects_a_different_attention(monkeypatch, capsys):
    """torch's flex_attention made to drop the hook's mask (full attention instead of prefix-LM): the
    demo's comparison sees it and exits 1, as for any parity failure.  Two steps: at the initial
    weights attention barely moves the loss (a gap near 5e-5); after one step it is above 1e-3."""
    from primus_ext.backends import flex as flex_backend

    real = flex_backend.flex_attention
    monkeypatch.setattr(flex_backend, "flex_attention",
                        lambda *args, **kwargs: real(*args, **{**kwargs, "block_mask": None}))
    assert main(["demo", str(PREFIX_LM), "--steps", "2"]) == 1
    captured = capsys.readouterr()
    match = PARITY.search(captured.out)
    assert match and match["partner"] == demo.FLEX and float(match["loss"]) > 1e-3, captured.out
    assert "MISMATCH" in captured.err and "vs torch-flex" in captured.err, captured.err


DYNAMIC = PREFIX_LM.read_text().replace('"primus_ext.attention.masks:prefix_lm"', '"tests.flex_hooks:typed_causal"')
DYNAMIC = "\n".join(line for line in DYNAMIC.splitlines() if "mask_mod_kwargs" not in line) + "\n"


@pytest.mark.parametrize("text, code", [
    (PREFIX_LM.read_text() + "attention_dropout: 0.1\n", "flex-dropout"),
    (PREFIX_LM.read_text() + "deterministic_mode: true\n", "flex-deterministic"),
    (DYNAMIC, "flex-dynamic"),  # a hook outside the provable subset (isinstance on torch.Tensor)
], ids=["dropout", "deterministic", "dynamic-hook"])
def test_a_hook_flex_refuses_is_compared_with_nothing_and_says_why(tmp_path, capsys, text, code):
    """The reference backend runs what the flex backend refuses (dropout, a deterministic backward,
    a dynamic hook): no second implementation, the plan's reason named, exit 0."""
    path = tmp_path / "refused_by_flex.yaml"
    path.write_text(text)
    assert main(["demo", str(path), "--steps", "1"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("compared with:"))
    assert line.startswith("compared with: nothing (the hook runs on the exact reference backend, its only "
                           "implementation here: torch's flex_attention, the second one, refuses it: "), out
    assert line.endswith(f"({code}))"), line
    assert "parity," not in out and "torch-flex path" not in out


def test_parity_of_a_forward_only_partner_compares_losses_only():
    flex, forward = _steps([2.0, 1.0]), [demo_model.Step({}, loss, {}) for loss in (2.0, 1.0 + 1e-3)]
    loss_gap, grad_gap, worst = demo.parity(flex, forward)
    assert grad_gap is None and worst == 2 and loss_gap == pytest.approx(1e-3 / 1.001)
    assert demo.parity(flex, _steps([2.0, 1.0]))[1] == 0.0


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


def _canned_runs(monkeypatch, flex, other, partner="direct"):
    """The two training runs of `run_demo` replaced by canned steps (no model is built)."""
    import contextlib

    runs = iter([flex, other])
    monkeypatch.setattr(demo_model, "single_process_world", contextlib.nullcontext)
    monkeypatch.setattr(demo, "_model", lambda *a, **k: None)
    monkeypatch.setattr(demo_model, "layer_plans", lambda model: [])
    monkeypatch.setattr(demo, "_run", lambda *a, **k: next(runs))
    monkeypatch.setattr(demo, "_partner", lambda plans, s, cfg: (partner, s, cfg, ""))


def test_a_loss_mismatch_exits_1(monkeypatch, capsys):
    """The parity verdict, with the two training runs replaced by canned steps."""
    _canned_runs(monkeypatch, _steps([2.0, 1.0]), _steps([2.0, 1.1]))
    assert demo.run_demo(None, 2) == 1
    captured = capsys.readouterr()
    assert "max relative loss difference 9.09e-02" in captured.out
    assert "MISMATCH" in captured.err and "step 2" in captured.err


def test_a_gradient_mismatch_alone_exits_1(monkeypatch, capsys):
    _canned_runs(monkeypatch, _steps([2.0, 1.0], grad=1.0), _steps([2.0, 1.0], grad=1.01))
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
    assert match and match["partner"] == "dense-mask" and float(match["grad"]) < 1e-4, out
    assert "converted to packed THD" in out
