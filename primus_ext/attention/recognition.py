"""Recognise user-written ``mask_mod`` / ``score_mod`` hooks as fixed-kernel patterns.

Primus-Turbo's kernels cannot run an arbitrary mask; they take a flash window, and
packed documents through their varlen entry.  A user hook is therefore *evaluated*
here and classified exactly; a hook that is not exactly one of those patterns is
reported with a reason a user can act on, never approximated.

What `recognize_mask` checks
----------------------------
* A mask carrying ``primus_pattern`` (the library masks) is trusted and not called.
* Grids of at most ``2**26`` cells: the mask is evaluated on every (q, kv) cell, in
  row chunks of about ``2**21`` cells, at ``(b, h)`` = (0, 0), (1, 0), (0, 1), (1, 1).
  Any difference between those probes is a batch or head dependence.  A candidate
  pattern is derived from the per-row extent of the allowed keys and then compared
  with the evaluated mask cell by cell over the whole grid, so a recognised pattern
  is exact on this grid.  Indices other than 0 and 1 for b and h are not probed.
* Larger grids: the candidate window is derived from, and checked cell by cell on,
  the leading ``min(q_len, 4096) x min(kv_len, 4096)`` block plus 256 complete rows
  (the first 64, the last 64 and 128 evenly spaced, each over the full kv length).
  Other rows are not checked.  Packed documents are refused at that size.
* A window bound that never binds inside the grid is reported as ``-1``; the mask
  may still be bounded at longer lengths, which is why `verify_pattern` runs again
  whenever a new shape is seen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, NamedTuple, Optional, Union

import torch
from torch import Tensor

from .pattern import FULL, MaskMod, Pattern

Device = Union[str, torch.device]

EXACT_CELL_LIMIT = 2 ** 26  # above it: leading block + sampled rows, no documents
LEADING_BLOCK = 4096
SAMPLED_EDGE_ROWS = 64
SAMPLED_SPREAD_ROWS = 128
CHUNK_CELLS = 2 ** 21  # cells per mask_mod call: bounds memory to a few tens of MiB

_PROBES = ((0, 0), (1, 0), (0, 1), (1, 1))
_PROBE_WORDS = {(1, 0): "the batch index", (0, 1): "the head index",
                (1, 1): "the batch and head indices together"}


@dataclass(frozen=True)
class MaskRecognition:
    """``pattern is None``: no fixed kernel can run this mask; ``reason`` says why."""

    pattern: Optional[Pattern]
    reason: str


class _Region(NamedTuple):
    rows: Tensor  # query indices evaluated, each on keys 0 .. kv_extent - 1
    kv_extent: int


# ----------------------------------------------------------------------------- evaluation
def _check_lengths(q_len: int, kv_len: int) -> None:
    if int(q_len) < 1 or int(kv_len) < 1:
        raise ValueError(f"q_len and kv_len must be >= 1, got {q_len} and {kv_len}")


def _regions(q_len: int, kv_len: int, device: torch.device) -> tuple[list[_Region], str]:
    """The parts of the grid that are evaluated; the text is empty when that is all of it."""
    if q_len * kv_len <= EXACT_CELL_LIMIT:
        return [_Region(torch.arange(q_len, device=device), kv_len)], ""
    lead_q, lead_kv = min(q_len, LEADING_BLOCK), min(kv_len, LEADING_BLOCK)
    edge = min(SAMPLED_EDGE_ROWS, q_len)
    sampled = torch.cat([
        torch.arange(edge), torch.arange(q_len - edge, q_len),
        torch.linspace(0, q_len - 1, SAMPLED_SPREAD_ROWS).round().long(),
    ]).unique().to(device)
    return [_Region(torch.arange(lead_q, device=device), lead_kv), _Region(sampled, kv_len)], (
        f"checked on the leading {lead_q}x{lead_kv} block and on {sampled.numel()} sampled "
        f"complete rows of the {q_len}x{kv_len} grid")


def _chunks(region: _Region) -> Iterator[Tensor]:
    step = max(1, CHUNK_CELLS // region.kv_extent)
    for start in range(0, region.rows.numel(), step):
        yield region.rows[start:start + step]


def _evaluate(mask_mod: MaskMod, b: int, h: int, rows: Tensor, kv_extent: int) -> Tensor:
    """``[len(rows), kv_extent]`` boolean mask at batch ``b`` and head ``h``."""
    kw = dict(device=rows.device, dtype=torch.int64)
    out = mask_mod(torch.full((1, 1, 1, 1), b, **kw), torch.full((1, 1, 1, 1), h, **kw),
                   rows.view(1, 1, -1, 1), torch.arange(kv_extent, **kw).view(1, 1, 1, -1))
    return shaped(out, (1, 1, rows.numel(), kv_extent), "mask_mod", rows.device).bool()[0, 0]


def shaped(out: object, shape: tuple[int, ...], what: str, device: torch.device) -> Tensor:
    out = torch.as_tensor(out, device=device)
    try:
        return torch.broadcast_to(out, shape)
    except RuntimeError as exc:
        raise ValueError(f"{what} returned shape {tuple(out.shape)}, which does not broadcast "
                         f"to the probe grid {shape}") from exc


def _first_difference(a: Tensor, b: Tensor, rows: Tensor) -> tuple[int, int]:
    r, k = (a != b).nonzero()[0].tolist()
    return int(rows[r]), int(k)


def _describe_row(row: Tensor) -> str:
    """``"0..2 and 4"`` style description of the allowed keys of one row."""
    idx = row.nonzero().flatten()
    if idx.numel() == 0:
        return "nothing"
    breaks = (idx[1:] - idx[:-1] != 1).nonzero().flatten()
    starts = torch.cat([idx[:1], idx[breaks + 1]]).tolist()
    ends = torch.cat([idx[breaks], idx[-1:]]).tolist()
    runs = [f"{s}" if s == e else f"{s}..{e}" for s, e in zip(starts, ends)]
    if len(runs) > 4:
        runs = runs[:3] + [f"{len(runs) - 3} more ranges"]
    return runs[0] if len(runs) == 1 else ", ".join(runs[:-1]) + " and " + runs[-1]


# ----------------------------------------------------------------------------- fitting
class _Extents(NamedTuple):
    """Per evaluated row: first and last allowed key, how many, and the keys evaluated."""

    q: Tensor
    lo: Tensor
    hi: Tensor
    count: Tensor
    kv_extent: Tensor


def _scan(mask_mod: MaskMod, regions: list[_Region]) -> tuple[Optional[_Extents], str]:
    """Pass 1: batch/head dependence, per-row extents, first row with a gap."""
    parts: list[tuple[Tensor, ...]] = []
    gap = ""
    for region in regions:
        cols = torch.arange(region.kv_extent, device=region.rows.device)
        for rows in _chunks(region):
            base = _evaluate(mask_mod, 0, 0, rows, region.kv_extent)
            for b, h in _PROBES[1:]:
                other = _evaluate(mask_mod, b, h, rows, region.kv_extent)
                if not torch.equal(base, other):
                    q, k = _first_difference(base, other, rows)
                    return None, (f"depends on {_PROBE_WORDS[(b, h)]} (q={q}, kv={k} differs "
                                  f"between b=0, h=0 and b={b}, h={h}); fixed kernels share "
                                  "one mask across batch and heads")
            count = base.sum(1)
            lo = torch.where(base, cols, region.kv_extent).amin(1)
            hi = torch.where(base, cols, -1).amax(1)
            holes = ((count > 0) & (count != hi - lo + 1)).nonzero()
            if not gap and holes.numel():
                r = int(holes[0])
                gap = f"row {int(rows[r])} allows kv {_describe_row(base[r])}"
            parts.append((rows, lo, hi, count, torch.full_like(rows, region.kv_extent)))
    if gap:
        return None, f"is not a window or document pattern: {gap}"
    return _Extents(*(torch.cat(p) for p in zip(*parts))), ""


def _fit_bound(q: Tensor, reach: Tensor, binds: Tensor, side: str) -> tuple[Optional[int], str]:
    """The single window bound implied by the rows where it binds (``-1`` if none)."""
    values, rows = reach[binds], q[binds]
    if values.numel() == 0:
        return -1, ""
    first = int(values[0])
    if first < 0:
        return None, (f"row {int(rows[0])} excludes its own position on the {side} "
                      f"(a window bound cannot be negative)")
    other = (values != first).nonzero()
    if other.numel():
        i = int(other[0])
        return None, (f"row {int(rows[0])} reaches {first} keys to the {side} but row "
                      f"{int(rows[i])} reaches {int(values[i])}")
    return first, ""


def _fit_window(ext: _Extents, start: Tensor, end: Tensor) -> tuple[Optional[tuple[int, int]], str]:
    """Window (left, right) relative to each row's segment ``[start, end)``; empty rows skipped."""
    keep = ext.count > 0
    if not bool(keep.any()):
        return None, "allows nothing at all"
    q, lo, hi, s, e = ext.q[keep], ext.lo[keep], ext.hi[keep], start[keep], end[keep]
    left, why = _fit_bound(q, q - lo, lo > s, "left")
    if left is None:
        return None, why
    right, why = _fit_bound(q, hi - q, hi < e - 1, "right")
    if right is None:
        return None, why
    if left == -1 and not bool(keep.all()):
        # Rows past the key range are empty only if the left bound cuts them off.
        first_empty = int(ext.q[~keep].min())
        left = max(first_empty - int(ext.kv_extent[~keep].min()), 0)
    return (left, right), ""


