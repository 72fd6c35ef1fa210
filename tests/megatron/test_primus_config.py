"""A Primus experiment YAML, merged as Primus merges it: ``primus-ext check`` reads the config the
Primus patch reads.

`primus_ext.settings.primus_config` (what ``check`` uses) and the stand-in's merge
(`primus_ext.testing.fake_primus_config`, written in Primus's own namespace style) are independent
implementations of Primus's rules; ``primus_tree/`` is a tiny Primus config tree in Primus's layout
(``primus_turbo.yaml``, ``pre_trainer.yaml``, ``module_base.yaml`` as upstream has them)."""

from __future__ import annotations

import importlib.util
import io
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from primus_ext.cli import config_input as config_input
from primus_ext.cli import main
from primus_ext.cli.check import run_check
from primus_ext.errors import UnsupportedConfigError
from primus_ext.primus import PATCH_ID, register
from primus_ext.primus import patch as primus_patch
from primus_ext.settings import TurboAttentionSettings
from primus_ext.settings.primus_config import read_experiment
from primus_ext.settings.primus_placement import shared_keys
from primus_ext.testing import fake_primus as P
from primus_ext.testing import fake_primus_config as PC

TREE = Path(__file__).resolve().parent / "primus_tree"
EXP = TREE / "examples" / "megatron" / "configs" / "tiny_gpt-pretrain.yaml"
OUR_MODULE_YAML = Path(__file__).resolve().parents[2] / "configs" / "modules" / "megatron" / "primus_ext_attention.yaml"
ENV = ("PRIMUS_SEQ_LENGTH", "PRIMUS_TP", "PRIMUS_MODEL", "TOKENIZED_DATA_PATH", "PRIMUS_PATCHES")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def tree_copy(tmp_path: Path, overrides: dict | None = None, **files: dict) -> tuple[Path, Path]:
    """A copy of the tree; ``overrides`` replace the experiment's, ``files`` (``primus_turbo=...``)
    update that module or model file's keys."""
    root = tmp_path / "primus"
    shutil.copytree(TREE, root)
    for name, extra in files.items():
        path = next(root.rglob(f"{name}.yaml"))
        path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), **extra}, sort_keys=False))
    experiment = root / EXP.relative_to(TREE)
    if overrides is not None:
        data = yaml.safe_load(experiment.read_text())
        data["modules"]["pre_trainer"]["overrides"] = overrides
        experiment.write_text(yaml.safe_dump(data))
    return root, experiment


def stand_in_params(experiment: Path, root: Path) -> dict:
    return PC.to_dict(P.primus_module(str(experiment), str(root)).params)


# ----------------------------------------------------------------------------- the merge
def test_the_merge_order_is_primus_s():
    merged = read_experiment(EXP, str(TREE))
    params, sources = merged.params, merged.sources
    assert (params["seq_length"], sources["seq_length"]) == (64, "modules.pre_trainer.overrides")  # over 1024, 4096
    assert (params["use_flash_attn"], sources["use_flash_attn"]) == (True, "modules/megatron/pre_trainer.yaml")
    assert (params["num_layers"], sources["num_layers"]) == (2, "models/megatron/tiny_gpt.yaml")  # over 24
    assert params["sink_window_even_layers_only"] is True and params["sink_level"] is None  # primus_turbo, module_base
    assert params["train_data_path"] is None  # "${TOKENIZED_DATA_PATH:null}" is "null", which Primus writes as None
    assert params["model"] == "tiny_gpt.yaml" and not {"name", "framework", "config", "overrides"} & set(params)
    assert merged.files == ("modules/module_base.yaml", "modules/megatron/primus_turbo.yaml",
                            "modules/megatron/trainer_base.yaml", "modules/megatron/pre_trainer.yaml",
                            "models/megatron/language_model.yaml", "models/megatron/tiny_gpt.yaml", str(EXP))


