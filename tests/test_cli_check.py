"""``primus-ext check``: every shipped example, the table, the refusals, the pictures.

The examples are taken from the directory listing, so a new ``configs/examples/*.yaml``
is checked without editing this file.  Files named ``refused*.yaml`` must be refused
(exit 2, every reason printed); every other example must run (exit 0).
"""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from primus_ext.cli import main
from primus_ext.errors import UnsupportedConfigError
from primus_ext.megatron.facts import layer_facts
from primus_ext.plan import build_plan
from primus_ext.settings import TurboAttentionSettings
from primus_ext.testing.fake_turbo import fake_primus_turbo

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "configs" / "examples"
EXAMPLES = sorted(EXAMPLES_DIR.glob("*.yaml"))

# What the shipped refusal must name, written out by hand (not derived from the code).
EXPECTED_REFUSALS = {
    "refused.yaml": ("use_turbo_flex_attention", "use_turbo_attention", "cp_comm_type",
                     "context_parallel_size",
                     "reset_attention_mask"),
}

FLEX = {"use_turbo_attention": True, "use_turbo_flex_attention": True}
SHAPE = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4}


def is_refused_example(path: Path) -> bool:
    return path.name.startswith("refused")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["check", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def write_yaml(tmp_path: Path, name: str = "cfg.yaml", **keys: Any) -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(keys))
    return str(path)


# ---------------------------------------------------------------------------- parsers
def table_rows(out: str) -> list[dict[str, str]]:
    """The plan table as dicts, cut at the column starts the header's rule shows."""
    lines = out.splitlines()
    rule_at = next(i for i, line in enumerate(lines) if re.fullmatch(r"-+( +-+)*", line))
    starts = [m.start() for m in re.finditer(r"-+", lines[rule_at])]
    bounds = list(zip(starts, starts[1:] + [None]))
    header = [lines[rule_at - 1][a:b].strip() for a, b in bounds]
    rows = []
    for line in lines[rule_at + 1:]:
        if not line.strip():
            break
        rows.append({h: line[a:b].strip() for h, (a, b) in zip(header, bounds)})
    return rows


def grids(out: str) -> dict[str, dict[str, Any]]:
    """Every ASCII picture: title -> positions, sink flag and the allowed matrix."""
    found: dict[str, dict[str, Any]] = {}
    title = None
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if i + 1 < len(lines) and lines[i + 1].startswith("  q x kv = "):  # a picture's title
            title = line
            found[title] = {"positions": [], "sink": [], "rows": []}
            continue
        m = re.fullmatch(r"\s+(\d+) \| (.*)", line)
        if m and title is not None:
            cells = m.group(2).split(" ")
            grid = found[title]
            grid["positions"].append(int(m.group(1)))
            grid["sink"].append(cells[0] == "S")
            cells = cells[1:] if cells[0] == "S" else cells
            assert set(cells) <= {"#", "."}, line
            grid["rows"].append([c == "#" for c in cells])
    return found


def only_grid(out: str) -> dict[str, Any]:
    pictures = grids(out)
    assert len(pictures) == 1, list(pictures)
    return next(iter(pictures.values()))


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the PNG signature and IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


# ---------------------------------------------------------------------------- examples
def test_the_examples_cover_the_documented_cases():
    names = {p.name for p in EXAMPLES}
    for required in ("plain_causal.yaml", "gpt_oss_sinks.yaml", "packed_documents.yaml",
                     "prefix_lm_hook.yaml", "refused.yaml"):
        assert required in names
    assert yaml.safe_load((EXAMPLES_DIR / "packed_documents.yaml").read_text())["packed_sequences"] is True


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_each_example_starts_with_a_comment(example):
    assert example.read_text().lstrip().startswith("#"), f"{example.name}: say what it shows first"


@pytest.mark.parametrize("example", [p for p in EXAMPLES if not is_refused_example(p)], ids=lambda p: p.name)
def test_runnable_example_prints_one_row_per_layer(example, capsys):
    config = yaml.safe_load(example.read_text())
    code, out, err = run(capsys, str(example))
    assert code == 0, err
    rows = table_rows(out)
    assert [r["layer"] for r in rows] == [str(n) for n in range(1, config["num_layers"] + 1)]
    for row in rows:
        assert row["path"] in ("flex", "direct")
        assert row["backend"] and row["causal"] and row["sink"] in ("yes", "no")
    assert grids(out), "no pattern picture printed"


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
@pytest.mark.parametrize("example", [p for p in EXAMPLES if not is_refused_example(p)], ids=lambda p: p.name)
def test_runnable_example_runs_on_both_archs_and_says_on_which_kernel(example, arch, capsys):
    """B33: each runnable example has a kernel on MI300 and MI355, and check --arch names it."""
    code, out, err = run(capsys, str(example), "--arch", arch)
    assert code == 0, err
    assert re.search(rf"^kernels on {arch} \(Primus-Turbo build a6a16cd\): .*(FlyDSL|AITER|HipKittens)", out, re.M) or "backend reference" in out, out


