"""Which Primus-Turbo build's kernel dispatch applies: read from the installed modules' signatures.

The dispatcher's gates and the FlyDSL backward's arguments changed after a6a16cd (docs/fidelity.md,
facts `pt509-gqa-gate`, `pt480-deterministic`, `pt469-gluon`):

* PT #509 widens FlyDSL's GQA gate from a power-of-two group in 8..256 to one in 1..256 with
  ``Hq * D % 128 == 0``; its ``_gqa_group_ok`` takes the head dim as a third argument;
* PT #480 gives both FlyDSL backward ``_impl`` wrappers a ``deterministic`` argument (default
  False: an atomic, non-reproducible dQ); before it the backward had one, reproducible, way;
* PT #469 adds the opt-in, forward-only Gluon backend (``BackendType.GLUON``) after HipKittens in
  the dense order; PT #481 a Triton dense backend for gfx1250 only, which takes no call on
  gfx942 / gfx950 and so changes nothing modelled here.

Each change is found by the signature or name it brings, never by a version string; a build with
some of them and not others is modelled as it is (`TurboBuild` holds one flag per change).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Optional

ATTENTION_IMPL = "primus_turbo.pytorch.kernels.attention.attention_impl"
FLYDSL_IMPL = "primus_turbo.pytorch.kernels.attention.attention_flydsl_impl"
CORE_BACKEND = "primus_turbo.pytorch.core.backend"


@dataclass(frozen=True)
class TurboBuild:
    """The kernel-dispatch facts of one Primus-Turbo build."""

    name: str
    wide_gqa: bool = False
    """PT #509: FlyDSL takes a power-of-two GQA group in 1..256 with ``Hq * D % 128 == 0``."""
    flydsl_deterministic: bool = False
    """PT #480: FlyDSL's backward takes ``deterministic`` (and is atomic, not reproducible, without it)."""
    gluon: bool = False
    """PT #469: the Gluon dense backend exists (opt-in, forward only)."""

    def describe(self) -> str:
        changes = [pr for pr, on in (("#509", self.wide_gqa), ("#480", self.flydsl_deterministic),
                                     ("#469", self.gluon)) if on]
        # PT #481 changes no default route on gfx942/gfx950, so the builds differ only in the three
        return (f"{self.name} (PT {', '.join(changes)} and #481)" if changes
                else f"{self.name} (before PT #509, #480, #469, #481)")


BUILD_A6A16CD = TurboBuild("a6a16cd")
BUILD_PT509 = TurboBuild("pt509", wide_gqa=True, flydsl_deterministic=True, gluon=True)
BUILDS = {b.name: b for b in (BUILD_A6A16CD, BUILD_PT509)}
"""The builds ``check --turbo-build`` names: a6a16cd, and a6a16cd with PT #509, #480, #469 and #481 merged."""


def _module(name: str) -> Optional[object]:
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - absent, or a build whose kernel layer fails to import
        return None


def _parameters(fn: object) -> Optional[tuple[str, ...]]:
    try:
        return tuple(inspect.signature(fn).parameters)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def installed_build() -> Optional[TurboBuild]:
    """The build of the installed Primus-Turbo, from its signatures; None when none is importable
    or its FlyDSL dispatch layer is absent (then no FlyDSL gate applies, and a6a16cd's is assumed)."""
    impl, flydsl = _module(ATTENTION_IMPL), _module(FLYDSL_IMPL)
    if impl is None or flydsl is None:
        return None
    gate = _parameters(getattr(impl, "_gqa_group_ok", None))
    backward = _parameters(getattr(flydsl, "flash_attn_sbhd_flydsl_backward_impl", None))
    if gate is None or backward is None:
        return None
    core = _module(CORE_BACKEND)
    kinds = getattr(core, "BackendType", None)
    found = TurboBuild("installed", wide_gqa=len(gate) >= 3, flydsl_deterministic="deterministic" in backward,
                       gluon=kinds is not None and "GLUON" in getattr(kinds, "__members__", {}))
    for known in BUILDS.values():
        if (known.wide_gqa, known.flydsl_deterministic, known.gluon) == (
                found.wide_gqa, found.flydsl_deterministic, found.gluon):
            return known
    return found


def build_named(name: str) -> TurboBuild:
    """``BUILDS[name]``; a ValueError naming the known builds otherwise."""
    if name not in BUILDS:
        raise ValueError(f"unknown Primus-Turbo build {name!r}; known: {', '.join(BUILDS)}")
    return BUILDS[name]


__all__ = ["BUILDS", "BUILD_A6A16CD", "BUILD_PT509", "TurboBuild", "build_named", "installed_build"]