def test_the_module_file_wins_over_the_model_file(tmp_path):
    root, experiment = tree_copy(tmp_path, tiny_gpt={"micro_batch_size": 7, "ffn_hidden_size": 256})
    params = read_experiment(experiment, str(root)).params
    assert params["micro_batch_size"] == 2 and params["ffn_hidden_size"] == 256  # trainer_base's; the model's own
    assert stand_in_params(experiment, root) == params


def test_environment_variables_are_substituted_as_primus_does(monkeypatch):
    monkeypatch.setenv("PRIMUS_SEQ_LENGTH", "128")
    monkeypatch.setenv("PRIMUS_TP", "2")
    monkeypatch.setenv("TOKENIZED_DATA_PATH", "/data/x")
    params = read_experiment(EXP, str(TREE)).params
    got = (params["seq_length"], params["tensor_model_parallel_size"], params["train_data_path"])
    assert got == (128, 2, "/data/x")
    assert stand_in_params(EXP, TREE) == params


def test_an_unset_variable_without_a_default_is_refused(tmp_path):
    root, experiment = tree_copy(tmp_path, {"seq_length": "${PRIMUS_SEQ_LENGTH}"})
    with pytest.raises(UnsupportedConfigError) as err:
        read_experiment(experiment, str(root))
    assert err.value.settings == ("PRIMUS_SEQ_LENGTH",) and "${PRIMUS_SEQ_LENGTH:default}" in str(err.value)


@pytest.mark.parametrize("overrides", [
    {"use_turbo_flex_attention": "${FLEX:TRUE}", "kv_channels": "${KV:16}", "softmax_scale": "${S:0.5}",
     "turbo_arch": "123"},  # substituted text becomes bool / int / float; text without ${} stays a string
    {"turbo_flex_attention_mask_mod_kwargs": {"prefix_length": 8}, "window_size": [4, 0]},
])
def test_the_stand_in_s_merge_equals_check_s(tmp_path, overrides):
    root, experiment = tree_copy(tmp_path, {**yaml.safe_load(EXP.read_text())["modules"]["pre_trainer"]["overrides"],
                                            **overrides})
    params = read_experiment(experiment, str(root)).params
    assert stand_in_params(experiment, root) == params
    assert params.get("turbo_arch", "123") == "123" and params.get("use_turbo_flex_attention") is True


def test_extends_cycles_and_missing_files_are_refused(tmp_path):
    root, experiment = tree_copy(tmp_path)
    base = root / "primus" / "configs" / "modules" / "module_base.yaml"
    base.write_text("extends: megatron/pre_trainer.yaml\n" + base.read_text())  # a scalar extends, in a circle
    with pytest.raises(UnsupportedConfigError, match="extends itself"):
        read_experiment(experiment, str(root))
    base.write_text("extends: [nowhere.yaml]\ntrainable: false\n")
    with pytest.raises(UnsupportedConfigError, match="nowhere.yaml"):
        read_experiment(experiment, str(root))


def test_a_model_this_primus_lacks_is_refused_naming_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("PRIMUS_MODEL", "llama2_7B")
    with pytest.raises(UnsupportedConfigError) as err:
        read_experiment(EXP, str(TREE))
    assert err.value.settings == ("modules.pre_trainer.model",) and "--primus-root" in str(err.value)


# ----------------------------------------------------------------------------- where Primus is
def test_without_a_primus_root_or_an_installed_primus_check_refuses(monkeypatch, capsys):
    monkeypatch.delitem(sys.modules, "primus", raising=False)
    assert importlib.util.find_spec("primus") is None
    assert main(["check", str(EXP)]) == 2
    assert "--primus-root" in capsys.readouterr().err
    assert main(["check", str(EXP), "--primus-root", str(TREE / "examples")]) == 2
    assert "is not a Primus checkout" in capsys.readouterr().err


def test_the_installed_primus_package_s_configs_are_found(monkeypatch):
    monkeypatch.delitem(sys.modules, "primus", raising=False)
    monkeypatch.syspath_prepend(str(TREE))
    importlib.invalidate_caches()
    assert read_experiment(EXP).configs == str(TREE / "primus" / "configs")


