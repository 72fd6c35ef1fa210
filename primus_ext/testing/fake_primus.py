"""A CPU stand-in for the parts of AMD Primus that load a third-party attention: its patch
registry and runner, its spec provider, and its way of building Megatron's arguments.

Written from the facts read in Primus's sources (main fd1eeab; docs/primus.md cites them):

* ``primus.core.patches``: ``register_patch(patch_id, *, description, backend, phase, condition,
  priority=50, backend_versions, primus_versions, tags)`` decorating ``handler(ctx)``;
  ``run_patches(*, backend, phase, ..., extra, enabled_ids, dry_run, stop_on_error)`` keeps the
  patches of that backend and phase, runs them by ascending ``(priority, id)``, filters by the
  ids of ``PRIMUS_PATCHES`` (``all`` / ``none`` / a list), evaluates each ``condition(ctx)``
  *outside* any ``try`` (an exception there propagates), and logs and swallows every exception
  a handler raises unless ``stop_on_error`` (``patch_runner.py``; the training runtime never
  sets it).  ``get_args(ctx)`` is ``ctx.extra["backend_args"]``.
* ``primus.backends.megatron.core.extensions.transformer_engine_spec_provider``:
  ``PrimusTurboSpecProvider.core_attention()`` returns Primus's ``PrimusTurboAttention`` when
  ``use_turbo_attention`` is set, else TE's attention.  Here (no TransformerEngine on CPU) those
  are megatron-core's local ``DotProductAttention``: ``PRIMUS_ATTENTION`` marks Primus's own.
* Primus's own patch ``megatron.turbo.te_spec_provider`` (priority 41, before_train, condition
  ``enable_primus_turbo``) installs that provider in place of megatron-core's TE provider; the
  model is built after the before_train patches, by whichever provider is in place.
* Arguments: Megatron's known keys, then every module-YAML key merged in (``merge_namespace``);
  Primus passes no ``extra_args_provider``.

`installed()` puts the stand-in into ``sys.modules`` for a ``with`` block; `train` runs the
lifecycle a Primus launch runs, on a tiny megatron-core GPT on CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import types
from typing import Any, Callable, Iterator, Optional

PHASES = ("setup", "build_args", "before_train")
SPEC_PROVIDER_MODULE = "primus.backends.megatron.core.extensions.transformer_engine_spec_provider"


@dataclasses.dataclass
class PatchContext:
    backend: str
    phase: str
    backend_version: Optional[str] = None
    primus_version: Optional[str] = None
    model_name: Optional[str] = None
    extra: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class FunctionPatch:
    id: str
    description: str
    handler: Callable[[PatchContext], None]
    backend: Optional[str] = None
    phase: Optional[str] = None
    condition: Optional[Callable[[PatchContext], bool]] = None
    priority: int = 50

    def applies_to(self, ctx: PatchContext) -> bool:
        if self.backend is not None and self.backend != ctx.backend:
            return False
        if self.phase is not None and self.phase != ctx.phase:
            return False
        return self.condition is None or bool(self.condition(ctx))


class Registry:
    """The patches registered in this process, and what the runner logged."""

    def __init__(self) -> None:
        self.patches: dict[str, FunctionPatch] = {}
        self.log: list[str] = []
        self.applied: list[str] = []

    def register_patch(self, patch_id: str, *, description: str = "", backend: Optional[str] = None,
                       phase: Optional[str] = None, condition: Optional[Callable[[PatchContext], bool]] = None,
                       priority: int = 50, backend_versions: Any = None, primus_versions: Any = None,
                       tags: Any = None) -> Callable[[Callable], Callable]:
        def decorate(handler: Callable[[PatchContext], None]) -> Callable[[PatchContext], None]:
            self.patches[patch_id] = FunctionPatch(patch_id, description, handler, backend, phase, condition, priority)
            return handler
        return decorate

    def run_patches(self, *, backend: str, phase: str, extra: Optional[dict] = None,
                    enabled_ids: Optional[list[str]] = None, stop_on_error: bool = False, **context: Any) -> int:
        ctx = PatchContext(backend=backend, phase=phase, extra=extra or {},
                           **{k: v for k, v in context.items() if k in ("backend_version", "primus_version",
                                                                        "model_name")})
        if enabled_ids is None:
            enabled_ids = _enabled_from_env()
        chosen = sorted((p for p in self.patches.values() if p.backend in (None, backend)
                         and p.phase in (None, phase)), key=lambda p: (p.priority, p.id))
        applied = 0
        for patch in chosen:
            if enabled_ids is not None and patch.id not in enabled_ids:
                continue
            if not patch.applies_to(ctx):  # outside the try, as upstream: a raising condition propagates
                continue
            try:
                patch.handler(ctx)
            except Exception as exc:  # noqa: BLE001 - upstream logs and goes on
                self.log.append(f"[Patch] failed: {patch.id}: {exc}")
                if stop_on_error:
                    raise
                continue
            applied += 1
            self.applied.append(patch.id)
        return applied


def _enabled_from_env() -> Optional[list[str]]:
    raw = os.environ.get("PRIMUS_PATCHES", "").strip()
    if not raw or raw.lower() == "all":
        return None
    if raw.lower() == "none":
        return []
    return [x.strip() for x in raw.split(",") if x.strip()]


def merge_namespace(args: Any, module_config: dict) -> Any:
    """Every module-YAML key onto the Megatron args, as Primus's runtime merges them."""
    for key, value in module_config.items():
        setattr(args, key, value)
    return args


