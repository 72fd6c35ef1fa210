"""primus_ext inside (a stand-in of) Primus: the patch, registered with Primus's own registry,
makes Primus's spec provider build primus_ext's attention, and refusals reach the user although
Primus swallows what a patch handler raises (`primus_ext.testing.fake_primus`)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import torch

from primus_ext.errors import UnsupportedConfigError
from primus_ext.megatron import PrimusTurboLocalAttention
from primus_ext.primus import PATCH_ID, PRIORITY, register
from primus_ext.primus import layer_check
from primus_ext.primus import patch as primus_patch
from primus_ext.testing import fake_primus_turbo
from primus_ext.testing import fake_primus as P
from primus_ext.testing.fake_megatron_lm import builder_layer_spec, parsed_args

from . import gpt

MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, tensor_model_parallel_size=1)
MODULE = {"enable_primus_turbo": True, "use_turbo_attention": True, "use_turbo_flex_attention": True,
          "turbo_flex_attention_backend": "reference"}


def build(args) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(0)
    return GPTModel(config=gpt.config(), transformer_layer_spec=P.layer_spec(), vocab_size=gpt.VOCAB,
                    max_sequence_length=gpt.SEQ * 4, position_embedding_type="learned_absolute")


def launch(module: dict, experiment: dict = MODEL) -> torch.nn.Module:
    """Primus's lifecycle with the patch registered: args built Primus's way, patches, model."""
    with P.installed() as registry:
        assert register()
        args = P.megatron_args(experiment, module)
        P.run_lifecycle(registry, args)
        model = build(args)
        launch.registry = registry
    return model


def attention(model) -> list:
    return [layer.self_attention.core_attention for layer in model.decoder.layers]


def test_the_patch_runs_after_primus_installs_its_provider():
    with P.installed() as registry:
        register()
        register()  # once per registry, however often it is called
        patch = registry.patches[PATCH_ID]
        assert (patch.backend, patch.phase, patch.priority) == ("megatron", "before_train", PRIORITY)
        assert PRIORITY > registry.patches["megatron.turbo.te_spec_provider"].priority


def test_every_layer_runs_primus_ext_and_trains():
    model = launch(MODULE)
    assert all(isinstance(m, PrimusTurboLocalAttention) for m in attention(model))
    assert [m.core.plan.path for m in attention(model)] == ["flex", "flex"]
    losses = gpt.train(model, gpt.batches(3))
    assert losses[-1] < losses[0]
    assert launch.registry.applied == ["megatron.turbo.te_spec_provider", PATCH_ID]


def test_the_flex_path_equals_the_direct_path_step_by_step():
    with fake_primus_turbo():
        flex = launch({**MODULE, "use_sink_attention": True, "sink_sliding_window": 4})
        direct = launch({"enable_primus_turbo": True, "use_turbo_attention": True, "use_turbo_flex_attention": True,
                         "turbo_flex_attention_backend": "turbo", "use_sink_attention": True,
                         "sink_sliding_window": 4})
        direct.load_state_dict(flex.state_dict())
        data = gpt.batches(3)
        torch.testing.assert_close(gpt.train(flex, data), gpt.train(direct, data), rtol=1e-5, atol=1e-6)


def test_with_only_use_turbo_attention_primus_runs_its_own():
    model = launch({"enable_primus_turbo": True, "use_turbo_attention": True})
    primus_own = sys.modules.get("primus")  # gone after the block: compare by name
    assert primus_own is None
    assert [type(m).__name__ for m in attention(model)] == ["PrimusTurboAttention", "PrimusTurboAttention"]
    assert launch.registry.applied == ["megatron.turbo.te_spec_provider"]


def test_flex_without_turbo_attention_is_refused_before_the_first_step():
    with pytest.raises(UnsupportedConfigError) as err:
        launch({"enable_primus_turbo": True, "use_turbo_flex_attention": True,
                "turbo_flex_attention_backend": "reference"})
    assert "B3" in err.value.codes and "use_turbo_attention" in err.value.settings


def test_a_bad_key_is_refused_through_the_condition_not_swallowed():
    with pytest.raises(UnsupportedConfigError) as err:
        launch({**MODULE, "turbo_flex_attention_backend": "fastest"})
    assert "turbo_flex_attention_backend" in err.value.settings


def test_a_primus_without_the_spec_provider_is_refused_not_silently_its_own(monkeypatch):
    monkeypatch.setattr(primus_patch, "SPEC_PROVIDER", "primus.no_such_module")
    with pytest.raises(UnsupportedConfigError) as err:
        launch(MODULE)
    assert err.value.codes == ("primus-provider",)


def test_primus_patches_filter_by_id(monkeypatch):
    monkeypatch.setenv("PRIMUS_PATCHES", "megatron.turbo.te_spec_provider")
    model = launch(MODULE)  # ours filtered out, as Primus filters its own: Primus's attention
    assert not any(isinstance(m, PrimusTurboLocalAttention) for m in attention(model))
    monkeypatch.setenv("PRIMUS_PATCHES", f"megatron.turbo.te_spec_provider,{PATCH_ID}")
    assert all(isinstance(m, PrimusTurboLocalAttention) for m in attention(launch(MODULE)))


def test_a_filter_without_primus_s_provider_patch_is_refused_not_silently_te(monkeypatch):
    """Only our id in PRIMUS_PATCHES: Primus would not install its spec provider, and megatron-core's
    TE provider would build the layers; the condition refuses it before the model is built."""
    monkeypatch.setenv("PRIMUS_PATCHES", PATCH_ID)
    with pytest.raises(UnsupportedConfigError) as err:
        launch(MODULE)
    assert err.value.codes == ("primus-enable",) and "PRIMUS_PATCHES" in err.value.settings


def test_flex_without_enable_primus_turbo_is_refused_not_silently_te():
    """Without Primus's switch its spec provider is never installed (the stand-in keeps megatron-core's)."""
    with pytest.raises(UnsupportedConfigError) as err:
        launch({k: v for k, v in MODULE.items() if k != "enable_primus_turbo"})
    assert err.value.codes == ("primus-enable",) and "enable_primus_turbo" in err.value.settings


def test_a_look_alike_key_is_refused_through_the_condition():
    with pytest.raises(UnsupportedConfigError) as err:
        launch({**MODULE, "use_turbo_flex_atention": True})
    assert "did you mean" in str(err.value)


def test_the_launcher_registers_and_runs_the_command(tmp_path, monkeypatch):
    script = tmp_path / "primus_main.py"
    script.write_text("import sys\nfrom primus.core.patches import run_patches\nRAN = sys.argv[1:]\n")
    with P.installed() as registry:
        from primus_ext.primus.__main__ import main

        try:
            main([str(script), "train", "--config", "exp.yaml"])
            assert PATCH_ID in registry.patches
            assert len(layer_check._installed) == 1  # the check of the built model, for this process
        finally:
            while layer_check._installed:  # this process goes on with other tests' models
                layer_check._installed.pop().remove()
    assert sys.argv[1:] == ["train", "--config", "exp.yaml"]


def test_the_launcher_says_what_is_missing_without_primus():
    from primus_ext.primus.__main__ import main

    sys.modules.pop("primus", None)
    with pytest.raises(SystemExit) as err:
        main(["-m", "json.tool"])
    assert "primus" in str(err.value)


@pytest.mark.parametrize("key", __import__("primus_ext.settings", fromlist=["SETTING_KEYS"]).SETTING_KEYS)
def test_every_key_reaches_the_modules_through_primus_merge(key):
    """Primus merges each module-YAML key into Megatron's args (no extra_args_provider); the patch
    binds the settings read from them to every layer its spec provider builds."""
    from tests.test_keys_reach_the_plan import _other_value

    value = _other_value(key)
    module = {"enable_primus_turbo": True, "use_turbo_flex_attention": True, key: value}
    if key == "sink_sliding_window":  # under Primus the window exists only with sinks (primus-window)
        module["use_sink_attention"] = True
    if key.endswith("_kwargs"):
        module[key.removesuffix("_kwargs")] = "tests.hook_examples:alibi"
    with P.installed() as registry:
        register()
        P.run_lifecycle(registry, P.megatron_args(MODEL, module))
        built = P.layer_spec().submodules.self_attention.submodules.core_attention
    assert getattr(built.keywords["settings"], key) == value


@pytest.fixture
def fresh_specs(monkeypatch):
    """primus_ext.primus.specs keeps a spec once built (Megatron's builder reads it with vars());
    each test here builds its own from its own args."""
    import primus_ext.primus.specs as specs

    for name in specs.SPECS:
        monkeypatch.delitem(vars(specs), name, raising=False)
    return specs


def spec_route(model: dict, module: dict) -> tuple:
    """A Primus run whose YAML names primus_ext's spec: Primus's lifecycle, then Megatron-LM's builder
    (its parsed args, ``import_module(args.spec)``) builds the model."""
    from megatron.core.models.gpt import GPTModel

    with P.installed() as registry:
        assert register()
        args = P.megatron_args(model, {**module, "spec": ["primus_ext.primus.specs", "gpt_layer_local_spec"]})
        P.run_lifecycle(registry, args)
        with parsed_args(args), fake_primus_turbo():
            spec = builder_layer_spec(args)
            torch.manual_seed(0)
            built = GPTModel(config=gpt.config(qk_layernorm=bool(getattr(args, "qk_layernorm", False))),
                             transformer_layer_spec=spec, vocab_size=gpt.VOCAB, max_sequence_length=gpt.SEQ * 4,
                             position_embedding_type="learned_absolute")
    return spec, built, args


def test_megatrons_spec_argument_builds_primus_ext_s_layers_from_the_run_s_args(fresh_specs):
    """The patch-free route: the spec Megatron's builder imports is built from the run's own args,
    with Primus's own keys (module_base.yaml's sink_level) read as Primus's, not as typos."""
    import functools

    from megatron.core.transformer.spec_utils import ModuleSpec

    spec, model, args = spec_route({**MODEL, "sink_level": None}, MODULE)
    assert isinstance(spec, ModuleSpec) and vars(fresh_specs)["gpt_layer_local_spec"] is spec
    core = spec.submodules.self_attention.submodules.core_attention
    assert isinstance(core, functools.partial) and core.func is PrimusTurboLocalAttention
    assert core.keywords["settings"] is None  # the keys come from Megatron's args when a layer is built
    assert all(isinstance(m, PrimusTurboLocalAttention) for m in attention(model))
    assert {m.core.plan.path for m in attention(model)} == {"flex"}  # use_turbo_flex_attention from the args


