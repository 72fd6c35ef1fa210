"""The refusal catalogues' machinery: a refusal as data (code, settings, one wording, alternative), its
registries, and the helpers every project error is raised through.

Two catalogues: what one call is refused for (`CALL_RULES`, raised one at a time by `refuse`) and what a
build is refused for outside a layer's rule table (`BUILD_REFUSALS`: settings, hooks, ``check``, Primus,
checkpoints, the self-test; raised by `refuse_build`).  A layer's own table is `primus_ext.plan.rules.RULES`;
reasons it and these give, collected, are raised once by `refuse_all`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..errors import Reason, UnsupportedConfigError, UnsupportedInputError, UnsupportedOptionError


@dataclass(frozen=True)
class Refusal:
    """One refusal of a catalogue; ``settings``, ``reason`` and ``alternative`` are format templates."""

    code: str
    settings: tuple[str, ...]
    reason: str
    alternative: str = ""

    def reason_for(self, **values: Any) -> Reason:
        """The `Reason` with ``values`` filled in; a setting whose template fills in empty is not named, and one
        written ``{*name}`` names each of the settings in ``values[name]``."""
        named: list[str] = []
        for template in self.settings:
            if template.startswith("{*") and template.endswith("}"):
                named.extend(values[template[2:-1]])
            elif filled := template.format(**values):
                named.append(filled)
        return Reason(tuple(named), self.reason.format(**values), self.alternative.format(**values), self.code)


CALL_RULES: dict[str, Refusal] = {}
"""Every call-time rule, by code."""


def rule(code: str, settings: tuple[str, ...], reason: str, alternative: str = "") -> Refusal:
    """Declare a call-time rule (once per code)."""
    if code in CALL_RULES:
        raise ValueError(f"call-time rule {code} declared twice")
    found = CALL_RULES[code] = Refusal(code, settings, reason, alternative)
    return found


BUILD_REFUSALS: dict[str, tuple[Refusal, ...]] = {}
"""Every build-time refusal outside a layer's rule table, by code: a code (a row of docs/refusals.md) may have
several wordings, one per way it happens."""


def build_rule(code: str, settings: tuple[str, ...], reason: str, alternative: str = "") -> Refusal:
    """Declare a build-time refusal: one that settings, a hook, a YAML, Primus or a checkpoint show before (or
    apart from) a layer's rule table."""
    found = Refusal(code, settings, reason, alternative)
    if found in BUILD_REFUSALS.get(code, ()):
        raise ValueError(f"build-time refusal {code} declared twice with one wording")
    BUILD_REFUSALS[code] = BUILD_REFUSALS.get(code, ()) + (found,)
    return found


def refuse_build(found: Refusal, context: str = "", **values: Any) -> UnsupportedConfigError:
    """The build-time error of ``found`` with ``values`` filled in (raise it)."""
    return UnsupportedConfigError(found.reason_for(**values), context=context)


def refuse_option(found: Refusal, **values: Any) -> UnsupportedOptionError:
    """The error of a ``primus-ext`` command-line option ``found`` refuses (raise it): not an attention's."""
    return UnsupportedOptionError(found.reason_for(**values))


def refuse_all(reasons: Sequence[Reason], context: str = "", *, at_call: bool = False
               ) -> UnsupportedConfigError | UnsupportedInputError:
    """One error of every reason collected from the catalogues (raise it): a build's, or a call's
    (``at_call``) where a call is refused for what a build would be."""
    if not all(type(reason) is Reason for reason in reasons):
        raise TypeError("refuse_all takes the Reason objects of the catalogues, not text")
    return (UnsupportedInputError if at_call else UnsupportedConfigError)(list(reasons), context=context)


def on_ranks(reason: Reason, ranks: Sequence[int]) -> Reason:
    """``reason`` as it holds on some tensor-parallel ranks only, which it names."""
    return Reason(reason.settings, f"on tensor-parallel rank{'s' if len(ranks) > 1 else ''} "
                  f"{', '.join(map(str, ranks))}: {reason.reason}", reason.alternative, reason.code)


def refuse_compiled(refused: UnsupportedInputError) -> "CompiledCallRefusal":
    """``refused`` as a call refused while ``torch.compile`` traces it (raise it): see `CompiledCallRefusal`."""
    return CompiledCallRefusal(list(refused.reasons), context=refused.context)


def refuse(found: Refusal, context: str = "", **values: Any) -> UnsupportedInputError:
    """The error of ``found`` with ``values`` filled in (raise it).

    While ``torch.compile`` traces a call, the error is raised here, as `CompiledCallRefusal`:
    Dynamo cannot trace the construction of an exception of ours, and re-raises only an
    ``AssertionError`` unchanged (it wraps anything else in its own error)."""
    if torch.compiler.is_compiling():
        _refuse_traced(found.code, context, tuple((key, _constant(value)) for key, value in values.items()), ())
    return UnsupportedInputError(found.reason_for(**values), context=context)


class CompiledCallRefusal(UnsupportedInputError, AssertionError):
    """A call refused while ``torch.compile`` traces it: our `UnsupportedInputError`, with its reasons.

    Dynamo re-raises an ``AssertionError`` raised during tracing as it is, and wraps any other
    error in its own ``InternalTorchDynamoError``; so this is what reaches the user.
    """


def _constant(value: Any) -> Any:
    """A value as a graph constant: plain values as they are, anything else as its text."""
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


@torch.compiler.assume_constant_result  # run for real while a call is traced
def _refuse_traced(code: str, context: str, values: tuple, settings: tuple) -> None:
    raise CompiledCallRefusal([_naming(CALL_RULES[code].reason_for(**dict(values)), settings)], context=context)


def _naming(reason: Reason, settings: tuple[str, ...]) -> Reason:
    """``reason`` also naming ``settings`` (after its own, without repeats)."""
    if not settings:
        return reason
    named = tuple(dict.fromkeys(reason.settings + tuple(settings)))
    return Reason(named, reason.reason, reason.alternative, reason.code)


def refuse_naming(found: Refusal, settings: tuple[str, ...], context: str = "", **values: Any
                  ) -> UnsupportedInputError:
    """`refuse`, also naming ``settings`` (after the rule's own, without repeats): for a rule whose
    settings only the call knows, such as the checks that block a kernel route."""
    if torch.compiler.is_compiling():
        _refuse_traced(found.code, context, tuple((key, _constant(value)) for key, value in values.items()),
                       tuple(settings))
    return UnsupportedInputError(_naming(found.reason_for(**values), settings), context=context)


__all__ = ["BUILD_REFUSALS", "CALL_RULES", "CompiledCallRefusal", "Refusal", "build_rule", "on_ranks", "refuse", "refuse_all",
           "refuse_build", "refuse_naming", "refuse_option", "rule"]
