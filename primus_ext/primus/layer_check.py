"""The launcher's check of the built model, independent of how it was built: at the model's first
forward (each model chunk's), in a run that asks for ``use_turbo_flex_attention``, every megatron-core
attention layer's core attention is primus_ext's, or the run stops with our error naming the layers
that are not.

It catches what the patch cannot see: a filter, a later patch, a spec or a provider that built
the layers another way.  The check is a global forward pre-hook (``torch.nn.modules.module.
register_module_forward_pre_hook``); it looks at each module called, not seen yet, whose tree holds
a megatron-core ``Attention`` (a model chunk, or the wrapper around it, before any of its layers
runs).

Whether the run asks for flex attention is read, in order, from what the patch's condition saw
(`note_condition`), the run's global args (Megatron-LM's ``megatron.training.get_args``, Primus's
``primus.backends.megatron.training.global_vars``), and the experiment
the launcher was given, merged as Primus merges it (`primus_ext.settings.primus_config.read_experiment`).
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Callable, Optional

import torch

from .. import refusals as R
from ..errors import Reason
from ..settings.primus_owner import gives_key_to_primus, primus_flex_path

_ATTENTION_MODULE = "megatron.core.transformer.attention"
_state: dict[str, Any] = {"condition": None}
_CONTEXT = "Primus run, model built"


def note_condition(wanted: bool) -> None:
    """What the patch's condition read (``use_turbo_flex_attention``), the first source `wanted` asks."""
    _state["condition"] = bool(wanted)


_GLOBAL_ARGS = ("megatron.training.global_vars", "primus.backends.megatron.training.global_vars")
"""Where Megatron-LM's ``initialize_megatron`` and Primus's ``set_args`` keep the run's args."""


def _megatron_args_flag() -> Optional[bool]:
    from ..megatron.args import megatron_args  # megatron is imported by now: a model exists

    found = [megatron_args()] + [getattr(sys.modules.get(name), "_GLOBAL_ARGS", None) for name in _GLOBAL_ARGS]
    for args in found:
        if args is not None:
            owner = getattr(args, "turbo_flex_attention_owner", None)
            return bool(getattr(args, "use_turbo_flex_attention", False)) and not gives_key_to_primus(
                owner, primus_flex_path())
    return None


def _ours(core: Any) -> bool:
    from ..megatron import PrimusTurboLocalAttention
    from ..megatron.te import built_te_classes

    return isinstance(core, (PrimusTurboLocalAttention, *built_te_classes()))


class LayerCheck:
    """The check, installed once by `install`; ``experiment_flag`` reads the experiment's key when
    nothing else tells.

    It stays installed: every module tree forwarded that holds megatron-core attention layers and
    was not seen yet is checked (each model chunk of a virtual pipeline, a model rebuilt in the same
    process), and a refusal is kept, raised again at every later forward (a caller that swallows
    the first, such as an in-process restart, cannot train on).  A module already seen costs one
    set lookup; compiled code skips the hook (the compiled model's own eager call was checked)."""

    def __init__(self, experiment_flag: Callable[[], bool]) -> None:
        self._experiment_flag = experiment_flag
        self._seen: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
        # The refusal's reasons, not the error: a re-raised exception would keep every refused
        # forward's frames (and their inputs) alive on its traceback.
        self._refusal: Optional[Reason] = None
        self._handle = torch.nn.modules.module.register_module_forward_pre_hook(self._before_forward)
        self.checked: list[torch.nn.Module] = []
        """The module trees checked so far (each holding attention layers)."""

    def wanted(self) -> bool:
        """Whether this run asks for primus_ext's layers (``use_turbo_flex_attention``, not given to
        Primus's own flex path by ``turbo_flex_attention_owner: primus``)."""
        for flag in (_state["condition"], _megatron_args_flag()):
            if flag is not None:
                return flag
        return self._experiment_flag()

    def _before_forward(self, module: torch.nn.Module, _inputs: Any) -> None:
        if torch.compiler.is_compiling():
            return
        if self._refusal is not None:
            raise R.refuse_all([self._refusal], context=_CONTEXT)
        if module in self._seen:
            return
        attention_type = getattr(sys.modules.get(_ATTENTION_MODULE), "Attention", None)
        if attention_type is None:
            return
        tree = list(module.named_modules())
        layers = [(name, m) for name, m in tree if isinstance(m, attention_type)]
        if not layers:
            self._seen.add(module)  # its submodules may still be reached as roots of their own
            return
        self._seen.update(m for _, m in tree)
        self.checked.append(module)
        foreign = [(name or type(module).__name__, type(getattr(m, "core_attention", None)))
                   for name, m in layers if not _ours(getattr(m, "core_attention", None))]
        if foreign and self.wanted():
            self._refusal = _reason(foreign, len(layers))
            raise R.refuse_all([self._refusal], context=_CONTEXT)

    def remove(self) -> None:
        self._handle.remove()


def _reason(foreign: list[tuple[str, type]], total: int) -> Reason:
    kinds = sorted({f"{cls.__module__}.{cls.__qualname__}" for _, cls in foreign})
    shown = ", ".join(name for name, _ in foreign[:4]) + (f", ... ({len(foreign)} in all)" if len(foreign) > 4 else "")
    return R.FOREIGN_LAYERS.reason_for(count=len(foreign), total=total, kinds=", ".join(kinds), shown=shown)


def unknown_flag_reason() -> Reason:
    """No source tells whether the run asks for flex attention, and a layer is not primus_ext's."""
    return R.UNKNOWN_FLAG.reason_for()


_installed: list[LayerCheck] = []


def install(experiment_flag: Callable[[], bool]) -> LayerCheck:
    """Install the check for this process (once; a second call returns the first check)."""
    if not _installed:
        _installed.append(LayerCheck(experiment_flag))
    return _installed[0]


__all__ = ["LayerCheck", "install", "note_condition", "unknown_flag_reason"]
