"""A CPU stand-in for the parts of AMD Primus that load a third-party attention: its patch
registry and runner, its spec provider, and its way of building Megatron's arguments.

Written from Primus's sources (main fd1eeab, ``primus/`` paths; docs/primus.md cites them):

* ``core/patches``: ``register_patch(patch_id, *, description, backend, phase, condition,
  priority=50, backend_versions, primus_versions, tags)`` decorating ``handler(ctx)``
  (``patch_registry.py:169-207``).  The registry keeps one list per ``(backend, phase)`` in
  registration order; registering an id again replaces it, and it moves to the end of its list
  (``patch_registry.py:49-81``).  ``run_patches`` (``patch_runner.py:47-148``) takes the lists of
  ``(backend, phase)``, ``(None, phase)``, ``(backend, None)``, ``(None, None)`` in that order
  (``patch_registry.py:122-136``), keeps the ids of ``PRIMUS_PATCHES`` (``all`` / ``none`` / a list,
  ``:26-39``, ``:89-90``), then evaluates **every** patch's ``applies_to`` (backend, phase, version
  patterns, ``condition``) **before running any handler** and outside any ``try`` (``:102``: a
  raising condition propagates), sorts by priority with ties kept in that list order (``:105``,
  a stable sort: registration order within one ``(backend, phase)`` list, not by id), and runs each
  handler in a ``try`` that logs and swallows ``ImportError`` and ``Exception`` unless
  ``stop_on_error`` (``:125-140``; the training runtime never sets it).  ``dry_run`` counts without
  running (``:118-122``).  Version patterns: ``patch.py:67-81``, ``utils.py:24-116``.
  ``get_args(ctx)`` is ``ctx.extra["module_config"].params`` (``context.py:87-116``).
* ``backends/megatron/core/extensions/transformer_engine_spec_provider``:
  ``PrimusTurboSpecProvider.core_attention()`` returns Primus's ``PrimusTurboAttention`` when
  ``use_turbo_attention`` is set, else TE's attention.  Here (no TransformerEngine on CPU) those
  are megatron-core's local ``DotProductAttention``: ``PRIMUS_ATTENTION`` marks Primus's own.
* Primus's own patch ``megatron.turbo.te_spec_provider`` (``patches/turbo/te_spec_provider_patches.py``:
  priority 41, before_train, ``backend_versions=["<0.17"]``) installs that provider in place of
  megatron-core's TE provider when ``enable_primus_turbo`` and ``primus_turbo`` imports (the CPU
  fake counts; ``turbo/utils.py:13-35``, whose legacy grouped-GEMM route is not modelled); the model is built after the before_train patches.
* The runtime (``core/runtime/train_runtime.py``): after the configuration is loaded, the
  experiment's top-level ``env:`` block goes into ``os.environ`` (`apply_config_env`, ``:96-104``,
  ``:307-358``); the module's params become Megatron's args
  (``convert_config``, ``:416``), the build_args patches run (``:424``), the params' other keys
  are merged in and the args become ``module_config.params`` (``:454-455``), then the setup
  (``:518``) and before_train (``:527``) patches run.  The config merge itself is
  `primus_ext.testing.fake_primus_config`.

`installed()` puts the stand-in into ``sys.modules`` for a ``with`` block; `run_runtime` runs what
a Primus launch runs from an experiment YAML, `run_lifecycle` the same from ready args.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import os
import re
import sys
import types
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from . import fake_primus_config as config

PHASES = ("build_args", "setup", "before_train")
"""The phases before the model is built, in the runtime's order (train_runtime.py:424, 518, 527)."""
SPEC_PROVIDER_MODULE = "primus.backends.megatron.core.extensions.transformer_engine_spec_provider"


@dataclasses.dataclass
class PatchContext:
    backend: str
    phase: str
    backend_version: Optional[str] = None
    primus_version: Optional[str] = None
    model_name: Optional[str] = None
    module_name: Optional[str] = None
    platform: Optional[str] = None
    extra: dict = dataclasses.field(default_factory=dict)


def get_args(ctx: PatchContext) -> Any:
    """context.py:87-116: the module's params (Megatron's args from the runtime's merge on)."""
    module_config = ctx.extra.get("module_config")
    assert module_config is not None, "module_config is required in patch context"
    params = getattr(module_config, "params", None)
    assert params is not None, "module_config.params is required in patch context"
    return params