def test_primus_root_is_for_experiments_only(capsys):
    assert main(["check", str(OUR_MODULE_YAML), "--primus-root", str(TREE)]) == 2
    assert "modules:" in capsys.readouterr().err


# ----------------------------------------------------------------------------- shared keys
def test_the_report_s_defaults_are_primus_ext_attention_yaml_s():
    ours = yaml.safe_load(OUR_MODULE_YAML.read_text())
    shared = shared_keys(read_experiment(EXP, str(TREE)))
    assert [s.key for s in shared] == ["use_turbo_attention", "use_sink_attention", "sink_sliding_window",
                                       "sink_window_even_layers_only", "enable_turbo_attention_float8",
                                       "use_turbo_autotune"]
    assert all(s.ours == ours[s.key] and not s.conflict for s in shared)


def _check(experiment: Path, root: Path, **kwargs) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    return run_check(str(experiment), out=out, err=err, primus_root=str(root), **kwargs), out.getvalue(), err.getvalue()


def test_check_prints_the_shared_keys_and_no_conflict():
    code, out, _ = _check(EXP, TREE)
    assert code == 0
    assert "Primus experiment, module pre_trainer (megatron)" in out
    assert "same defaults: use_turbo_attention, use_sink_attention" in out and "no conflicts" in out
    assert "2 layers, seq_length 64, 4 query heads / 2 key-value groups, head dim 16" in out


def test_a_key_both_define_with_another_default_is_reported_with_the_value_the_run_gets(tmp_path):
    root, experiment = tree_copy(tmp_path, primus_turbo={"sink_window_even_layers_only": False})
    code, out, _ = _check(experiment, root)
    assert code == 0  # reported, not refused: the layers read the merged value, which check plans with
    assert ("conflict: sink_window_even_layers_only: Primus's primus_turbo.yaml has false, primus_ext_attention.yaml "
            "true; this run's layers get false (from modules/megatron/primus_turbo.yaml)") in out
    assert "layers 1, 2: window(left=4, right=0)" in out  # every layer windowed, as the merged false says
    overrides = {**yaml.safe_load(EXP.read_text())["modules"]["pre_trainer"]["overrides"],
                 "sink_window_even_layers_only": True}
    root, experiment = tree_copy(tmp_path / "again", overrides, primus_turbo={"sink_window_even_layers_only": False})
    assert "this run's layers get true (from modules.pre_trainer.overrides)" in _check(experiment, root)[1]


# ----------------------------------------------------------------------------- check and the patch agree
def _patch_settings(monkeypatch, experiment: Path, root: Path) -> tuple[list, object]:
    """The settings the patch's condition and handler read when the stand-in runs Primus's runtime."""
    seen: list[TurboAttentionSettings] = []
    real = primus_patch.args_settings
    monkeypatch.setattr(primus_patch, "args_settings", lambda args: seen.append(real(args)) or seen[-1])
    with P.installed() as registry:
        register()
        args = P.run_runtime(registry, P.primus_module(str(experiment), str(root)))
        bound = P.layer_spec().submodules.self_attention.submodules.core_attention.keywords["settings"]
        assert registry.applied == ["megatron.turbo.te_spec_provider", PATCH_ID]
    return seen + [bound], args


def _check_settings(monkeypatch, experiment: Path, root: Path) -> TurboAttentionSettings:
    seen: list[TurboAttentionSettings] = []
    real = config_input.primus_run_settings
    monkeypatch.setattr(config_input, "primus_run_settings", lambda config: seen.append(real(config)) or seen[-1])
    code, out, err = _check(experiment, root)
    assert code == 0, out + err
    (settings,) = seen
    return settings