def test_the_spec_carries_the_run_s_qk_layernorm(fresh_specs):
    from megatron.core.transformer.identity_op import IdentityOp

    spec, model, _ = spec_route({**MODEL, "qk_layernorm": True}, MODULE)
    norms = [layer.self_attention.q_layernorm for layer in model.decoder.layers]
    assert not any(isinstance(n, IdentityOp) for n in norms)
    assert all(isinstance(m, PrimusTurboLocalAttention) for m in attention(model))


def test_a_moe_run_is_refused_through_the_builder_not_built_dense(fresh_specs):
    with pytest.raises(UnsupportedConfigError) as err:
        spec_route({**MODEL, "num_experts": 4}, MODULE)
    assert err.value.codes == ("primus-spec",) and "num_experts" in err.value.settings
    assert "gpt_layer_local_spec" not in vars(fresh_specs)


def test_the_bundled_megatron_s_open_signature_still_gets_every_setting(fresh_specs, monkeypatch):
    """Primus's bundled Megatron-LM (d3528a21) defines get_gpt_layer_local_spec(*args, **kwargs)."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.identity_op import IdentityOp

    real = gpt_layer_specs.get_gpt_layer_local_spec
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_local_spec", lambda *args, **kwargs: real(*args, **kwargs))
    _, model, _ = spec_route({**MODEL, "qk_layernorm": True}, MODULE)
    assert not any(isinstance(layer.self_attention.q_layernorm, IdentityOp) for layer in model.decoder.layers)


def test_a_spec_function_that_would_drop_a_setting_is_refused(fresh_specs, monkeypatch):
    from megatron.core.models.gpt import gpt_layer_specs

    real = gpt_layer_specs.get_gpt_layer_local_spec
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_local_spec", lambda num_experts=None: real(num_experts))
    with pytest.raises(UnsupportedConfigError) as err:
        spec_route({**MODEL, "qk_layernorm": True}, MODULE)
    assert err.value.codes == ("primus-spec",) and "qk_layernorm" in err.value.settings


@pytest.mark.parametrize("key, value", [("mtp_num_layers", 1), ("kitchen_config_file", "k.yaml")])
def test_what_the_builder_builds_apart_from_the_spec_is_refused(fresh_specs, key, value):
    with pytest.raises(UnsupportedConfigError) as err:
        spec_route({**MODEL, key: value}, MODULE)
    assert err.value.codes == ("primus-spec",) and key in err.value.settings


def test_the_te_spec_without_transformer_engine_is_our_error(fresh_specs, monkeypatch):
    from megatron.core.transformer.spec_utils import import_module

    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    with P.installed() as registry:
        register()
        args = P.megatron_args(MODEL, MODULE)
        P.run_lifecycle(registry, args)
        with parsed_args(args), pytest.raises(UnsupportedConfigError) as err:
            import_module(("primus_ext.primus.specs", "gpt_layer_te_spec"))
    assert err.value.codes == ("primus-spec",) and "TransformerEngine" in str(err.value)


def test_the_spec_without_parsed_args_is_refused(fresh_specs, monkeypatch):
    from megatron.core.transformer.spec_utils import import_module

    monkeypatch.setitem(sys.modules, "megatron.training", None)
    with pytest.raises(UnsupportedConfigError) as err:
        import_module(("primus_ext.primus.specs", "gpt_layer_local_spec"))
    assert err.value.codes == ("primus-spec",)


def test_a_proven_hook_runs_on_turbo_through_primus_and_equals_the_reference():
    """A user mask hook, proven equal to a window, runs on Turbo's fixed kernel in every layer Primus
    builds, step by step equal to the same hook evaluated by the reference backend."""
    hook = {"turbo_flex_attention_mask_mod": "tests.proof_hooks:gym_window"}
    with fake_primus_turbo() as fake:
        turbo = launch({**MODULE, **hook, "turbo_flex_attention_backend": "turbo"})
        assert {m.core.plan.mask_class for m in attention(turbo)} == {"proven"}
        reference = launch({**MODULE, **hook})
        reference.load_state_dict(turbo.state_dict())
        data = gpt.batches(3)
        torch.testing.assert_close(gpt.train(turbo, data), gpt.train(reference, data), rtol=1e-5, atol=1e-6)
        assert {c.entry for c in fake.calls} == {"flash_attn_func"}


@pytest.mark.no_primus_turbo
def test_without_primus_turbo_importable_primus_would_skip_its_provider_so_it_is_refused():
    with pytest.raises(UnsupportedConfigError) as err:
        launch(MODULE)
    assert "primus-enable" in err.value.codes and "primus_turbo is not importable" in str(err.value)


def test_a_megatron_core_primus_s_provider_patch_skips_is_refused(monkeypatch):
    monkeypatch.setattr(P, "backend_version", lambda: "0.17.0")
    with pytest.raises(UnsupportedConfigError) as err:
        launch(MODULE)
    assert "primus-enable" in err.value.codes and "below 0.17" in str(err.value)
    monkeypatch.setattr(P, "backend_version", lambda: None)  # unknown: Primus's version filter skips it too
    with pytest.raises(UnsupportedConfigError):
        launch(MODULE)


@pytest.mark.parametrize("extra,code,key", [
    ({"transformer_impl": "local"}, "primus-layers", "transformer_impl"),
    ({"spec": ["my_specs", "layer_spec"]}, "primus-layers", "spec"),
    ({"sink_sliding_window": 4}, "primus-window", "sink_sliding_window"),
    ({"reset_attention_mask": True, "create_attention_mask_in_dataloader": False}, "B25.no-mask",
     "create_attention_mask_in_dataloader"),
], ids=["local-impl", "own-spec", "window-without-sinks", "reset-mask-without-mask"])
def test_keys_that_would_not_mean_what_they_say_under_primus_are_refused_by_the_condition(extra, code, key):
    with pytest.raises(UnsupportedConfigError) as err:
        launch({**MODULE, **extra})
    assert code in err.value.codes and key in err.value.settings


def test_primus_ext_s_own_spec_passes_the_condition(fresh_specs):
    _, model, _ = spec_route(MODEL, MODULE)
    assert all(isinstance(m, PrimusTurboLocalAttention) for m in attention(model))


def test_the_launcher_refuses_a_primus_patches_list_without_its_patch(monkeypatch, tmp_path):
    from primus_ext.primus.__main__ import main as launcher

    script = tmp_path / "main.py"
    script.write_text("raise SystemExit('ran')\n")
    monkeypatch.setenv("PRIMUS_PATCHES", "megatron.turbo.te_spec_provider")
    with pytest.raises(SystemExit, match="leaves out primus_ext.turbo_flex_attention"):
        launcher([str(script)])
    with pytest.raises(SystemExit, match="no script"):
        launcher([str(tmp_path / "missing.py")])


def test_the_launcher_refuses_a_planned_key_primus_would_ignore(monkeypatch, tmp_path):
    """The patch's condition sees only the merged args; the launcher reads where each key was written."""
    import shutil

    import yaml

    from primus_ext.primus.__main__ import main as launcher

    tree = Path(__file__).resolve().parent / "primus_tree"
    shutil.copytree(tree, tmp_path / "primus_root")
    monkeypatch.syspath_prepend(str(tmp_path / "primus_root"))  # its primus/configs, as an installed Primus's
    monkeypatch.delitem(sys.modules, "primus", raising=False)
    for name in ("PRIMUS_SEQ_LENGTH", "PRIMUS_TP", "PRIMUS_MODEL", "TOKENIZED_DATA_PATH", "PRIMUS_PATCHES"):
        monkeypatch.delenv(name, raising=False)
    experiment = tmp_path / "primus_root" / "examples" / "megatron" / "configs" / "tiny_gpt-pretrain.yaml"
    data = yaml.safe_load(experiment.read_text())
    data["use_sink_attention"] = False  # at the top level: Primus never applies it, the overrides say true
    experiment.write_text(yaml.safe_dump(data))
    script = tmp_path / "main.py"
    script.write_text("raise SystemExit('ran')\n")
    with pytest.raises(SystemExit, match=r"\[use_sink_attention\] use_sink_attention: false is at the top level"):
        launcher([str(script), "train", "pretrain", "--config", str(experiment)])


