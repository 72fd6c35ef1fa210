"""After a proof, the hook itself, called as torch calls it, must agree with what was proven (B31).

A proof is about the traced graph.  The hook's meaning is what torch computes when it
calls the hook: ``create_block_mask`` and ``flex_attention`` call it under ``torch.vmap``
with 0-d int64 index tensors (`torch.nn.attention.flex_attention._vmap_for_bhqkv`), and
the ``reference`` backend calls it on broadcast index grids.  Both calls are made here,
at points the proof chose: each window edge, chunk cut and document boundary, one either
side, powers of two up to the largest index a proof covers (where a narrow integer
wraps), and both ends of the rank's head range.  Any difference refuses the proof; an
agreement is evidence only, never a reason to run a hook on a fixed kernel.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Sequence

import torch

from .. import refusals as R
from .ops import INDEX_BOUND
from ..attention.pattern import Pattern

_POWERS = sorted({0, 1, 2, 3} | {p + d for e in (4, 6, 8, 10, 12, 15, 16, 24, 31, 32, 39)
                                 for p in (1 << e,) for d in (-1, 0, 1)} | {INDEX_BOUND - 1})


def _positions(pattern: Optional[Pattern], constants: Sequence[int] = ()) -> tuple[list[int], list[int]]:
    """Query rows, and offsets ``q_idx - kv_idx`` around every feature of ``pattern`` (or a plain grid) and
    every integer constant of the hook (where its arithmetic may begin to wrap or a comparison to flip)."""
    rows = set(_POWERS)
    offsets = {0, 1, -1, 2, -2} | {s * (1 << e) for e in FAR for s in (1, -1)}
    for c in constants:
        if abs(c) < INDEX_BOUND:
            rows |= {abs(c) - 1, abs(c), abs(c) + 1}
            offsets |= {c - 1, c, c + 1, -c - 1, -c, -c + 1}
    if pattern is not None:
        edges = ([pattern.left] if pattern.left >= 0 else []) + ([-pattern.right] if pattern.right >= 0 else [])
        for edge in edges:  # q_idx - kv_idx at the window's last allowed key, either side
            offsets |= {edge - 1, edge, edge + 1}
        cuts: list[int] = list(pattern.cuts or ())
        if pattern.chunk is not None:
            cuts += [pattern.chunk * k for k in (1, 2, 3)] + [pattern.chunk * (INDEX_BOUND // pattern.chunk - 1)]
        for cut in cuts:
            rows |= {cut - 1, cut, cut + 1}
    return sorted(x for x in rows if 0 <= x < INDEX_BOUND), sorted(offsets)


FAR = (4, 8, 12, 16, 20, 24, 31, 32)
"""Offsets ``2**e`` either side of the diagonal at which every head is called too (not only the end heads)."""
BATCHES = (0, 1, 2, 7)
"""Batch indices the hook is called at (a batch index is a value a hook may compare with, as any index)."""
MAX_HEADS = 256
"""Heads the cross-check calls a hook at, all of the rank's up to this many (a per-head table may differ at any)."""


def _heads(head_offset: int, num_heads: Optional[int]) -> tuple[list[int], list[int]]:
    """``(every head called near the diagonal, the heads also called at every pair of chosen rows)``."""
    count = num_heads or 4
    top = head_offset + count
    ends = sorted({h for h in (head_offset, head_offset + 1, top - 2, top - 1) if head_offset <= h < top})
    if count <= MAX_HEADS:
        return list(range(head_offset, top)), ends
    step = count / (MAX_HEADS - len(ends))
    return sorted(set(ends) | {head_offset + int(i * step) for i in range(MAX_HEADS - len(ends))}), ends


def _grid(rows: torch.Tensor, offsets: torch.Tensor, full: bool) -> tuple[torch.Tensor, torch.Tensor]:
    near = rows.view(-1, 1) - offsets.view(1, -1)
    q, kv = rows.view(-1, 1).expand_as(near).reshape(-1), near.reshape(-1)
    if full:
        q, kv = torch.cat([q, rows.repeat_interleave(len(rows))]), torch.cat([kv, rows.repeat(len(rows))])
    keep = (kv >= 0) & (kv < INDEX_BOUND)
    return q[keep], kv[keep]


