"""The project's exception types.

Every refusal names the user's own setting and, where one exists, the supported
alternative.  Build-time refusals collect *every* failing reason and raise once.
"""

from __future__ import annotations

import reprlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence


SHORT_REPR_LIMIT = 200
"""Most characters `short_repr` gives for one quoted value."""


class _BoundedRepr(reprlib.Repr):
    """`reprlib.Repr` that also bounds subclasses of the builtin containers and other
    mappings: for those reprlib would fall back to a full ``repr``."""

    def repr1(self, x: Any, level: int) -> str:
        for base in (dict, list, tuple, set, frozenset):
            if isinstance(x, base) and type(x) is not base:
                return getattr(self, f"repr_{base.__name__}")(x, level)
        if isinstance(x, Mapping) and not isinstance(x, dict):
            return self.repr_dict(x, level)
        return super().repr1(x, level)


def short_repr(value: Any, limit: int = SHORT_REPR_LIMIT) -> str:
    """``repr(value)`` in at most ``limit`` characters, for quoting a user's value in a message.

    Containers are shown to four levels and a few items per level (`reprlib`), so the
    time and size do not grow with the value: a YAML alias bomb or a heavily shared
    kwargs dict would otherwise turn a refusal into gigabytes of text.
    """
    shower = _BoundedRepr()
    shower.maxlevel = 4
    shower.maxstring = shower.maxother = shower.maxlong = limit
    try:
        text = shower.repr(value)
    except Exception:  # noqa: BLE001 - e.g. an int too long to print; the type still says something
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:max(limit - 3, 0)] + "..."


class PrimusExtError(Exception):
    """Base class of every error raised on purpose by primus_ext."""


@dataclass(frozen=True)
class Reason:
    """One failing rule: which settings it reads, why it fails, what to do instead."""

    settings: tuple[str, ...]
    reason: str
    alternative: str = ""
    code: str = ""
    """The rule that failed (a behaviour number such as ``B22``, or a rule name)."""

    def render(self) -> str:
        keys = ", ".join(self.settings)
        text = f"[{keys}] {self.reason}"
        if self.alternative:
            text += f" Alternative: {self.alternative}"
        return text


class _ReasonedError(PrimusExtError, ValueError):
    """An error carrying one or more `Reason`s, all rendered in the message."""

    headline = "primus_ext refused this configuration"

    def __init__(self, reasons: Reason | str | Iterable[Reason], *, context: str = "") -> None:
        message: Optional[str] = None
        if isinstance(reasons, str):
            rewrapped = self._rewrapping(reasons)
            if rewrapped is not None:
                reasons, context, message = rewrapped.reasons, rewrapped.context, reasons
            else:
                reasons = [Reason(settings=(), reason=reasons)]
        elif isinstance(reasons, Reason):
            reasons = [reasons]
        self.reasons: Sequence[Reason] = tuple(reasons)
        self.context = context
        super().__init__(self._message() if message is None else message)

    @classmethod
    def _rewrapping(cls, message: str) -> Optional["_ReasonedError"]:
        """The error being handled when ``message`` re-raises it as ``type(e)(f"{e} ...")``.

        megatron-core's ``build_module`` does exactly that to every error raised while a
        module is built; without this the reasons (and ``.settings``) would be lost and the
        headline repeated once per nesting level.
        """
        current = sys.exc_info()[1]
        if type(current) is cls and message.startswith(str(current)):
            return current  # type: ignore[return-value]
        return None

    @property
    def codes(self) -> tuple[str, ...]:
        """The failing rules' codes, in order."""
        return tuple(r.code for r in self.reasons if r.code)

    @property
    def settings(self) -> tuple[str, ...]:
        """Every setting named by any reason, in order, without repeats."""
        seen: dict[str, None] = {}
        for r in self.reasons:
            for s in r.settings:
                seen.setdefault(s, None)
        return tuple(seen)

    def _message(self) -> str:
        head = self.headline + (f" ({self.context})" if self.context else "")
        if len(self.reasons) == 1:
            return f"{head}: {self.reasons[0].render()}"
        lines = [f"{head}: {len(self.reasons)} reasons"]
        lines += [f"  {i}. {r.render()}" for i, r in enumerate(self.reasons, 1)]
        return "\n".join(lines)


class UnsupportedConfigError(_ReasonedError):
    """Raised at model-build time for a configuration that cannot be run exactly."""

    headline = "primus_ext cannot build this attention"


class UnsupportedOptionError(UnsupportedConfigError):
    """Raised by the ``primus-ext`` commands for a command-line option they cannot use (exit 2, like a refused
    config)."""

    headline = "cannot use this command-line option"


class UnsupportedInputError(_ReasonedError):
    """Raised at call time for inputs the built plan did not promise to handle."""

    headline = "primus_ext refused this attention call"


__all__ = ["PrimusExtError", "Reason", "UnsupportedConfigError", "UnsupportedInputError", "UnsupportedOptionError",
           "short_repr"]