def _document_cuts(ext: _Extents, length: int) -> list[int]:
    """Positions ``p`` where no query before p sees a key at/after p and vice versa."""
    order = torch.argsort(ext.q)
    lo, hi = ext.lo[order], ext.hi[order]
    before = torch.cummax(hi, 0).values[:-1]
    after = torch.flip(torch.cummin(torch.flip(lo, [0]), 0).values, [0])[1:]
    p = torch.arange(1, length, device=lo.device)
    return p[(before < p) & (after >= p)].tolist()


def _compare(mask_mod: MaskMod, pattern: Pattern, regions: list[_Region],
             probes: tuple[tuple[int, int], ...]) -> Optional[str]:
    """Pass 2: the mask against ``pattern.allows`` on every evaluated cell."""
    for region in regions:
        cols = torch.arange(region.kv_extent, device=region.rows.device)
        for rows in _chunks(region):
            expected = pattern.allows(rows.view(-1, 1), cols.view(1, -1))
            for b, h in probes:
                got = _evaluate(mask_mod, b, h, rows, region.kv_extent)
                if not torch.equal(got, expected):
                    q, k = _first_difference(got, expected, rows)
                    allowed = bool(got[int((rows == q).nonzero()[0]), k])
                    mine, theirs = ("allows", "blocks") if allowed else ("blocks", "allows")
                    where = "" if (b, h) == (0, 0) else f" (b={b}, h={h})"
                    return (f"at q={q}, kv={k}{where} the mask {mine} attention but "
                            f"{pattern.describe()} {theirs} it")
    return None


