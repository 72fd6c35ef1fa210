"""Turn ``"package.module:attr"`` hook strings into checked mask_mod / score_mod callables.

B2 asks that a bad hook is refused when the model is built, not at the first forward
pass hours into a job.  So resolution imports the module, follows the attribute path,
checks the call signature, and runs the hook once on a tiny probe grid (``B=2, H=2,
8x8``) to see that it returns what FlexAttention expects.  Nothing is ``eval``'d: the
string only names a module for `importlib.import_module` and attributes for `getattr`.

B32: a config only *names* a hook; it cannot run programs.  Probing calls the named
object, so ``"subprocess:run"`` with ``_kwargs {args: ..., shell: true}`` would run a
shell command.  Hence only a plain Python function (``def``/``lambda``) defined outside
the standard library, or an object registered by `primus_ext.attention.library`, is
ever called; a standard-library or ``__main__`` module (a program's command line) is not
even imported.  A factory is called with ``<setting>_kwargs`` only if it opted in with
``@primus_ext.hook_factory``.  Whatever an import, a factory or the probe raises
(``SystemExit`` too) becomes a refusal naming the setting, quoting values bounded.

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

from ..attention.library import is_hook_factory
from ..attention.pattern import index_grid
from .. import refusals as R
from ..errors import Reason, short_repr
from .hook_trust import is_stdlib as _is_stdlib, untrusted as _untrusted
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


def _arity_problem(sig: inspect.Signature, count: int) -> Optional[str]:
    """Why ``count`` positional arguments do not fit ``sig``, from the hook's point of view."""
    kinds = inspect.Parameter
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    star = any(p.kind is kinds.VAR_POSITIONAL for p in params)
    keyword_only = [p.name for p in params if p.kind is kinds.KEYWORD_ONLY and p.default is p.empty]
    if len(positional) < count and not star:
        return f"it takes {len(positional)} positional arguments, too few for the {count} it is given"
    if len(required) > count:
        return f"it requires {len(required)} positional arguments, too many: only {count} are given"
    if keyword_only:
        return f"its keyword-only parameters ({', '.join(keyword_only)}) have no default and are never passed"
    return None if _binds(sig, count) else "the arguments do not bind"



def _parameters(factory: Callable[..., Any]) -> str:
    """`` (it takes left, right=0)``: the factory's parameters as its signature gives them, or empty."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return ""
    names = [p.name if p.default is p.empty else f"{p.name}={p.default!r}" for p in params]
    return f" (it takes {', '.join(names)})" if names else " (it takes none)"

class _Refused(Exception):
    """Internal: carries the one reason that stopped resolution of a hook."""

    def __init__(self, reason: Reason) -> None:
        super().__init__(reason.render())
        self.reason = reason


_EXC_TEXT_LIMIT = 300


def _describe_exc(exc: BaseException) -> str:
    """``Type: message`` in bounded size and time: an exception may carry the user's kwargs."""
    plain = all(isinstance(arg, (str, int, float)) for arg in exc.args)  # str(exc) is then cheap
    try:  # a user's exception class may override __str__ with anything, SystemExit included
        text = str(exc) if plain else short_repr(exc.args[0] if len(exc.args) == 1 else exc.args)
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - the message is unreadable; its type still says what happened
        text = "<the exception's message could not be read>"
    cut = text if len(text) <= _EXC_TEXT_LIMIT else text[:_EXC_TEXT_LIMIT - 3] + "..."
    return f"{type(exc).__name__}: {cut}"


def _public_names(obj: Any) -> list[str]:
    """Names to suggest from ``obj``; none when its ``__dir__`` raises (it is the user's code)."""
    try:
        return [n for n in dir(obj) if isinstance(n, str) and not n.startswith("_")]
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - a module __dir__ may raise anything, SystemExit too
        return []


