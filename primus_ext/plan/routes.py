"""The kernel backends a layer's Turbo calls reach on the target arch, and B33's refusals.

A layer makes dense calls, packed calls, or both (`LayerFacts.packed`).  Each becomes
`CallFeatures` for Primus-Turbo's dispatcher model (`primus_ext.backends.dispatch`),
which says which kernel backend runs it on gfx942 / gfx950, or why none does, and
which known defect applies.  The arch is the ``turbo_arch`` setting, or on ROCm the
device's ``gcnArchName``; elsewhere it is unknown and nothing is checked here.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple

from ..attention.pattern import Pattern, pattern_from_flash_args
from ..backends.arch import device_arch, presented
from ..backends.dispatch import (ARCHES, BUILD_A6A16CD, DEFAULT_ORDER, DENSE, VARLEN, CallFeatures, Route, Selection,
                                 TurboBuild, default_scale, route)
from .. import refusals as R
from ..errors import Reason
from .facts import LayerFacts


def resolve_arch(setting: str) -> Tuple[Optional[str], str]:
    """``(arch, where it came from)``; the arch is None when it cannot be known here."""
    if setting != "auto":
        return setting, f"turbo_arch: {setting}"
    name = device_arch()
    if name is not None:
        return name, f"device {'(presented by a test double) ' if presented() else 'gcnArchName '}{name}"
    return None, "no ROCm device and turbo_arch: auto"


def arch_reasons(setting: str) -> list[Reason]:
    """B33: a ``turbo_arch`` naming another arch than the device's would check (and lay out
    tensors for) kernels other than the ones that run."""
    device = device_arch()
    if setting == "auto" or device is None or device == setting:
        return []
    return [R.ARCH_NOT_DEVICE.reason_for(setting=setting, device=device)]


def _features(facts: LayerFacts, arch: str, entry: str, pattern: Pattern, *, sink: bool, deterministic: bool,
              alibi: bool, dropout: float, build: TurboBuild, equal_documents: bool = False) -> CallFeatures:
    return CallFeatures(
        arch=arch, entry=entry, dtype=facts.dtype or "bf16", head_dim=facts.head_dim,
        head_dim_v=facts.v_dim, heads=facts.num_heads, kv_heads=facts.kv_heads,
        causal=pattern.right == 0, window=pattern.window, sink=sink,
        dropout=dropout, alibi=alibi, deterministic=deterministic,
        default_scale=default_scale(facts.softmax_scale, facts.head_dim),
        equal_documents=True if equal_documents and entry == VARLEN else None, sbhd_storage=True, build=build,
    )


def layer_routes(facts: LayerFacts, arch: Optional[str], *, dense_pattern: Optional[Pattern],
                 window: Optional[Tuple[int, int]], sink: bool, deterministic: bool,
                 alibi: bool, selection: Selection = DEFAULT_ORDER, build: TurboBuild = BUILD_A6A16CD,
                 equal_documents: bool = False, mask_documents: bool = False,
                 shared_prefix: bool = False) -> Tuple[Tuple[str, Route], ...]:
    """``(("dense" | "packed", route), ...)`` for the calls this layer can make on ``arch``.

    ``dense_pattern``: the dense calls' mask (None: the caller's causal / window).
    Packed calls use the configured window inside each document, with documents of one length
    when ``equal_documents`` (``packed_equal_documents``, checked per call).  With ``mask_documents``
    (``reset_attention_mask`` on dense batches) dense calls run on the packed entry too.  A layer with dropout also
    makes calls without it (evaluation): those can reach another kernel backend, so they are
    routed too (kinds ``"dense in eval"``, ``"packed in eval"``) where they fare otherwise.  Varlen calls
    not promised equal documents may still bring them (one document is), and upstream's dispatcher reads the
    boundaries at run time: those are routed too (kind ``"<kind> with equal documents"``) where they fare
    otherwise (docs/fidelity.md, fact `flydsl-varlen-runtime`).  With ``shared_prefix`` (``packed_shared_prefix``,
    B37) a packed row also makes the *cross* call of its trees: every response token against its whole prompt,
    non-causal, without the sink (which the packed call's softmax holds), kind ``"shared-prefix cross"``.
    """
    if arch is None or arch not in ARCHES:
        return ()
    flash = pattern_from_flash_args(facts.causal, window or (-1, -1))
    out: list[Tuple[str, Route]] = []
    rates = (facts.attention_dropout, 0.0) if facts.attention_dropout > 0 else (0.0,)
    for rate in rates:
        when = " in eval" if rate == 0.0 and len(rates) > 1 else ""
        common = dict(sink=sink, deterministic=deterministic, alibi=alibi, dropout=rate, build=build)
        if facts.packed is not False:
            out += _varlen_kinds("packed" + when, _features(facts, arch, VARLEN, flash,
                                                            equal_documents=equal_documents, **common), selection)
            if shared_prefix:
                cross = dict(common, sink=False)
                out += _varlen_kinds("shared-prefix cross" + when,
                                     _features(facts, arch, VARLEN, Pattern(-1, -1), **cross), selection)
        if facts.packed is not True:
            pattern = dense_pattern or flash
            entry = VARLEN if pattern.documents or mask_documents else DENSE
            features = _features(facts, arch, entry, Pattern(pattern.left, pattern.right), **common)
            out += _varlen_kinds("dense" + when, features, selection)
    training = {kind: _outcome(found) for kind, found in out if " in eval" not in kind}
    return tuple((kind, found) for kind, found in out
                 if " in eval" not in kind or training.get(kind.replace(" in eval", "")) != _outcome(found))


_EQUAL = " with equal documents"


def _outcome(found: Route) -> tuple:
    return found.backend, found.failure, found.defects


def _varlen_kinds(kind: str, features: CallFeatures, selection: Selection) -> list[Tuple[str, Route]]:
    """``kind``'s route, and for varlen calls not known to bring equal documents the route of those that do,
    where it differs (upstream's FlyDSL gate reads the boundaries of each call)."""
    found = route(features, selection)
    out = [(kind, found)]
    if features.entry == VARLEN and features.equal_documents is not True:
        equal = route(dataclasses.replace(features, equal_documents=True), selection)
        if _outcome(equal) != _outcome(found):
            out.append((kind + _EQUAL, equal))
    return out


def route_reasons(routes: Sequence[Tuple[str, Route]], packed: Optional[bool] = None) -> list[Reason]:
    """One B33 reason per call kind that would fail or compute wrongly on the arch.

    ``packed`` is `LayerFacts.packed`: when unknown (None), packed calls are checked too,
    and the user is told how to say that batches are never packed.
    """
    reasons = []
    for kind, found in routes:
        unknown_packing = kind.startswith("packed") and packed is None
        reason = found.reason(f"{kind} calls", settings=("packed_sequences",) if unknown_packing else (),
                              alternatives=("if batches are never packed (THD), say so with packed_sequences: false",)
                              if unknown_packing else ())
        if reason is not None:
            reasons.append(reason)
    return reasons


def describe_routes(routes: Sequence[Tuple[str, Route]]) -> Tuple[str, ...]:
    """``("dense: FlyDSL", "packed: AITER (slower: FlyDSL takes bf16 only)")``."""
    out = []
    for kind, found in routes:
        if found.backend is None:
            out.append(f"{kind}: none")
            continue
        if len(found.candidates) > 1:
            out.append(f"{kind}: {' or '.join(found.candidates)} (autotune)")
            continue
        if found.selection.pin is not None:
            out.append(f"{kind}: {found.backend} (pinned)")
            continue
        note = found.fallback_note
        slow = f" (slower fallback: {note.split(': ', 1)[1]})" if ": " in note else ""
        out.append(f"{kind}: {found.backend}{slow}")
    return tuple(out)


__all__ = ["arch_reasons", "describe_routes", "layer_routes", "resolve_arch", "route_reasons"]