# ----------------------------------------------------------------------------- public: masks
def recognize_mask(mask_mod: Optional[MaskMod], q_len: int, kv_len: int, *,
                   device: Device = "cpu") -> MaskRecognition:
    """Classify ``mask_mod`` on the ``q_len x kv_len`` grid as full, causal, window or documents.

    See the module docstring for exactly which cells are checked.  ``None`` is full.
    """
    _check_lengths(q_len, kv_len)
    if mask_mod is None:
        return MaskRecognition(FULL, "no mask_mod: full attention")
    trusted = getattr(mask_mod, "primus_pattern", None)
    if trusted is not None:
        return MaskRecognition(trusted, f"library mask: {trusted.describe()} (carried, not probed)")
    try:
        return _classify(mask_mod, q_len, kv_len, device)
    except Exception as exc:  # noqa: BLE001 - the user's hook failed on this grid: it is not classified
        return MaskRecognition(None, f"raised {type(exc).__name__}: {exc} when evaluated on the "
                                     f"{q_len}x{kv_len} recognition grid")


def _classify(mask_mod: MaskMod, q_len: int, kv_len: int, device: Device) -> MaskRecognition:
    regions, sampled = _regions(q_len, kv_len, torch.device(device))
    coverage = sampled or f"checked on every cell of the {q_len}x{kv_len} grid"
    ext, why = _scan(mask_mod, regions)
    if ext is None:
        return MaskRecognition(None, why)
    window, why = _fit_window(ext, torch.zeros_like(ext.q), ext.kv_extent)
    if window is not None:
        candidate = Pattern(*window)
        why = _compare(mask_mod, candidate, regions, ((0, 0),))
        if why is None:
            return MaskRecognition(candidate, f"{candidate.describe()}, {coverage}")
    if sampled:
        return MaskRecognition(None, f"is not a window pattern: {why}; packed documents are only "
                                     f"recognised up to {EXACT_CELL_LIMIT} grid cells "
                                     f"(this grid has {q_len * kv_len})")
    found = _documents(mask_mod, ext, regions, q_len, kv_len)
    if isinstance(found, str):
        return MaskRecognition(None, f"is not a window or document pattern: {why}{found}")
    return MaskRecognition(found, f"{found.describe()} with boundaries {found.boundaries}, "
                                  f"{coverage}")