@pytest.mark.parametrize("overrides", [
    None,
    {"enable_primus_turbo": True, "use_turbo_attention": True, "use_turbo_flex_attention": True,
     "turbo_flex_attention_backend": "reference",
     "turbo_flex_attention_mask_mod": "primus_ext.attention.masks:prefix_lm",
     "turbo_flex_attention_mask_mod_kwargs": {"prefix_length": 8}, "seq_length": 32},
], ids=["sinks", "hook-kwargs"])
def test_check_reads_the_settings_the_patch_reads(monkeypatch, tmp_path, overrides):
    """The same files, two merges: the settings ``check`` plans with are those the patch's condition
    checks and its handler binds to the layers; every merged key is in Megatron's args, equal."""
    root, experiment = (TREE, EXP) if overrides is None else tree_copy(tmp_path, overrides)
    checked = _check_settings(monkeypatch, experiment, root)
    read, args = _patch_settings(monkeypatch, experiment, root)
    assert len(read) == 3 and all(s == checked for s in read)  # condition, handler, the layers' binding
    params = read_experiment(experiment, str(root)).params
    assert {k: PC.to_dict(getattr(args, k)) for k in params} == params  # a mapping reaches the args as a namespace


def test_a_run_primus_would_not_switch_on_is_refused_by_both_alike(monkeypatch, tmp_path):
    overrides = {**yaml.safe_load(EXP.read_text())["modules"]["pre_trainer"]["overrides"], "enable_primus_turbo": False}
    root, experiment = tree_copy(tmp_path, overrides)
    code, _, err = _check(experiment, root)
    assert code == 2 and "[enable_primus_turbo, use_turbo_flex_attention]" in err
    with P.installed() as registry, pytest.raises(UnsupportedConfigError) as refused:
        register()
        P.run_runtime(registry, P.primus_module(str(experiment), str(root)))
    assert refused.value.codes == ("primus-enable",) and refused.value.reasons[0].reason in err


def test_check_refuses_when_primus_patches_leaves_the_patch_out(monkeypatch):
    monkeypatch.setenv("PRIMUS_PATCHES", "megatron.turbo.te_spec_provider")
    code, _, err = _check(EXP, TREE)  # Primus drops the patch before its condition could refuse: check does
    assert code == 2 and f"leaves out {PATCH_ID}" in err and "(in the launching environment)" in err


def test_check_reads_the_experiment_s_env_block_as_primus_applies_it(tmp_path):
    root, experiment = tree_copy(tmp_path)
    experiment.write_text("env:\n  PRIMUS_PATCHES: megatron.turbo.te_spec_provider\n" + experiment.read_text())
    code, _, err = _check(experiment, root)
    assert code == 2 and f"leaves out {PATCH_ID}" in err and f"(set by the env: block of {experiment})" in err


# ----------------------------------------------------------------------------- the stand-in's runner
def _noop(ctx) -> None:
    return None


def test_the_runner_checks_every_condition_before_any_handler_and_keeps_ties_in_list_order():
    """patch_runner.py:102, :105; patch_registry.py:122-136: ties keep (backend, phase) list order
    first, registration order within a list, not the id."""
    events: list[str] = []
    registry = P.Registry()

    def add(pid: str, backend, priority: int) -> None:
        def condition(ctx) -> bool:
            events.append(f"if {pid}")
            return True
        registry.register_patch(pid, backend=backend, phase="before_train", condition=condition,
                                priority=priority)(lambda ctx: events.append(f"run {pid}"))

    add("z.any_backend", None, 50)
    add("b.megatron", "megatron", 50)
    add("a.megatron", "megatron", 50)
    add("first", "megatron", 10)
    registry.run_patches(backend="megatron", phase="before_train")
    assert events == ["if b.megatron", "if a.megatron", "if first", "if z.any_backend",
                      "run first", "run b.megatron", "run a.megatron", "run z.any_backend"]
    add("b.megatron", "megatron", 50)  # registered again: replaced, and last in its list
    events.clear()
    registry.run_patches(backend="megatron", phase="before_train")
    assert [e for e in events if e.startswith("run")] == ["run first", "run a.megatron", "run b.megatron",
                                                         "run z.any_backend"]


