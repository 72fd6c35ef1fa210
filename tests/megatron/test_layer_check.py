"""The launcher's check of the built model (`primus_ext.primus.layer_check`): at the model's first
forward (each model chunk's), with ``use_turbo_flex_attention`` asked for, every megatron-core attention
layer is primus_ext's or the run stops with our error, before any layer computes, and stays stopped."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention

from primus_ext.errors import UnsupportedConfigError
from primus_ext.primus import layer_check

from . import gpt


@pytest.fixture(autouse=True)
def no_condition_seen(monkeypatch):
    monkeypatch.setitem(layer_check._state, "condition", None)
    for name in layer_check._GLOBAL_ARGS:
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, "megatron.training", None)  # no Megatron-LM args in this process
    yield
    hooks = torch.nn.modules.module._global_forward_pre_hooks
    for key in [k for k, h in hooks.items() if getattr(h, "__self__", None).__class__ is layer_check.LayerCheck]:
        del hooks[key]  # a test that failed before the check ran leaves no hook behind


def foreign_gpt() -> GPTModel:
    """megatron-core's own local layers: what a bypass of the patch builds."""
    torch.manual_seed(0)
    return GPTModel(config=gpt.config(), transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=gpt.VOCAB,
                    max_sequence_length=gpt.SEQ * 4, position_embedding_type="learned_absolute")


def forward(model: torch.nn.Module) -> torch.Tensor:
    tokens = torch.randint(0, gpt.VOCAB, (2, gpt.SEQ))
    return model(tokens, torch.arange(gpt.SEQ).expand_as(tokens), None)


def hooked() -> bool:
    return any(getattr(h, "__self__", None).__class__ is layer_check.LayerCheck
               for h in torch.nn.modules.module._global_forward_pre_hooks.values())


def test_foreign_layers_stop_the_first_forward_before_any_layer_runs(monkeypatch):
    ran = []
    monkeypatch.setattr(DotProductAttention, "forward", lambda self, *a, **k: ran.append(self))
    check = layer_check.LayerCheck(lambda: True)
    model = foreign_gpt()
    with pytest.raises(UnsupportedConfigError) as err:
        forward(model)
    assert err.value.codes == ("primus-layers",) and "use_turbo_flex_attention" in err.value.settings, str(err.value)
    message = str(err.value)
    assert "2 of the model's 2 attention layers" in message and "decoder.layers.0.self_attention" in message
    assert "megatron.core.transformer.dot_product_attention.DotProductAttention" in message
    assert ran == [] and check.checked == [model]
    with pytest.raises(UnsupportedConfigError):  # a caller that swallowed it (an in-process restart) cannot go on
        forward(foreign_gpt())


def ours() -> GPTModel:
    return gpt.build_gpt(gpt.settings(use_turbo_flex_attention=True, turbo_flex_attention_backend="reference"))


def test_primus_ext_layers_pass_each_tree_checked_once():
    check = layer_check.LayerCheck(lambda: True)
    model = ours()
    torch.nn.Linear(2, 2)(torch.zeros(1, 2))  # a module without attention: looked at, not checked
    assert check.checked == [] and hooked()
    forward(model)
    forward(model)
    assert check.checked == [model]


def test_every_model_chunk_is_checked(monkeypatch):
    """A virtual pipeline stage holds several chunks; the second one is foreign here."""
    monkeypatch.setattr(DotProductAttention, "forward", lambda self, *a, **k: None)
    check = layer_check.LayerCheck(lambda: True)
    first = ours()
    forward(first)
    with pytest.raises(UnsupportedConfigError):
        forward(foreign_gpt())
    assert len(check.checked) == 2


def test_all_primus_ext_layers_need_no_answer_to_whether_flex_was_asked():
    def unknown() -> bool:
        raise AssertionError("asked although every layer is primus_ext's")

    layer_check.LayerCheck(unknown)
    forward(ours())


class Ran(Exception):
    """megatron-core's local attention was reached (it needs CUDA to compute)."""


def test_a_run_without_flex_keeps_any_layers(monkeypatch):
    def reached(self, *args, **kwargs):
        raise Ran

    monkeypatch.setattr(DotProductAttention, "forward", reached)
    layer_check.LayerCheck(lambda: False)
    with pytest.raises(Ran):
        forward(foreign_gpt())


def test_the_condition_and_the_run_args_come_before_the_experiment(monkeypatch):
    def experiment() -> bool:
        raise AssertionError("the experiment is read only when nothing else tells")

    check = layer_check.LayerCheck(experiment)
    try:
        layer_check.note_condition(False)
        assert check.wanted() is False
        monkeypatch.setitem(layer_check._state, "condition", None)
        args = types.SimpleNamespace(use_turbo_flex_attention=True)
        monkeypatch.setitem(sys.modules, layer_check._GLOBAL_ARGS[1], types.SimpleNamespace(_GLOBAL_ARGS=args))
        assert check.wanted() is True
    finally:
        check.remove()


def test_wrapped_models_are_checked_through_the_wrapper():
    class Wrapper(torch.nn.Module):  # Megatron's DDP / Float16Module hold the model as .module
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

        def forward(self, *args):
            return self.module(*args)

    layer_check.LayerCheck(lambda: True)
    with pytest.raises(UnsupportedConfigError, match="module.decoder.layers.1.self_attention"):
        forward(Wrapper(foreign_gpt()))


def test_a_compiled_model_is_checked_once_by_its_eager_call_and_runs():
    check = layer_check.LayerCheck(lambda: True)
    model = ours()
    compiled = torch.compile(model, backend="eager")
    forward(compiled)
    assert check.checked == [compiled]


def test_a_compiled_foreign_model_is_refused_before_it_is_traced(monkeypatch):
    ran = []
    monkeypatch.setattr(DotProductAttention, "forward", lambda self, *a, **k: ran.append(self))
    layer_check.LayerCheck(lambda: True)
    with pytest.raises(UnsupportedConfigError):
        forward(torch.compile(foreign_gpt(), backend="eager"))
    assert ran == []