def _documents(mask_mod: MaskMod, ext: _Extents, regions: list[_Region], q_len: int,
               kv_len: int) -> Union[Pattern, str]:
    """Block-diagonal documents with one window inside each, or ``"; why not"`` (may be empty)."""
    if q_len != kv_len or not bool((ext.count > 0).all()):
        return ""
    cuts = _document_cuts(ext, q_len)
    if not cuts:
        return ""
    bounds = torch.tensor((0, *cuts, q_len), device=ext.q.device)
    doc = torch.bucketize(ext.q, bounds[1:-1], right=True)
    window, why = _fit_window(ext, bounds[doc], bounds[doc + 1])
    if window is None:
        return f"; inside the {len(cuts) + 1} diagonal blocks found, {why}"
    candidate = Pattern(window[0], window[1], boundaries=(0, *cuts, q_len))
    why = _compare(mask_mod, candidate, regions, ((0, 0),))
    return candidate if why is None else f"; as {len(cuts) + 1} documents, {why}"


def verify_pattern(mask_mod: Optional[MaskMod], pattern: Pattern, q_len: int, kv_len: int, *,
                   device: Device = "cpu") -> Optional[str]:
    """``None`` if ``mask_mod`` equals ``pattern`` at this shape, else why not.

    Run when a call brings a shape the mask was not recognised at: a window bound
    that never bound on the recognition grid may bind on a longer one.  The cells
    checked are those `recognize_mask` checks (every cell up to 2**26 cells, leading
    block plus sampled rows above), at b and h in {0, 1}.
    """
    _check_lengths(q_len, kv_len)
    if pattern.boundaries is not None:
        if q_len != kv_len:
            return f"packed documents need q_len == kv_len, got {q_len} and {kv_len}"
        if pattern.boundaries[-1] != q_len:
            return (f"the document boundaries cover {pattern.boundaries[-1]} tokens but this "
                    f"call has {q_len}")
    if mask_mod is None:
        mask_mod = FULL.mask_mod()
    trusted = getattr(mask_mod, "primus_pattern", None)
    if trusted is not None:
        if trusted == pattern:
            return None
        mask_mod = trusted.mask_mod()  # compare the two patterns; the user's mask is not called
    regions, _ = _regions(q_len, kv_len, torch.device(device))
    return _compare(mask_mod, pattern, regions, _PROBES)


__all__ = ["EXACT_CELL_LIMIT", "MaskRecognition", "recognize_mask", "shaped", "verify_pattern"]