@pytest.mark.parametrize("example", [p for p in EXAMPLES if is_refused_example(p)], ids=lambda p: p.name)
def test_refused_example_exits_2_with_every_reason(example, capsys):
    config = yaml.safe_load(example.read_text())
    code, out, err = run(capsys, str(example))
    assert code == 2
    rows = table_rows(out)
    assert len(rows) == config["num_layers"]
    assert all(r["path"] == "REFUSED" for r in rows)
    for name in EXPECTED_REFUSALS.get(example.name, ()):
        assert name in err, f"{name} not reported"
    # Every reason of every layer, as build_plan words it, with its alternative.
    settings = TurboAttentionSettings.from_dict(config)
    for layer in range(1, config["num_layers"] + 1):
        with pytest.raises(UnsupportedConfigError) as info:
            build_plan(settings, layer_facts(config, layer))
        for reason in info.value.reasons:
            assert reason.render() in err
            assert reason.alternative
    assert "Alternative:" in err


def test_refusals_shared_by_layers_are_reported_once(capsys):
    code, _, err = run(capsys, str(EXAMPLES_DIR / "refused.yaml"))
    assert code == 2
    assert err.count("reset_attention_mask=True") == 1
    assert "(layers 1, 2): 3 reasons" in err


# ---------------------------------------------------------------------------- table
def test_gpt_oss_table_and_kinds(capsys):
    code, out, _ = run(capsys, str(EXAMPLES_DIR / "gpt_oss_sinks.yaml"))
    assert code == 0
    rows = table_rows(out)
    assert [r["window"] for r in rows] == ["(128, 0)", "-", "(128, 0)", "-"]
    assert all(r["sink"] == "yes" and r["causal"] == "yes" and r["packing"] == "unpacked" for r in rows)
    titles = list(grids(out))
    assert len(titles) == 2
    assert titles[0].startswith("layers 1, 3: window(left=128, right=0)")
    assert titles[1].startswith("layers 2, 4: causal")


def test_layers_sharing_facts_reuse_one_plan_under_their_own_numbers(tmp_path):
    from primus_ext.cli.check import _plans

    config = {**SHAPE, **FLEX, "num_layers": 5, "seq_length": 32, "use_sink_attention": True,
              "sink_sliding_window": 4, "sink_window_even_layers_only": True}
    settings = TurboAttentionSettings.from_dict(config)
    for layer, plan in _plans(settings, config):
        assert plan == build_plan(settings, layer_facts(config, layer))


def test_packed_example_uses_only_the_packed_entry(capsys):
    code, out, _ = run(capsys, str(EXAMPLES_DIR / "packed_documents.yaml"))
    assert code == 0
    for row in table_rows(out):
        assert row["packing"] == "packed (thd)"
        assert row["dense entry"] == "-" and row["packed entry"] not in ("-", "none")
    assert "inside each packed document" in out


def test_hook_column_says_what_the_hook_was_recognised_as(tmp_path, capsys):
    cfg = write_yaml(tmp_path, **SHAPE, **FLEX, seq_length=12,
                     turbo_flex_attention_mask_mod="primus_ext.attention.masks:sliding_window",
                     turbo_flex_attention_mask_mod_kwargs={"left": 3})
    code, out, _ = run(capsys, cfg)
    assert code == 0
    for row in table_rows(out):
        assert row["hooks (proven as)"].endswith("sliding_window -> window(left=3, right=0) [proven]")
        assert row["window"] == "(3, 0)"


def test_direct_path_runs_when_turbo_imports_and_explains_when_it_does_not(tmp_path, capsys):
    cfg = write_yaml(tmp_path, **SHAPE, seq_length=8, use_turbo_attention=True)
    with fake_primus_turbo():
        code, out, _ = run(capsys, cfg)
    assert code == 0
    assert {r["path"] for r in table_rows(out)} == {"direct"}
    code, out, err = run(capsys, cfg)  # no Primus-Turbo on this machine
    assert code == 2
    assert "use_turbo_attention" in err and "Primus-Turbo" in err