@contextlib.contextmanager
def installed() -> Iterator[Registry]:
    """A fresh stand-in ``primus`` package in ``sys.modules`` for the block (restored after)."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    registry = Registry()
    saved = {name: mod for name, mod in sys.modules.items() if name == "primus" or name.startswith("primus.")}
    names = ["primus", "primus.core", "primus.core.patches", "primus.backends", "primus.backends.megatron",
             "primus.backends.megatron.core", "primus.backends.megatron.core.extensions", SPEC_PROVIDER_MODULE]
    modules = {name: types.ModuleType(name) for name in names}
    for name, module in modules.items():
        module.__path__ = []  # a package, so submodules import
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    patches = modules["primus.core.patches"]
    patches.PatchContext, patches.FunctionPatch = PatchContext, FunctionPatch
    patches.register_patch, patches.run_patches = registry.register_patch, registry.run_patches
    patches.get_args = lambda ctx: ctx.extra.get("backend_args")
    provider_module = modules[SPEC_PROVIDER_MODULE]

    class PrimusTurboAttention(DotProductAttention):
        """Primus's own Turbo attention, as this stand-in builds it (megatron-core's local math)."""

    class PrimusTurboSpecProvider(LocalSpecProvider):
        cfg: Any = None

        def core_attention(self) -> type:
            return PrimusTurboAttention if getattr(self.cfg, "use_turbo_attention", False) else DotProductAttention

    provider_module.PrimusTurboAttention = PrimusTurboAttention
    provider_module.PrimusTurboSpecProvider = PrimusTurboSpecProvider
    modules["primus"].PRIMUS_ATTENTION = PrimusTurboAttention

    class TESpecProvider(LocalSpecProvider):
        """megatron-core's TransformerEngine provider, as this stand-in builds it: what Megatron uses
        unless Primus's patch replaces it."""

    provider_module.ACTIVE = TESpecProvider

    @registry.register_patch("megatron.turbo.te_spec_provider", backend="megatron", phase="before_train",
                             priority=41, description="the Primus spec provider",
                             condition=lambda ctx: bool(getattr(ctx.extra.get("backend_args"), "enable_primus_turbo",
                                                                False)))
    def _install_provider(ctx: PatchContext) -> None:
        PrimusTurboSpecProvider.cfg = ctx.extra.get("backend_args")
        provider_module.ACTIVE = PrimusTurboSpecProvider

    try:
        yield registry
    finally:
        for name in names:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def megatron_args(experiment: dict, module_config: dict) -> types.SimpleNamespace:
    """Megatron's arguments as Primus builds them: the experiment's Megatron keys, then every
    module-YAML key (the experiment's overrides win) merged in."""
    return merge_namespace(types.SimpleNamespace(), {**module_config, **experiment})


def run_lifecycle(registry: Registry, args: Any) -> None:
    """The phases a Primus launch runs before it builds the model, each through ``run_patches``."""
    extra = {"backend_args": args, "primus_config": None, "module_config": None, "runtime_state": {}}
    for phase in PHASES:
        registry.run_patches(backend="megatron", phase=phase, extra=extra)


def layer_spec() -> Any:
    """megatron-core's local GPT layer spec with the core attention of Primus's spec provider."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    provider = sys.modules[SPEC_PROVIDER_MODULE].ACTIVE()  # Primus's, where its patch installed it
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = provider.core_attention()
    return spec


__all__ = ["FunctionPatch", "PatchContext", "Registry", "installed", "layer_spec", "megatron_args",
           "merge_namespace", "run_lifecycle"]