def _pairs(pattern: Optional[Pattern], heads: tuple[list[int], list[int]],
           constants: Sequence[int] = ()) -> list[torch.Tensor]:
    """Flat ``b, h, q_idx, kv_idx`` vectors: each chosen row with the keys at each chosen offset, for the batch
    indices `BATCHES` and every head; at the end heads also with the keys at every chosen row."""
    rows_list, offsets_list = _positions(pattern, constants)
    rows, offsets = torch.tensor(rows_list, dtype=torch.int64), torch.tensor(offsets_list, dtype=torch.int64)
    every, ends = heads
    parts = []
    for chosen, full in ((every, False), (ends, True)):
        q, kv = _grid(rows, offsets, full)
        planes = torch.tensor([(b, h) for b in BATCHES for h in chosen], dtype=torch.int64).view(-1, 2)
        n = len(q)
        parts.append([planes[:, 0].repeat_interleave(n), planes[:, 1].repeat_interleave(n), q.repeat(len(planes)),
                      kv.repeat(len(planes))])
    return [torch.cat(pieces) for pieces in zip(*parts)]


def _calls(fn: Callable[..., Any], index: Sequence[torch.Tensor],
           score: Optional[torch.Tensor]) -> list[tuple[str, Any]]:
    """``(how, result)`` of the two calls torch and the reference backend make, on flat point vectors."""
    out: list[tuple[str, Any]] = []
    args = ((score,) if score is not None else ()) + tuple(index)
    for how in ("torch.vmap on 0-d index tensors, as create_block_mask and flex_attention call it",
                "index tensors, as the reference backend calls it"):
        try:
            with torch.no_grad():
                result = torch.vmap(fn)(*args) if how.startswith("torch") else fn(*args)
            out.append((how, torch.as_tensor(result).expand(index[0].shape)))
        except Exception as exc:  # noqa: BLE001 - a hook that fails when really called is not what was proven
            out.append((how, f"{type(exc).__name__}: {exc}"))
    return out


def _first(bad: torch.Tensor, index: Sequence[torch.Tensor]) -> str:
    at = int(bad.nonzero()[0, 0])
    return ", ".join(f"{n}={int(t[at])}" for n, t in zip(("b", "h", "q_idx", "kv_idx"), index))


def check_mask(hook: Callable[..., Any], pattern: Pattern, num_heads: Optional[int], head_offset: int,
               constants: Sequence[int] = ()) -> str:
    """Empty when ``hook`` called both ways equals ``pattern`` at every chosen point; else what differs."""
    index = _pairs(pattern, _heads(head_offset, num_heads), constants)
    expected = pattern.allows(index[2], index[3])
    for how, got in _calls(hook, index, None):
        if isinstance(got, str):
            return f"raises {got} when called with {how}"
        if got.dtype != torch.bool:
            return f"returns {got.dtype}, not a boolean mask, when called with {how}"
        bad = got != expected
        if bool(bad.any()):
            allows = bool(got[int(bad.nonzero()[0, 0])])
            return (f"behaves differently when called than when traced: called with {how}, at "
                    f"{_first(bad, index)} it {'allows' if allows else 'blocks'} attention, the proven "
                    f"{pattern.describe()} does not")
    return ""


_F32 = torch.finfo(torch.float32)
EXTREME_SCORES = (0.0, -0.0, _F32.tiny, -_F32.tiny, _F32.tiny / 8, 1e-30, -1e-30, 1e10, -1e10, 1e30, -1e30, 1e37,
                  -1e37, 1e38, -1e38, _F32.max / 2, _F32.max, -_F32.max)
"""Scores where float32 arithmetic underflows or overflows, every one a finite float32 score a kernel may see."""