def _semver(version: str) -> Optional[tuple[int, ...]]:
    parts = [re.match(r"^(\d+)", part) for part in version.split(".")] if version else [None]
    return tuple(int(m.group(1)) for m in parts) if all(parts) else None  # type: ignore[union-attr]


def version_in_range(version: Optional[str], pattern: str) -> bool:
    """utils.py:73-116: ``a~b``, ``<``/``<=``/``>``/``>=``, else wildcard or exact."""
    if not version:
        return False
    if "~" in pattern:
        low, high, got = _semver(pattern.split("~", 1)[0]), _semver(pattern.split("~", 1)[1]), _semver(version)
        return bool(low and high and got) and low <= got <= high  # type: ignore[operator]
    match = re.match(r"^(<=|>=|<|>)([\d\.]+)$", pattern)
    if match:
        got, target = _semver(version), _semver(match.group(2))
        if not (got and target):
            return False
        return {"<=": got <= target, ">=": got >= target, "<": got < target, ">": got > target}[match.group(1)]
    if "*" not in pattern:
        return version == pattern
    return re.fullmatch(pattern.replace(".", r"\.").replace("*", ".*"), version) is not None


@dataclasses.dataclass
class FunctionPatch:
    id: str
    description: str
    handler: Callable[[PatchContext], None]
    backend: Optional[str] = None
    phase: Optional[str] = None
    condition: Optional[Callable[[PatchContext], bool]] = None
    priority: int = 50
    backend_version_patterns: list = dataclasses.field(default_factory=list)
    primus_version_patterns: list = dataclasses.field(default_factory=list)
    tags: set = dataclasses.field(default_factory=set)

    def applies_to(self, ctx: PatchContext) -> bool:
        """patch.py:83-117, in its order; the condition last."""
        if self.backend is not None and self.backend != ctx.backend:
            return False
        if self.phase is not None and self.phase != ctx.phase:
            return False
        for patterns, version in ((self.backend_version_patterns, ctx.backend_version),
                                  (self.primus_version_patterns, ctx.primus_version)):
            if patterns and not any(version_in_range(version, p) for p in patterns):
                return False
        return self.condition is None or bool(self.condition(ctx))


class Registry:
    """The patches registered in this process, and what the runner logged and applied."""

    def __init__(self) -> None:
        self.buckets: dict[tuple[Optional[str], Optional[str]], list[FunctionPatch]] = {}
        self.all: list[FunctionPatch] = []
        self.log: list[str] = []
        self.applied: list[str] = []

    @property
    def patches(self) -> dict[str, FunctionPatch]:
        return {patch.id: patch for patch in self.all}

    def register(self, patch: FunctionPatch) -> FunctionPatch:
        """patch_registry.py:49-81."""
        for i, existing in enumerate(self.all):
            if existing.id == patch.id:
                bucket = self.buckets.get((existing.backend, existing.phase), [])
                if existing in bucket:
                    bucket.remove(existing)
                self.all[i] = patch
                break
        else:
            self.all.append(patch)
        self.buckets.setdefault((patch.backend, patch.phase), []).append(patch)
        return patch

    def register_patch(self, patch_id: str, *, description: str = "", backend: Optional[str] = None,
                       phase: Optional[str] = None, condition: Optional[Callable[[PatchContext], bool]] = None,
                       priority: int = 50, backend_versions: Any = None, primus_versions: Any = None,
                       tags: Any = None) -> Callable[[Callable], Callable]:
        def decorate(handler: Callable[[PatchContext], None]) -> Callable[[PatchContext], None]:
            self.register(FunctionPatch(patch_id, description or handler.__doc__ or "", handler, backend, phase,
                                        condition, priority, list(backend_versions or []),
                                        list(primus_versions or []), set(tags or [])))
            return handler
        return decorate

    def iter_patches(self, backend: str, phase: str) -> list[FunctionPatch]:
        """patch_registry.py:122-136: the four lists in their order, each id once."""
        seen: set[str] = set()
        out = []
        for key in ((backend, phase), (None, phase), (backend, None), (None, None)):
            for patch in self.buckets.get(key, []):
                if patch.id not in seen:
                    out.append(patch)
                    seen.add(patch.id)
        return out

    def run_patches(self, *, backend: str, phase: str, backend_version: Optional[str] = None,
                    primus_version: Optional[str] = None, model_name: Optional[str] = None,
                    module_name: Optional[str] = None, platform: Optional[str] = None,
                    extra: Optional[dict] = None, enabled_ids: Optional[list[str]] = None,
                    dry_run: bool = False, stop_on_error: bool = False) -> int:
        """patch_runner.py:47-148."""
        ctx = PatchContext(backend, phase, backend_version, primus_version, model_name, module_name, platform,
                           extra or {})
        if enabled_ids is None:
            enabled_ids = _enabled_from_env()
        patches = self.iter_patches(backend, phase)
        if enabled_ids is not None:
            patches = [p for p in patches if p.id in enabled_ids]
        patches = [p for p in patches if p.applies_to(ctx)]  # every condition first, outside the try
        patches = sorted(patches, key=lambda p: p.priority)  # stable: ties keep the list order
        applied = 0
        for patch in patches:
            if dry_run:
                applied += 1
                continue
            try:
                patch.handler(ctx)
            except Exception as exc:  # noqa: BLE001 - upstream logs ImportError and Exception, and goes on
                self.log.append(f"[Patch] ✗ Patch '{patch.id}' failed: {exc}")
                if stop_on_error:
                    raise
                continue
            applied += 1
            self.applied.append(patch.id)
            self.log.append(f"[Patch] ✓ Applied: {patch.id} (priority={patch.priority})")
        return applied


