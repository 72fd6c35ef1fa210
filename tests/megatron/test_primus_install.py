"""docs/primus.md's install and launch steps, run as written, beside a stand-in Primus on disk.

"Primus's environment" is a fresh virtual environment that sees what a Primus container holds
(torch and megatron-core, through a ``.pth`` to this checkout's environment; Primus-Turbo as the
CPU fake, which the stand-in's CLI installs) and a stand-in Primus package on disk: the config
tree of tests/megatron/primus_tree plus ``primus/__init__.py`` (the registry, spec provider and
runner of `primus_ext.testing.fake_primus`) and ``primus/cli/main.py`` (``train pretrain
--config EXP``: Primus's runtime phases, then a tiny GPT trained on CPU).  primus_ext is then
installed the recipe's way (``pip install --no-deps``) and launched through its launcher.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TREE = Path(__file__).resolve().parent / "primus_tree"
EXPERIMENT = "examples/megatron/configs/tiny_gpt-pretrain.yaml"

PRIMUS_INIT = '''"""A stand-in of AMD Primus (primus_ext's install test): primus_ext.testing.fake_primus."""
import sys

from primus_ext.testing import fake_primus

REGISTRY = fake_primus.populate(sys.modules[__name__])
'''

PRIMUS_MAIN = '''"""The stand-in's `primus/cli/main.py train pretrain --config EXP`."""
import argparse
import os
import sys

import torch

import primus
from primus_ext.testing import fake_primus as P, fake_primus_turbo


def main(argv):
    parser = argparse.ArgumentParser(prog="primus")
    parser.add_argument("command", choices=["train"])
    parser.add_argument("suite", choices=["pretrain"])
    parser.add_argument("--config", required=True)
    ns = parser.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    store = os.path.join(os.path.dirname(os.path.abspath(ns.config)), "..", "..", "..", "dist_store")
    torch.distributed.init_process_group("gloo", init_method="file://" + os.path.abspath(store), rank=0,
                                         world_size=1)  # what Primus's launch sets up
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    with fake_primus_turbo():  # the container's Primus-Turbo
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer.transformer_config import TransformerConfig

        module_config = P.primus_module(ns.config, root)
        P.apply_config_env(ns.config)  # Primus's runtime, after the configuration is loaded
        args = P.run_runtime(primus.REGISTRY, module_config)
        if os.environ.get("STANDIN_BYPASS") == "1":  # a bypass no check knows: the provider rebound after the patch
            provider = sys.modules[P.SPEC_PROVIDER_MODULE].PrimusTurboSpecProvider
            provider.core_attention = lambda self: primus.PRIMUS_ATTENTION
        cfg = TransformerConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                                num_attention_heads=args.num_attention_heads,
                                num_query_groups=args.num_query_groups, use_cpu_initialization=True,
                                attention_dropout=0.0, hidden_dropout=0.0, bias_activation_fusion=False,
                                masked_softmax_fusion=False, bias_dropout_fusion=False,
                                gradient_accumulation_fusion=False, apply_rope_fusion=False)
        torch.manual_seed(0)
        model = GPTModel(config=cfg, transformer_layer_spec=P.layer_spec(), vocab_size=64,
                         max_sequence_length=args.seq_length, position_embedding_type="learned_absolute")
        for layer in model.decoder.layers:
            print("layer", type(layer.self_attention.core_attention).__module__)
        print("applied", ",".join(primus.REGISTRY.applied))
        if os.environ.get("STANDIN_TRAIN", "1") == "1":  # megatron-core's own local attention needs CUDA
            tokens = torch.randint(0, 64, (2, args.seq_length))
            positions = torch.arange(args.seq_length).expand_as(tokens)
            opt = torch.optim.SGD(model.parameters(), lr=1e-2)
            for _ in range(2):
                loss = model(tokens, positions, None, labels=tokens).float().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            print("trained", round(loss.item(), 4))


if __name__ == "__main__":
    main(sys.argv[1:])