def check_score(hook: Callable[..., Any], kind: str, slopes: Optional[Sequence[float]], num_heads: Optional[int],
                head_offset: int, constants: Sequence[int] = ()) -> str:
    """Empty when ``hook`` called both ways computes ``kind`` (identity / ALiBi forms) at the chosen points, with
    ordinary scores and the float32 extremes."""
    every, ends = _heads(head_offset, num_heads)
    if slopes is not None:
        every, ends = ([h for h in hs if h - head_offset < len(slopes)] for hs in (every, ends))
    index = _pairs(None, (every, ends), constants)
    gen = torch.Generator().manual_seed(0)
    score = (torch.randn(index[0].shape, generator=gen) * 4).float()
    extreme = torch.tensor(EXTREME_SCORES, dtype=torch.float32)
    score[: len(score) // 2] = extreme.repeat(len(score) // (2 * len(extreme)) + 1)[: len(score) // 2]
    expected = score.double()
    if kind != "identity" and slopes is not None:
        slope = torch.tensor(slopes, dtype=torch.float64)[index[1] - head_offset]
        distance = (index[3] - index[2]).double()
        expected = expected + slope * (distance if kind == "alibi" else -distance.abs())
    scale = expected.abs() + score.double().abs() + 1.0
    for how, got in _calls(hook, index, score):
        if isinstance(got, str):
            return f"raises {got} when called with {how}"
        if not got.dtype.is_floating_point:
            return f"returns {got.dtype}, not a score, when called with {how}"
        # what the kernel's own float32 sum gives: a finite score plus a bias rounds, it does not overflow
        bad = ~((got.double() - expected.float().double()).abs() <= 1e-5 * scale)
        if bool(bad.any()):
            at = int(bad.nonzero()[0, 0])
            return (f"behaves differently when called than when traced: called with {how}, at "
                    f"{_first(bad, index)} with score {float(score[at]):.4g} it returns {float(got[at]):.6g}, the "
                    f"proven {kind} gives {float(expected[at]):.6g}")
    return ""


def as_torch_calls(hook: Callable[..., Any], kind: str) -> Callable[..., Any]:
    """``hook`` called on broadcast index grids the way torch calls it: under ``torch.vmap``, one 0-d index
    per cell (a hook outside the provable subset may tell the two calls apart; torch's is its meaning)."""
    def run(*args: torch.Tensor) -> torch.Tensor:
        shape = torch.broadcast_shapes(*(t.shape for t in args))
        flat = [t.expand(shape).reshape(-1) for t in args]
        try:
            return torch.vmap(hook)(*flat).reshape(shape)
        except R.HOOK_ERRORS as exc:  # the user's hook, at an index it was not written for: ours, named
            top = [int(t.max()) if t.numel() else -1 for t in args[-4:]]
            raise R.refuse(R.HOOK_RAISED, kind=kind, error=f"{type(exc).__name__} ({exc})", top=top) from exc

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return run(b, h, q_idx, kv_idx)

    def score_mod(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                  kv_idx: torch.Tensor) -> torch.Tensor:
        return run(score, b, h, q_idx, kv_idx)

    wrapped = mask_mod if kind == "mask_mod" else score_mod
    wrapped.__wrapped__ = hook  # type: ignore[attr-defined]
    return wrapped


TORCH_CALL_CODES = frozenset(as_torch_calls(lambda *a: a[0], kind).__code__ for kind in ("mask_mod", "score_mod"))
"""The code objects of `as_torch_calls`'s wrappers: what tells one of them from a function that only says so."""

_SMOKE: "weakref.WeakKeyDictionary[Any, dict[str, str]]" = weakref.WeakKeyDictionary()


def torch_call_problem(hook: Callable[..., Any], kind: str) -> str:
    """Empty when ``hook`` runs as torch calls it on a small grid (2 x 2 x 8 x 8, the probe's); else what it
    raised.  Kept per hook object: a model's layers share their hooks."""
    try:
        known = _SMOKE.setdefault(hook, {})
    except TypeError:  # not weakly referenceable
        known = {}
    if kind not in known:
        known[kind] = _smoke(hook, kind)
    return known[kind]


def range_problem(hook: Callable[..., Any], kind: str, head_offset: int, num_heads: int) -> str:
    """Empty when ``hook``, called as torch calls it, runs at every head of the layer (their global indices, at
    positions 0 to 7); else what it raised.  A per-head table too short shows here, at build, not at the first
    call.  Positions are the call's to try (`primus_ext.refusals.HOOK_RAISED`): a proof, and so the plan,
    depends on no sequence length.  Only what a hook raises for an index counts (`HOOK_ERRORS`); a hook torch
    cannot call at all is B31's."""
    grid = torch.cartesian_prod(torch.tensor([0]), torch.arange(head_offset, head_offset + num_heads),
                                torch.arange(8), torch.arange(8))
    index = list(grid.unbind(1))
    args = ((torch.zeros(len(grid)),) if kind == "score_mod" else ()) + tuple(index)
    try:
        with torch.no_grad():
            torch.vmap(hook)(*args)
    except R.HOOK_ERRORS as exc:
        return f"raises {type(exc).__name__}: {exc} at heads {head_offset}..{head_offset + num_heads - 1}"
    except Exception:  # noqa: BLE001 - not an index problem: the B31 checks report what torch cannot call
        return ""
    return ""


def _smoke(hook: Callable[..., Any], kind: str) -> str:
    grid = torch.cartesian_prod(*(torch.arange(n) for n in (2, 2, 8, 8)))
    index = list(grid.unbind(1))
    score = torch.randn(len(grid), generator=torch.Generator().manual_seed(0)) if kind == "score_mod" else None
    how, got = _calls(hook, index, score)[0]
    return f"raises {got} when called with {how}" if isinstance(got, str) else ""


__all__ = ["TORCH_CALL_CODES", "as_torch_calls", "check_mask", "check_score", "range_problem", "torch_call_problem"]