def _enabled_from_env() -> Optional[list[str]]:
    raw = os.environ.get("PRIMUS_PATCHES", "").strip()
    if not raw or raw.lower() == "all":
        return None
    if raw.lower() == "none":
        return []
    return [x.strip() for x in raw.split(",") if x.strip()]


def backend_version() -> Optional[str]:
    """megatron-core's version as Primus reads it: ``megatron/core/package_info.py`` on ``sys.path``,
    parsed, not imported (``backends/megatron/megatron_adapter.py``, ``detect_backend_version``)."""
    for entry in sys.path:
        info = Path(entry or ".") / "megatron" / "core" / "package_info.py"
        if info.is_file():
            values = {node.targets[0].id: ast.literal_eval(node.value) for node in ast.parse(info.read_text()).body
                      if isinstance(node, ast.Assign) and len(node.targets) == 1
                      and getattr(node.targets[0], "id", None) in {"MAJOR", "MINOR", "PATCH", "PRE_RELEASE"}}
            return f"{values['MAJOR']}.{values['MINOR']}.{values['PATCH']}{values.get('PRE_RELEASE') or ''}"
    return None


def _turbo_importable() -> bool:
    """The provider patch's condition also wants ``primus_turbo`` (``turbo/utils.py:13-35``; its legacy
    grouped-GEMM route is not modelled): the CPU fake counts where it is installed."""
    import importlib.util

    if "primus_turbo" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("primus_turbo") is not None
    except (ImportError, ValueError):
        return False


MODULES = ("primus", "primus.core", "primus.core.patches", "primus.backends", "primus.backends.megatron",
           "primus.backends.megatron.core", "primus.backends.megatron.core.extensions", SPEC_PROVIDER_MODULE)
"""The stand-in's modules (`populate` puts every one but ``primus`` itself into ``sys.modules``)."""