def test_some_layers_refused_others_shown(tmp_path, capsys):
    # A mask hook plus a window on the odd layers only: layers 1 and 3 refused (B11).
    cfg = write_yaml(tmp_path, **{**SHAPE, "num_layers": 3}, **FLEX, seq_length=8,
                     turbo_flex_attention_mask_mod="primus_ext.attention.masks:causal",
                     turbo_flex_attention_mask_mod_kwargs={},
                     sink_sliding_window=2, sink_window_even_layers_only=True)
    code, out, err = run(capsys, cfg)
    assert code == 2
    assert [r["path"] for r in table_rows(out)] == ["REFUSED", "flex", "REFUSED"]
    assert list(grids(out)) == ["layer 2: causal (mask_mod primus_ext.attention.masks:causal)"]
    assert "(layer 1)" in err and "(layer 3)" in err and "sink_sliding_window" in err


def test_misspelled_turbo_key_exits_2_with_the_settings_error(tmp_path, capsys):
    cfg = write_yaml(tmp_path, **SHAPE, **FLEX, use_turbo_flex_atention=True)
    code, out, err = run(capsys, cfg)
    assert code == 2
    assert "use_turbo_flex_atention" in err and "did you mean `use_turbo_flex_attention`" in err
    assert out == ""


def test_missing_model_keys_exit_2(tmp_path, capsys):
    cfg = write_yaml(tmp_path, **FLEX, num_layers=2)
    code, _, err = run(capsys, cfg)
    assert code == 2
    assert "num_attention_heads" in err and "hidden_size" in err


# ---------------------------------------------------------------------------- ascii pictures
def test_causal_grid_is_lower_triangular(tmp_path, capsys):
    cfg = write_yaml(tmp_path, **SHAPE, **FLEX, seq_length=10)
    code, out, _ = run(capsys, cfg)
    assert code == 0
    grid = only_grid(out)
    assert grid["positions"] == list(range(10))
    assert grid["rows"] == [[kv <= q for kv in range(10)] for q in range(10)]
    assert not any(grid["sink"])


@pytest.mark.parametrize("width", [1, 3, 5])
def test_window_grid_band_is_w_plus_one_wide(tmp_path, capsys, width):
    cfg = write_yaml(tmp_path, **SHAPE, **FLEX, seq_length=14, sink_sliding_window=width,
                     sink_window_even_layers_only=False)
    code, out, _ = run(capsys, cfg)
    assert code == 0
    rows = only_grid(out)["rows"]
    for q, row in enumerate(rows):
        allowed = [kv for kv, ok in enumerate(row) if ok]
        assert allowed == list(range(max(0, q - width), q + 1))
    assert max(sum(row) for row in rows) == width + 1


def test_long_sequences_are_sampled_with_a_stride(capsys):
    code, out, _ = run(capsys, str(EXAMPLES_DIR / "gpt_oss_sinks.yaml"))
    assert code == 0
    window = grids(out)[next(t for t in grids(out) if t.startswith("layers 1, 3"))]
    assert window["positions"] == list(range(0, 512, 32))
    assert max(sum(row) for row in window["rows"]) == 128 // 32 + 1


def test_sink_column_only_when_the_layer_has_a_sink(tmp_path, capsys):
    _, out, _ = run(capsys, str(EXAMPLES_DIR / "gpt_oss_sinks.yaml"))
    assert all(all(g["sink"]) for g in grids(out).values())
    _, out, _ = run(capsys, str(EXAMPLES_DIR / "plain_causal.yaml"))
    assert not any(any(g["sink"]) for g in grids(out).values())
    # Megatron's own softmax_type: learnable is a sink too.
    cfg = write_yaml(tmp_path, **SHAPE, **FLEX, seq_length=6, softmax_type="learnable")
    _, out, _ = run(capsys, cfg)
    assert all(only_grid(out)["sink"])


def test_custom_mask_is_drawn_from_its_mask_mod(capsys):
    code, out, _ = run(capsys, str(EXAMPLES_DIR / "prefix_lm_hook.yaml"))
    assert code == 0
    grid = only_grid(out)
    pos = grid["positions"]
    for q, row in zip(pos, grid["rows"]):
        assert row == [kv < 64 or kv <= q for kv in pos]