# ------------------------------------------------------------------ two owners of use_turbo_flex_attention
@pytest.fixture
def primus_with_its_own_flex(monkeypatch):
    """A stand-in of a Primus that has its own flex path (Primus PR #1033's module)."""
    import types

    from primus_ext.settings.primus_owner import PRIMUS_FLEX_MODULE

    module = types.ModuleType(PRIMUS_FLEX_MODULE)
    module.__file__ = "/primus/backends/megatron/core/extensions/turbo_flex_attention.py"
    monkeypatch.setitem(sys.modules, PRIMUS_FLEX_MODULE, module)
    return module


def test_a_key_two_implementations_claim_is_refused_naming_both_choices(primus_with_its_own_flex):
    with pytest.raises(UnsupportedConfigError) as err:
        launch(MODULE)
    assert err.value.codes == ("primus-owner",) and "turbo_flex_attention_owner" in err.value.settings
    message = str(err.value)
    assert "turbo_flex_attention.py" in message and "turbo_flex_attention_owner: primus_ext" in message
    assert "turbo_flex_attention_owner: primus " in message


def test_owner_primus_ext_builds_primus_ext_s_layers(primus_with_its_own_flex):
    model = launch({**MODULE, "turbo_flex_attention_owner": "primus_ext"})
    assert all(isinstance(m, PrimusTurboLocalAttention) for m in attention(model))
    assert launch.registry.applied == ["megatron.turbo.te_spec_provider", PATCH_ID]


def test_owner_primus_leaves_the_layers_to_primus_s_own_path(primus_with_its_own_flex):
    model = launch({**MODULE, "turbo_flex_attention_owner": "primus"})
    assert [type(m).__name__ for m in attention(model)] == ["PrimusTurboAttention"] * 2
    assert launch.registry.applied == ["megatron.turbo.te_spec_provider"]
    assert layer_check._state["condition"] is False  # the check of the built model accepts Primus's layers


def test_owner_primus_without_primus_s_flex_path_is_refused():
    with pytest.raises(UnsupportedConfigError) as err:
        launch({**MODULE, "turbo_flex_attention_owner": "primus"})
    assert err.value.codes == ("primus-owner",) and "no flex attention path of its own" in str(err.value)


def test_owner_primus_on_a_layer_primus_ext_builds_is_refused_by_the_plan():
    with pytest.raises(UnsupportedConfigError) as err:
        gpt.build_gpt(gpt.settings(use_turbo_flex_attention=True, turbo_flex_attention_backend="reference",
                                   turbo_flex_attention_owner="primus"))
    assert "owner" in err.value.codes