@contextlib.contextmanager
def installed() -> Iterator[Registry]:
    """A fresh stand-in ``primus`` package in ``sys.modules`` for the block (restored after)."""
    saved = {name: mod for name, mod in sys.modules.items() if name == "primus" or name.startswith("primus.")}
    root = types.ModuleType("primus")
    root.__path__ = []  # a package, so submodules import
    sys.modules["primus"] = root
    try:
        yield populate(root)
    finally:
        for name in MODULES:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def populate(root: types.ModuleType) -> Registry:
    """Fill the ``primus`` package ``root`` with the stand-in (its submodules into ``sys.modules``,
    Primus's provider patch registered); returns the registry.  `installed` does it for a ``with``
    block; a stand-in Primus on disk calls it from its ``primus/__init__.py``."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    registry = Registry()
    modules = {name: (root if name == "primus" else types.ModuleType(name)) for name in MODULES}
    for name, module in modules.items():
        if name != "primus":
            module.__path__ = []  # a package, so submodules import
            sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    patches = modules["primus.core.patches"]
    patches.PatchContext, patches.FunctionPatch = PatchContext, FunctionPatch
    patches.register_patch, patches.run_patches = registry.register_patch, registry.run_patches
    patches.get_args = get_args
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
                             priority=41, description="the Primus spec provider", backend_versions=["<0.17"],
                             condition=lambda ctx: bool(getattr(get_args(ctx), "enable_primus_turbo", False))
                             and _turbo_importable())
    def _install_provider(ctx: PatchContext) -> None:
        PrimusTurboSpecProvider.cfg = get_args(ctx)
        provider_module.ACTIVE = PrimusTurboSpecProvider

    root.REGISTRY = registry
    return registry


def _phase(registry: Registry, phase: str, args: Any, module_config: Any) -> None:
    """train_runtime.py:204-229: one phase through ``run_patches``."""
    registry.run_patches(backend="megatron", phase=phase, backend_version=backend_version(),
                         model_name=getattr(module_config, "model", None),
                         module_name=getattr(module_config, "name", None),
                         extra={"backend_args": args, "primus_config": None, "module_config": module_config,
                                "runtime_state": None})


def primus_module(experiment: str, primus_root: str, module_name: str = "pre_trainer") -> types.SimpleNamespace:
    """The experiment's module as Primus's runtime holds it (``module_config`` with ``params``), from
    the Primus checkout ``primus_root`` (its ``primus/configs``)."""
    return config.module_config(config.parse_experiment(experiment, os.path.join(primus_root, "primus", "configs")),
                                module_name)


def apply_config_env(config_path: str) -> None:
    """train_runtime.py:307-358, as Primus runs it after loading the configuration: the experiment
    file's top-level ``env:`` mapping into ``os.environ``, each value ``os.path.expandvars``-ed while
    the keys are set; best-effort (nothing raised)."""
    try:
        import yaml

        if not os.path.exists(config_path):
            return
        with open(config_path) as handle:
            raw = yaml.safe_load(handle) or {}
        block = raw.get("env") if isinstance(raw, dict) else None
        if not block or not isinstance(block, dict):
            return
        for key, value in block.items():
            os.environ[str(key)] = os.path.expandvars(str(value))
    except Exception:  # noqa: BLE001 - upstream prints a warning and goes on
        return


def run_runtime(registry: Registry, module_config: types.SimpleNamespace) -> types.SimpleNamespace:
    """What ``PrimusRuntime`` runs before the model is built: Megatron's args from the params, the
    build_args patches, the params merged into the args, the setup and before_train patches."""
    args = config.convert_config(module_config.params)
    _phase(registry, "build_args", args, module_config)
    config.merge_namespace(args, module_config.params, allow_override=False)
    module_config.params = args
    for phase in PHASES[1:]:
        _phase(registry, phase, args, module_config)
    return args


def megatron_args(experiment: dict, module_config: dict) -> types.SimpleNamespace:
    """Megatron's arguments from flat keys, the experiment's over the module's, as the runtime builds
    them from merged params (Megatron's defaults, then every key)."""
    params = config.to_namespace({**module_config, **experiment})
    args = config.convert_config(params)
    config.merge_namespace(args, params, allow_override=False)
    return args


def run_lifecycle(registry: Registry, args: Any, module_config: Any = None) -> None:
    """The phases a Primus launch runs before it builds the model, for args already built (the
    module's params are those args throughout)."""
    module_config = module_config or types.SimpleNamespace(params=args, name="pre_trainer")
    for phase in PHASES:
        _phase(registry, phase, args, module_config)


def layer_spec() -> Any:
    """megatron-core's local GPT layer spec with the core attention of Primus's spec provider."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    provider = sys.modules[SPEC_PROVIDER_MODULE].ACTIVE()  # Primus's, where its patch installed it
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = provider.core_attention()
    return spec


__all__ = ["MODULES", "FunctionPatch", "PatchContext", "Registry", "apply_config_env", "backend_version", "get_args",
           "installed", "layer_spec", "megatron_args", "populate", "primus_module", "run_lifecycle", "run_runtime",
           "version_in_range"]