'''


def _run(cmd, cwd, env=None, timeout=300):
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def primus_env(tmp_path_factory):
    """A fresh venv with Primus's container's packages visible, and the stand-in Primus checkout."""
    root = tmp_path_factory.mktemp("install")
    venv = root / "venv"
    made = _run([sys.executable, "-m", "venv", str(venv)], cwd=root)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    target = _run([str(python), "-c", "import site; print(site.getsitepackages()[0])"], cwd=root).stdout.strip()
    Path(target, "primus_container.pth").write_text(site.getsitepackages()[0] + "\n")
    checkout = root / "Primus"
    shutil.copytree(TREE, checkout)
    (checkout / "primus" / "cli").mkdir(parents=True)
    (checkout / "primus" / "__init__.py").write_text(PRIMUS_INIT)
    (checkout / "primus" / "cli" / "__init__.py").write_text("")
    (checkout / "primus" / "cli" / "main.py").write_text(PRIMUS_MAIN)
    return python, checkout


def test_pip_install_no_deps_then_the_launcher_runs_primus_with_primus_ext_layers(primus_env):
    python, checkout = primus_env
    before = _run([str(python), "-c", "import primus_ext"], cwd=checkout.parent)
    assert before.returncode != 0  # a fresh environment: nothing of ours yet
    freeze_before = _run([str(python), "-m", "pip", "freeze"], cwd=checkout).stdout
    # The recipe: into Primus's environment, without dependencies (nothing replaces Primus's torch or Megatron).
    installed = _run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(REPO)], cwd=checkout)
    assert installed.returncode == 0, installed.stderr[-3000:]
    freeze_after = _run([str(python), "-m", "pip", "freeze"], cwd=checkout).stdout
    added = set(freeze_after.splitlines()) - set(freeze_before.splitlines())
    assert [line.split("@")[0].split("==")[0].strip() for line in added] == ["primus-ext"], added
    env = {**os.environ, "PYTHONPATH": str(checkout)}  # Primus exports its root
    env.pop("PRIMUS_PATCHES", None)
    launched = _run([str(python), "-m", "primus_ext.primus", "primus/cli/main.py", "train", "pretrain", "--config",
                     EXPERIMENT], cwd=checkout, env=env)
    assert launched.returncode == 0, launched.stderr[-3000:]
    lines = launched.stdout.splitlines()
    assert [line for line in lines if line.startswith("layer")] == ["layer primus_ext.megatron.local"] * 2
    assert "applied megatron.turbo.te_spec_provider,primus_ext.turbo_flex_attention" in lines
    assert any(line.startswith("trained") for line in lines)
    site_dir = _run([str(python), "-c", "import primus_ext; print(primus_ext.__file__)"], cwd=checkout).stdout
    assert str(REPO) not in site_dir  # the installed copy ran, not this checkout


def test_the_same_launch_without_the_launcher_leaves_primus_s_own_attention(primus_env):
    """What the launcher is for: Primus discovers no patch outside its package, so a plain launch trains
    with Primus's attention (the reason docs/primus.md says to launch through primus_ext.primus)."""
    python, checkout = primus_env
    env = {**os.environ, "PYTHONPATH": str(checkout), "STANDIN_TRAIN": "0"}
    env.pop("PRIMUS_PATCHES", None)
    plain = _run([str(python), "primus/cli/main.py", "train", "pretrain", "--config", EXPERIMENT], cwd=checkout,
                 env=env)
    if plain.returncode != 0 and "No module named 'primus_ext'" in plain.stderr:  # run alone, before the install
        _run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(REPO)], cwd=checkout)
        plain = _run([str(python), "primus/cli/main.py", "train", "pretrain", "--config", EXPERIMENT], cwd=checkout,
                     env=env)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert "applied megatron.turbo.te_spec_provider" in plain.stdout.splitlines()
    # Primus's own attention (the stand-in's class, defined in fake_primus), not primus_ext's modules
    assert [line for line in plain.stdout.splitlines() if line.startswith("layer")] == [
        "layer primus_ext.testing.fake_primus"] * 2


def test_docs_show_these_commands():
    text = (REPO / "docs" / "primus.md").read_text()
    assert "pip install --no-deps" in text
    assert textwrap.dedent("-m primus_ext.primus primus/cli/main.py train pretrain --config") in text


# ------------------------------------------------------------------ bypasses of the patch, at launch
def _launch_variant(primus_env, name: str, env_block: str = "", extra_env: dict | None = None):
    """Launch an experiment that is the tiny one with ``env_block`` (YAML lines) at its top."""
    python, checkout = primus_env
    _run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(REPO)], cwd=checkout)  # idempotent
    source = checkout / EXPERIMENT
    variant = source.with_name(f"{name}.yaml")
    text = source.read_text()
    owner = (extra_env or {}).get("STANDIN_OWNER")
    if owner:  # the owner key under the module's overrides
        text = text.replace("      use_turbo_flex_attention: true\n",
                            f"      use_turbo_flex_attention: true\n      turbo_flex_attention_owner: {owner}\n")
    variant.write_text(env_block + text)
    env = {**os.environ, "PYTHONPATH": str(checkout), **(extra_env or {})}
    env.pop("PRIMUS_PATCHES", None)
    return _run([str(python), "-m", "primus_ext.primus", "primus/cli/main.py", "train", "pretrain", "--config",
                 str(variant.relative_to(checkout))], cwd=checkout, env=env)


def test_primus_patches_in_the_experiment_env_block_is_refused_at_launch(primus_env):
    """Primus sets the experiment's env: after the launcher started; a filter there without our id
    would drop the patch before its condition (the layers Primus's own, exit 0)."""
    launched = _launch_variant(primus_env, "env_filter", "env:\n  PRIMUS_PATCHES: megatron.turbo.te_spec_provider\n")
    assert launched.returncode != 0
    assert "set by the env: block of examples/megatron/configs/env_filter.yaml" in launched.stderr
    assert "primus_ext.turbo_flex_attention" in launched.stderr and "trained" not in launched.stdout


def test_an_env_block_dropping_primus_s_provider_is_refused_by_the_condition(primus_env):
    launched = _launch_variant(primus_env, "env_provider", "env:\n  ONLY: primus_ext.turbo_flex_attention\n"
                               "  PRIMUS_PATCHES: $ONLY\n")  # expanded as Primus expands it (${ONLY} must be set at its load)
    assert launched.returncode != 0
    assert "UnsupportedConfigError" in launched.stderr and "megatron.turbo.te_spec_provider" in launched.stderr
    assert "trained" not in launched.stdout


def test_a_bypass_no_check_knows_stops_at_the_first_forward(primus_env):
    """Something rebinds Primus's provider after the patch: the model is built with Primus's own
    attention, and the launcher's check of the built model stops the run before step 1."""
    launched = _launch_variant(primus_env, "bypass", extra_env={"STANDIN_BYPASS": "1"})
    assert launched.returncode != 0
    assert [line for line in launched.stdout.splitlines() if line.startswith("layer")] == [
        "layer primus_ext.testing.fake_primus"] * 2
    assert "UnsupportedConfigError" in launched.stderr and "decoder.layers.0.self_attention" in launched.stderr
    assert "use_turbo_flex_attention is true, but 2 of the model's 2 attention layers" in launched.stderr
    assert "trained" not in launched.stdout


def test_an_env_block_without_the_filter_launches_as_before(primus_env):
    launched = _launch_variant(primus_env, "env_other", "env:\n  NCCL_DEBUG: WARN\n")
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert [line for line in launched.stdout.splitlines() if line.startswith("layer")] == [
        "layer primus_ext.megatron.local"] * 2


def test_a_primus_with_its_own_flex_path_makes_the_launch_name_the_owner(primus_env):
    """Primus PR #1033 gives Primus a use_turbo_flex_attention of its own: the launcher refuses the
    ambiguity; with the owner named, the run is primus_ext's or Primus's, as named."""
    _, checkout = primus_env
    own = checkout / "primus" / "backends" / "megatron" / "core" / "extensions" / "turbo_flex_attention.py"
    own.parent.mkdir(parents=True, exist_ok=True)
    own.write_text('"""A stand-in of Primus\'s own flex path."""\n')
    try:
        refused = _launch_variant(primus_env, "two_owners")
        assert refused.returncode != 0 and "this Primus has its own use_turbo_flex_attention path" in refused.stderr
        assert "turbo_flex_attention_owner: primus_ext" in refused.stderr and "layer" not in refused.stdout
        ours = _launch_variant(primus_env, "owner_ours", extra_env={"STANDIN_OWNER": "primus_ext"})
        assert ours.returncode == 0, ours.stderr[-3000:]
        assert [line for line in ours.stdout.splitlines() if line.startswith("layer")] == [
            "layer primus_ext.megatron.local"] * 2
        theirs = _launch_variant(primus_env, "owner_primus",
                                 extra_env={"STANDIN_OWNER": "primus", "STANDIN_TRAIN": "0"})
        assert theirs.returncode == 0, theirs.stderr[-3000:]
        assert [line for line in theirs.stdout.splitlines() if line.startswith("layer")] == [
            "layer primus_ext.testing.fake_primus"] * 2
    finally:
        shutil.rmtree(checkout / "primus" / "backends")
