"""``--turbo-build``: which Primus-Turbo build's kernel dispatch ``check`` / ``selftest --arch`` assume.

Where Primus-Turbo is installed its build is read from its signatures
(`primus_ext.backends.turbo_build.installed_build`) and a different ``--turbo-build`` is refused:
the installed one is what runs.  Elsewhere the CPU fake imitates the named build (a6a16cd by
default), and the output says which.
"""

from __future__ import annotations

from typing import Optional

from ..backends import turbo_import_problem
from ..backends.turbo import kernel_build
from ..backends.turbo_build import BUILDS, build_named

NAMES = tuple(BUILDS)


def build_option_problem(name: Optional[str], arch: Optional[str]) -> Optional[str]:
    """Why ``--turbo-build name`` cannot hold here (our words, naming the option), or None."""
    if name is None:
        return None
    if arch is None:
        return f"--turbo-build {name} names the build whose kernel dispatch --arch checks; give --arch too"
    if not turbo_import_problem():
        installed = kernel_build()
        if installed.name != name:
            return (f"--turbo-build {name}, but the installed Primus-Turbo is build {installed.describe()} (read from "
                    "its signatures), and that is what runs here: drop --turbo-build")
    return None


def stand_in_note(name: Optional[str]) -> str:
    """The words saying which build the CPU fake imitates."""
    build = build_named(name or "a6a16cd")
    other = next(n for n in NAMES if n != build.name)
    return f"Primus-Turbo build {build.describe()} assumed (--turbo-build {other} for the other)"


__all__ = ["NAMES", "build_option_problem", "stand_in_note"]
