"""Turn ``"package.module:attr"`` hook strings into checked mask_mod / score_mod callables.

B2 asks that a bad hook is refused when the model is built, not at the first forward
pass hours into a job.  So resolution imports the module, follows the attribute path,
checks the call signature, and runs the hook once on a tiny probe grid (``B=2, H=2,
8x8``) to see that it returns what FlexAttention expects.  Nothing is ``eval``'d: the
string only names a module for `importlib.import_module` and attributes for `getattr`.

Convention shared with `TurboAttentionSettings`: ``kwargs=None`` means the attribute is
the hook itself; a mapping (even ``{}``) means it is a factory called with ``**kwargs``
that returns the hook (``"primus_ext.attention.masks:causal"`` needs ``{}``).

The returned callable is the user's object, untouched: no attributes are set on it.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from typing import Any, Callable, Literal, Mapping, Optional, Union

import torch
from torch import Tensor

from ..attention.pattern import index_grid
from ..errors import Reason, UnsupportedConfigError
from .settings import HOOK_PATTERN, TurboAttentionSettings

HookKind = Literal["mask_mod", "score_mod"]

# Positional arguments FlexAttention passes to each kind of hook.
ARITY: dict[str, tuple[str, ...]] = {
    "mask_mod": ("b", "h", "q_idx", "kv_idx"),
    "score_mod": ("score", "b", "h", "q_idx", "kv_idx"),
}
PROBE_SHAPE: tuple[int, int, int, int] = (2, 2, 8, 8)  # (B, H, Sq, Skv)

_EXAMPLE = {
    "mask_mod": '"primus_ext.attention.masks:prefix_lm" with _kwargs {prefix_length: 64}',
    "score_mod": '"my_pkg.mods:tanh_softcap" returning a float tensor shaped like score',
}


class _Refused(Exception):
    """Internal: carries the one reason that stopped resolution of a hook."""

    def __init__(self, reason: Reason) -> None:
        super().__init__(reason.render())
        self.reason = reason


def _describe_exc(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class _Resolver:
    """Resolution of one hook string; each step raises `_Refused` with a precise reason."""

    def __init__(self, spec: Any, kind: HookKind, setting: str,
                 kwargs: Optional[Mapping[str, Any]], device: torch.device) -> None:
        if kind not in ARITY:
            raise ValueError(f"kind must be 'mask_mod' or 'score_mod', got {kind!r}")
        self.spec, self.kind, self.setting, self.kwargs, self.device = spec, kind, setting, kwargs, device
        self.kwargs_key = f"{setting}_kwargs"

    def refuse(self, reason: str, alternative: str, *, with_kwargs: bool = False) -> _Refused:
        keys = (self.setting, self.kwargs_key) if with_kwargs else (self.setting,)
        return _Refused(Reason(settings=keys, reason=f"{self.setting} = {self.spec!r}: {reason}",
                               alternative=alternative))

    def run(self) -> Callable[..., Tensor]:
        module_name, attr_path = self.split()
        target = self.follow(self.import_module(module_name), module_name, attr_path)
        if not callable(target):
            raise self.refuse(f"`{attr_path}` is a value of type {type(target).__name__}, not a callable.",
                              f"point {self.setting} at a function, e.g. {_EXAMPLE[self.kind]}.")
        hook = self.call_factory(target) if self.kwargs is not None else target
        self.check_arity(hook)
        self.probe(hook)
        return hook

    # ---------------------------------------------------------------- lookup steps
    def split(self) -> tuple[str, str]:
        if not isinstance(self.spec, str) or not HOOK_PATTERN.match(self.spec):
            raise self.refuse("not a 'package.module:attr' string of Python identifiers.",
                              f"write it as {_EXAMPLE[self.kind]}.")
        module_name, attr_path = self.spec.split(":", 1)
        return module_name, attr_path

    def import_module(self, module_name: str) -> Any:
        try:
            return importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            missing = exc.name or ""
            if missing and (module_name == missing or module_name.startswith(missing + ".")):
                raise self.refuse(f"module `{module_name}` was not found (no module named `{missing}`).",
                                  "check the spelling and that the package is installed or on "
                                  "PYTHONPATH on every rank.") from exc
            raise self.refuse(f"importing `{module_name}` failed: {_describe_exc(exc)}",
                              f"install the missing dependency `{missing}` or fix the import "
                              f"in `{module_name}`.") from exc
        except Exception as exc:  # noqa: BLE001 - any import-time error is the user's to see
            raise self.refuse(f"importing `{module_name}` failed: {_describe_exc(exc)}",
                              f"fix the error raised while importing `{module_name}`.") from exc

    def follow(self, obj: Any, module_name: str, attr_path: str) -> Any:
        walked = module_name
        for part in attr_path.split("."):
            try:
                obj = getattr(obj, part)
            except AttributeError as exc:
                names = [n for n in dir(obj) if not n.startswith("_")]
                close = difflib.get_close_matches(part, names, n=3, cutoff=0.6)
                sep = "." if ":" in walked else ":"
                hint = f"did you mean {', '.join(f'`{walked}{sep}{c}`' for c in close)}?" if close else (
                    f"check the attribute name in `{walked}`.")
                raise self.refuse(f"`{walked}` has no attribute `{part}`.", hint) from exc
            walked = f"{walked}{'.' if ':' in walked else ':'}{part}"
        return obj

    def call_factory(self, factory: Callable[..., Any]) -> Any:
        try:
            hook = factory(**dict(self.kwargs or {}))
        except Exception as exc:  # noqa: BLE001 - the factory's own error is the message
            raise self.refuse(f"calling the factory with {self.kwargs_key} = {dict(self.kwargs or {})!r} "
                              f"failed: {_describe_exc(exc)}",
                              f"give {self.kwargs_key} the keyword arguments the factory accepts, "
                              f"or set it to null if `{self.spec}` is itself the {self.kind}.",
                              with_kwargs=True) from exc
        if not callable(hook):
            raise self.refuse(f"the factory called with {self.kwargs_key} returned a value of type "
                              f"{type(hook).__name__}, not a {self.kind}.",
                              f"set {self.kwargs_key}: null if `{self.spec}` is itself the {self.kind}.",
                              with_kwargs=True)
        return hook

    def check_arity(self, hook: Callable[..., Any]) -> None:
        try:
            sig = inspect.signature(hook)
        except (TypeError, ValueError):
            return  # builtins without a signature: the probe decides
        params = ARITY[self.kind]
        try:
            sig.bind(*params)
        except TypeError as exc:
            factory_hint = ""
            if self.kwargs is None and _binds(sig, 0):
                factory_hint = f" It takes no arguments, so it looks like a factory: set {self.kwargs_key}: {{}}."
            raise self.refuse(f"a {self.kind} is called as {self.kind}({', '.join(params)}) but this "
                              f"callable has signature {sig} ({exc}).{factory_hint}",
                              f"define it with exactly {len(params)} positional parameters "
                              f"({', '.join(params)}).",
                              with_kwargs=self.kwargs is not None) from exc

    # ----------------------------------------------------------------------- probe
    def probe(self, hook: Callable[..., Tensor]) -> None:
        b, h, q_idx, kv_idx = index_grid(*PROBE_SHAPE, device=self.device)
        # A private generator: probing at model-build time must not advance the global RNG,
        # or configuring a hook would change every weight initialised after this layer.
        gen = torch.Generator().manual_seed(0)
        score = torch.randn(PROBE_SHAPE, generator=gen, dtype=torch.float32).to(self.device)
        args = (b, h, q_idx, kv_idx) if self.kind == "mask_mod" else (score, b, h, q_idx, kv_idx)
        try:
            with torch.no_grad():
                out = hook(*args)
        except Exception as exc:  # noqa: BLE001 - report the hook's own failure
            raise self.refuse(f"raised {_describe_exc(exc)} when probed on a "
                              f"{'x'.join(map(str, PROBE_SHAPE))} (B, H, Sq, Skv) index grid.",
                              "a hook must work on broadcasting index tensors with tensor ops only "
                              "(torch.where instead of if/else on tensor values).") from exc
        if self.kind == "mask_mod":
            self.check_mask(out)
        else:
            self.check_score(out, score)

    def check_mask(self, out: Any) -> None:
        if not isinstance(out, Tensor):
            raise self.refuse(f"the mask_mod returned a value of type {type(out).__name__}, not a boolean tensor.",
                              "return a comparison of the index tensors, e.g. kv_idx <= q_idx.")
        if out.dtype != torch.bool:
            raise self.refuse(f"the mask_mod returned a {out.dtype} tensor, not torch.bool.",
                              "return a comparison (kv_idx <= q_idx) or combine masks with & and |; "
                              "a float bias belongs in a score_mod.")
        try:
            full = torch.broadcast_shapes(tuple(out.shape), PROBE_SHAPE)
        except RuntimeError:
            full = None
        if full != PROBE_SHAPE:
            raise self.refuse(f"the mask_mod returned shape {tuple(out.shape)}, which does not "
                              f"broadcast to the probe grid {PROBE_SHAPE}.",
                              "compute the mask element-wise from (b, h, q_idx, kv_idx).")

    def check_score(self, out: Any, score: Tensor) -> None:
        if not isinstance(out, Tensor):
            raise self.refuse(f"the score_mod returned a value of type {type(out).__name__}, not a tensor.",
                              "return a tensor computed from score, e.g. score + bias[h].")
        if not out.is_floating_point():
            raise self.refuse(f"the score_mod returned a {out.dtype} tensor; a floating tensor is needed.",
                              "return the modified score (floating), not a mask; masks go in a mask_mod.")
        if tuple(out.shape) != tuple(score.shape):
            raise self.refuse(f"the score_mod returned shape {tuple(out.shape)}, not the score's "
                              f"shape {tuple(score.shape)}.",
                              "compute element-wise on score, e.g. score + (q_idx - kv_idx).")


def _binds(sig: inspect.Signature, count: int) -> bool:
    try:
        sig.bind(*range(count))
    except TypeError:
        return False
    return True


def _resolve(spec: Any, kind: HookKind, setting: str, kwargs: Optional[Mapping[str, Any]],
             device: Union[str, torch.device]) -> tuple[Optional[Callable[..., Tensor]], Optional[Reason]]:
    try:
        return _Resolver(spec, kind, setting, kwargs, torch.device(device)).run(), None
    except _Refused as refused:
        return None, refused.reason


def resolve_hook(spec: str, *, kind: HookKind, setting: str,
                 kwargs: Optional[Mapping[str, Any]] = None,
                 device: Union[str, torch.device] = "cpu") -> Callable[..., Tensor]:
    """Import, check and probe one hook; refuse with `UnsupportedConfigError` naming ``setting``.

    ``kwargs=None``: the attribute is the hook.  A mapping: the attribute is a factory and
    ``factory(**kwargs)`` is the hook (failures name ``<setting>_kwargs``).  ``device`` is
    where the probe runs: pass the model's device if the hook captures device tensors.
    """
    hook, reason = _resolve(spec, kind, setting, kwargs, device)
    if reason is not None:
        raise UnsupportedConfigError(reason, context="attention hook")
    assert hook is not None
    return hook


def resolve_hooks(settings: TurboAttentionSettings, *, device: Union[str, torch.device] = "cpu"
                  ) -> tuple[Optional[Callable[..., Tensor]], Optional[Callable[..., Tensor]]]:
    """``(mask_mod, score_mod)`` of ``settings`` (None when unset); both hooks' failures in one error."""
    mask_mod = score_mod = None
    reasons: list[Reason] = []
    if settings.turbo_flex_attention_mask_mod is not None:
        mask_mod, reason = _resolve(settings.turbo_flex_attention_mask_mod, "mask_mod",
                                    "turbo_flex_attention_mask_mod",
                                    settings.turbo_flex_attention_mask_mod_kwargs, device)
        reasons += [reason] if reason else []
    if settings.turbo_flex_attention_score_mod is not None:
        score_mod, reason = _resolve(settings.turbo_flex_attention_score_mod, "score_mod",
                                     "turbo_flex_attention_score_mod",
                                     settings.turbo_flex_attention_score_mod_kwargs, device)
        reasons += [reason] if reason else []
    if reasons:
        raise UnsupportedConfigError(reasons, context="attention hooks")
    return mask_mod, score_mod


__all__ = ["ARITY", "PROBE_SHAPE", "HookKind", "resolve_hook", "resolve_hooks"]