class _Resolver:
    """Resolution of one hook string; each step raises `_Refused` with a precise reason."""

    def __init__(self, spec: Any, kind: HookKind, setting: str,
                 kwargs: Optional[Mapping[str, Any]], device: torch.device) -> None:
        if kind not in ARITY:
            raise ValueError(f"kind must be 'mask_mod' or 'score_mod', got {kind!r}")
        self.spec, self.kind, self.setting, self.kwargs, self.device = spec, kind, setting, kwargs, device
        self.kwargs_key = f"{setting}_kwargs"

    def refuse(self, reason: str, alternative: str, *, with_kwargs: bool = False, trust: bool = False) -> _Refused:
        """Rule B2 (the hook cannot be resolved) or, with ``trust``, B32 (a config may not name it)."""
        found = R.HOOK_UNTRUSTED if trust else R.HOOK_UNRESOLVED
        return _Refused(found.reason_for(setting=self.setting, kwargs_key=self.kwargs_key if with_kwargs else "",
                                         spec=short_repr(self.spec), what=reason, alternative=alternative))

    def run(self) -> Callable[..., Tensor]:
        module_name, attr_path = self.split()
        if _is_stdlib(module_name):  # refused before import: importing already runs its code
            raise self.refuse(f"`{module_name}` is a standard-library, builtins or torch module; a config may "
                              "only name a hook from your own code or from primus_ext, so it was not "
                              "imported (B32).", f"{self.own_function()}.", trust=True)
        if "__main__" in module_name.split("."):  # refused before import: it would run the program
            raise self.refuse(f"`{module_name}` is a `__main__` module: importing it runs that package's command "
                              "line with this process's arguments, so it was not imported (B32).",
                              "name the function in a regular module of the package (\"my_pkg.hooks:"
                              f"my_{self.kind}\"), not in its `__main__`.", trust=True)
        target = self.follow(self.import_module(module_name), module_name, attr_path)
        self.check_named(target, attr_path)
        hook = self.call_factory(target, attr_path) if self.kwargs is not None else self.as_hook(target, attr_path)
        self.check_arity(hook)
        self.probe(hook)
        return hook

    # ------------------------------------------------------------- trust (B32)
    def check_named(self, target: Any, attr_path: str) -> None:
        """Only plain functions outside the stdlib, or the library's own objects, are called."""
        if not callable(target):
            raise self.refuse(f"`{attr_path}` is a value of type {type(target).__name__}, not a callable.",
                              f"point {self.setting} at a function, e.g. {_EXAMPLE[self.kind]}.")
        what = _untrusted(target)
        if what is not None:
            raise self.refuse(f"`{attr_path}` is {what}; a config may only name a plain Python function "
                              "defined outside the standard library, or a primus_ext library mask or "
                              "@hook_factory, because nothing else is ever called (B32).",
                              f"{self.own_function()}.", trust=True)

    def as_hook(self, target: Callable[..., Any], attr_path: str) -> Callable[..., Any]:
        """``_kwargs: null``: the attribute is the hook, unless it is a marked factory."""
        if not is_hook_factory(target):
            return target
        try:
            names = [p.name for p in inspect.signature(target).parameters.values()
                     if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        except (TypeError, ValueError):
            names = []
        add = f"add `{self.kwargs_key}: {{}}`"
        if names:
            add += f", or the factory's keywords: `{self.kwargs_key}: {{{', '.join(f'{n}: ...' for n in names)}}}`"
        raise self.refuse(f"`{attr_path}` is a hook factory (it makes the {self.kind} when called), but "
                          f"{self.kwargs_key} is null, so it would be used as the {self.kind} itself.",
                          f"{add}.", with_kwargs=True)

    def own_function(self) -> str:
        args = ", ".join(ARITY[self.kind])
        return (f"write `def my_{self.kind}({args})` in your own module and name it "
                f"(\"my_pkg.hooks:my_{self.kind}\"), or use a primus_ext.attention.masks factory")

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
        except KeyboardInterrupt:
            raise  # the user stopping the run is not a config error
        except BaseException as exc:  # noqa: BLE001 - SystemExit too: an import must not end the build
            raise self.refuse(f"importing `{module_name}` failed: {_describe_exc(exc)}",
                              f"fix the error raised while importing `{module_name}`.") from exc

    def follow(self, obj: Any, module_name: str, attr_path: str) -> Any:
        walked = module_name
        for part in attr_path.split("."):
            try:
                obj = getattr(obj, part)
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # noqa: BLE001 - a module __getattr__ may raise anything, SystemExit too
                if not isinstance(exc, AttributeError):
                    raise self.refuse(f"reading `{part}` of `{walked}` raised {_describe_exc(exc)}",
                                      f"fix the error raised by `{walked}`.") from exc
                names = _public_names(obj)
                close = difflib.get_close_matches(part, names, n=3, cutoff=0.6)
                sep = "." if ":" in walked else ":"
                hint = f"did you mean {', '.join(f'`{walked}{sep}{c}`' for c in close)}?" if close else (
                    f"check the attribute name in `{walked}`.")
                raise self.refuse(f"`{walked}` has no attribute `{part}`.", hint) from exc
            walked = f"{walked}{'.' if ':' in walked else ':'}{part}"
        return obj

    def call_factory(self, factory: Callable[..., Any], attr_path: str) -> Any:
        if not is_hook_factory(factory):
            raise self.refuse(f"{self.kwargs_key} is set, so `{attr_path}` would be called as a factory, "
                              "but a config may only call a factory marked with @primus_ext.hook_factory "
                              "(B32).",
                              "decorate the factory with `@primus_ext.hook_factory` (a factory you do not "
                              f"own: call it from your own decorated one), or set {self.kwargs_key}: null "
                              f"if `{self.spec}` is itself the {self.kind}.",
                              with_kwargs=True, trust=True)
        try:
            hook = factory(**dict(self.kwargs or {}))
        except KeyboardInterrupt:
            raise  # the user stopping the run is not a config error
        except BaseException as exc:  # noqa: BLE001 - the factory's own error (SystemExit too) is the message
            given = short_repr(dict(self.kwargs or {}))
            raise self.refuse(f"calling the factory with {self.kwargs_key} = {given} "
                              f"failed: {_describe_exc(exc)}",
                              f"give {self.kwargs_key} the keyword arguments the factory accepts"
                              f"{_parameters(factory)}, "
                              f"or set it to null if `{self.spec}` is itself the {self.kind}.",
                              with_kwargs=True) from exc
        if not callable(hook):
            raise self.refuse(f"the factory called with {self.kwargs_key} returned a value of type "
                              f"{type(hook).__name__}, not a {self.kind}.",
                              f"set {self.kwargs_key}: null if `{self.spec}` is itself the {self.kind}.",
                              with_kwargs=True)
        what = _untrusted(hook)  # the probe calls it next: the same rule as for a named hook
        if what is not None:
            raise self.refuse(f"the factory returned {what}; the {self.kind} it returns must be a plain "
                              "Python function defined outside the standard library, or a primus_ext "
                              "library mask (B32).",
                              f"return a nested `def {self.kind}({', '.join(ARITY[self.kind])})` "
                              "from the factory.", with_kwargs=True, trust=True)
        return hook

    def check_arity(self, hook: Callable[..., Any]) -> None:
        try:
            sig = inspect.signature(hook)
        except (TypeError, ValueError):
            return  # a registered object without a signature: the probe decides
        params = ARITY[self.kind]
        problem = _arity_problem(sig, len(params))
        if problem is None:
            return
        factory_hint = ""
        if self.kwargs is None and _binds(sig, 0):
            factory_hint = (f" It takes no arguments, so it looks like a factory: decorate it with "
                            f"@primus_ext.hook_factory and set {self.kwargs_key}: {{}}.")
        raise self.refuse(f"a {self.kind} is called as {self.kind}({', '.join(params)}) but this "
                          f"callable has signature {short_repr(str(sig))[1:-1]}: {problem}.{factory_hint}",
                          f"define it with exactly {len(params)} positional parameters "
                          f"({', '.join(params)}).",
                          with_kwargs=self.kwargs is not None)

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
        except KeyboardInterrupt:
            raise  # the user stopping the run is not a config error
        except BaseException as exc:  # noqa: BLE001 - report the hook's own failure, SystemExit too
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
        raise R.refuse_all([reason], context="attention hook")
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
        raise R.refuse_all(reasons, context="attention hooks")
    return mask_mod, score_mod


__all__ = ["ARITY", "PROBE_SHAPE", "HookKind", "resolve_hook", "resolve_hooks"]