def test_seq_len_changes_the_picture_not_the_verdict(capsys):
    code, out, _ = run(capsys, str(EXAMPLES_DIR / "plain_causal.yaml"), "--seq-len", "8")
    assert code == 0 and "seq_length 8 (--seq-len)" in out
    assert only_grid(out)["positions"] == list(range(8))
    # prefix-LM over 64 tokens: the verdict is a proof, the same at every length; only the
    # picture follows --seq-len (at 32 tokens every key it shows is in the prefix).
    _, out, _ = run(capsys, str(EXAMPLES_DIR / "prefix_lm_hook.yaml"))
    assert table_rows(out)[0]["hooks (proven as)"].endswith("-> custom (evaluated exactly) [admitted]")
    _, out, _ = run(capsys, str(EXAMPLES_DIR / "prefix_lm_hook.yaml"), "--seq-len", "32")
    assert table_rows(out)[0]["hooks (proven as)"].endswith("-> custom (evaluated exactly) [admitted]")
    grid = only_grid(out)
    assert grid["positions"] == list(range(0, 32, 2))
    assert all(all(row) for row in grid["rows"])


def test_bad_seq_len_is_an_error(capsys):
    code, _, err = run(capsys, str(EXAMPLES_DIR / "plain_causal.yaml"), "--seq-len", "0")
    assert code == 2 and "--seq-len" in err


# ---------------------------------------------------------------------------- png
def test_picture_is_a_png_with_one_panel_per_layer_kind(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="--picture needs matplotlib (the cli extra)")
    two_kinds = tmp_path / "gpt_oss.png"
    one_kind = tmp_path / "prefix.png"
    assert main(["check", str(EXAMPLES_DIR / "gpt_oss_sinks.yaml"), "--picture", str(two_kinds)]) == 0
    assert main(["check", str(EXAMPLES_DIR / "prefix_lm_hook.yaml"), "--picture", str(one_kind)]) == 0
    assert f"written to {two_kinds}" in capsys.readouterr().out
    (w2, h2), (w1, h1) = png_size(two_kinds), png_size(one_kind)
    assert w1 >= 300 and h1 >= 300
    assert w2 > w1 and h2 == h1  # two panels side by side
    from matplotlib.image import imread

    pixels = imread(str(two_kinds))
    assert pixels.shape[:2] == (h2, w2)
    assert pixels.std() > 0.05  # not a blank canvas


def test_picture_of_a_refused_config_is_not_written(tmp_path, capsys):
    png = tmp_path / "refused.png"
    assert main(["check", str(EXAMPLES_DIR / "refused.yaml"), "--picture", str(png)]) == 2
    assert not png.exists()
    assert "no layer can run" in capsys.readouterr().out


def test_a_hook_naming_a_program_is_refused_and_never_run(tmp_path, capsys):
    # B32: `check` only names hooks; subprocess.run with a shell command must not run.
    pwned = tmp_path / "pwned"
    cfg = write_yaml(tmp_path, **SHAPE, **FLEX, seq_length=8,
                     turbo_flex_attention_mask_mod="subprocess:run",
                     turbo_flex_attention_mask_mod_kwargs={"args": f"touch {pwned}", "shell": True})
    code, _, err = run(capsys, cfg)
    assert not pwned.exists()
    assert code == 2
    assert "turbo_flex_attention_mask_mod" in err and "'subprocess:run'" in err
    assert "standard-library" in err and "(B32)" in err and "Alternative:" in err


@pytest.mark.parametrize("arch", [None, "gfx942", "gfx950"])
@pytest.mark.parametrize("example", [p for p in EXAMPLES if not is_refused_example(p)], ids=lambda p: p.name)
def test_check_and_the_megatron_model_built_from_the_example_agree(example, arch, capsys):
    """What ``check [--arch]`` prints for an example is what building megatron-core's GPTModel from
    it (the demo's own config reading, the fake presenting that arch) gives: the same per-layer
    kernels, or a refusal in both."""
    from primus_ext.cli.check import _plans
    from primus_ext.cli.demo_model import build_gpt, layer_plans, single_process_world, transformer_config

    config = yaml.safe_load(example.read_text())
    if arch is not None:
        config["turbo_arch"] = arch
    settings = TurboAttentionSettings.from_dict(config)
    with fake_primus_turbo(arch=arch):
        checked = _plans(settings, config)
        with single_process_world():
            try:
                model = build_gpt(transformer_config(config), settings, vocab_size=64,
                                  seq_length=int(config.get("seq_length") or 64), seed=0, device=torch.device("cpu"))
            except UnsupportedConfigError as refusal:
                assert any(isinstance(o, UnsupportedConfigError) for _, o in checked), refusal
                return
    assert not any(isinstance(o, UnsupportedConfigError) for _, o in checked), checked
    assert [p.kernels for p in layer_plans(model)] == [o.kernels for _, o in checked]
    assert [p.storage for p in layer_plans(model)] == [o.storage for _, o in checked]