def test_the_runner_swallows_a_handler_s_error_and_honours_version_patterns():
    registry = P.Registry()
    registry.register_patch("old", backend="megatron", phase="setup", backend_versions=["<0.16"])(_noop)
    registry.register_patch("new", backend="megatron", phase="setup", backend_versions=[">=0.16.0"])(_noop)

    def fails(ctx) -> None:
        raise ImportError("no such package")

    registry.register_patch("fails", backend="megatron", phase="setup")(fails)
    assert registry.run_patches(backend="megatron", phase="setup", backend_version=P.backend_version()) == 1
    assert registry.applied == ["new"] and any("'fails' failed" in line for line in registry.log)
    assert P.version_in_range("0.16.1", "0.16.0~0.16.5") and P.version_in_range("0.16.1", "0.16.*")


def test_the_experiment_trains_with_primus_ext_on_every_layer_with_the_plans_check_printed(caplog):
    """The harness end to end: the experiment YAML, args built the Primus way, before_train patches,
    the GPT built through the spec provider, a few CPU steps; every layer is primus_ext's and runs the
    plan ``check`` printed for that YAML (build_plan logs each plan once: check's and the layers')."""
    import logging

    import torch
    from megatron.core.models.gpt import GPTModel

    from primus_ext.megatron import PrimusTurboLocalAttention
    from tests.megatron import gpt

    with caplog.at_level(logging.INFO, logger="primus_ext"):
        code, out, err = _check(EXP, TREE)
    assert code == 0, out + err
    checked = {r.getMessage() for r in caplog.records if r.getMessage().startswith("primus_ext layer")}
    caplog.clear()
    with P.installed() as registry, caplog.at_level(logging.INFO, logger="primus_ext"):
        register()
        args = P.run_runtime(registry, P.primus_module(str(EXP), str(TREE)))
        torch.manual_seed(0)
        model = GPTModel(config=gpt.config(num_layers=args.num_layers, hidden_size=args.hidden_size,
                                           num_attention_heads=args.num_attention_heads,
                                           num_query_groups=args.num_query_groups),
                         transformer_layer_spec=P.layer_spec(), vocab_size=gpt.VOCAB,
                         max_sequence_length=args.seq_length, position_embedding_type="learned_absolute")
    built = {r.getMessage() for r in caplog.records if r.getMessage().startswith("primus_ext layer")}
    layers = [layer.self_attention.core_attention for layer in model.decoder.layers]
    assert all(isinstance(m, PrimusTurboLocalAttention) for m in layers)
    assert {f"primus_ext {m.core.plan.describe()}" for m in layers} == built == checked
    assert {m.core.plan.sink for m in layers} == {True} and layers[0].core.plan.window == (4, 0)
    losses = gpt.train(model, gpt.batches(3, seq=args.seq_length))
    assert all(loss == loss for loss in losses) and losses[-1] < losses[0]


def test_check_refuses_a_key_this_primus_claims_too_until_the_owner_is_named(tmp_path):
    overrides = yaml.safe_load(EXP.read_text())["modules"]["pre_trainer"]["overrides"]
    root, experiment = tree_copy(tmp_path, overrides)
    own = root / "primus" / "backends" / "megatron" / "core" / "extensions" / "turbo_flex_attention.py"
    own.parent.mkdir(parents=True)
    own.write_text('"""Primus\'s own flex path (PR #1033)."""\n')
    code, _, err = _check(experiment, root)
    assert code == 2 and "this Primus has its own use_turbo_flex_attention path" in err and str(own) in err
    root2, named = tree_copy(tmp_path / "named", {**overrides, "turbo_flex_attention_owner": "primus"})
    (root2 / own.relative_to(root)).parent.mkdir(parents=True)
    (root2 / own.relative_to(root)).write_text("")
    code, out, _ = _check(named, root2)
    assert code == 0 and "turbo_flex_attention_owner is primus: primus_ext's patch stays out" in out
    root3, ours = tree_copy(tmp_path / "ours", {**overrides, "turbo_flex_attention_owner": "primus_ext"})
    code, out, _ = _check(ours, root3)  # this Primus has no flex path of its own: primus_ext's is the only one
    assert code == 0 and "layer" in out
