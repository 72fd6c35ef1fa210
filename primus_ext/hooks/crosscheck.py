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
from typing import Any, Callable, Iterator, Optional, Sequence

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


Block = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""``b``, ``h`` and paired ``q_idx``, ``kv_idx`` vectors: the hook is called at every batch, head and pair."""


def _blocks(pattern: Optional[Pattern], heads: tuple[list[int], list[int]],
            constants: Sequence[int] = ()) -> list[Block]:
    """Each chosen row with the keys at each chosen offset, for the batch indices `BATCHES` and every head; at
    the end heads also with the keys at every chosen row.  Kept as blocks, not flat points: a call maps its
    batch, head and pair axes as torch maps them, and no index vector is repeated for every plane."""
    rows_list, offsets_list = _positions(pattern, constants)
    rows, offsets = torch.tensor(rows_list, dtype=torch.int64), torch.tensor(offsets_list, dtype=torch.int64)
    batches = torch.tensor(BATCHES, dtype=torch.int64)
    return [(batches, torch.tensor(chosen, dtype=torch.int64), *_grid(rows, offsets, full))
            for chosen, full in zip(heads, (False, True)) if chosen]


_MAPS = {False: ((None, None, 0, 0), (None, 0, None, None), (0, None, None, None)),
         True: ((0, None, None, 0, 0), (0, None, 0, None, None), (0, 0, None, None, None))}
"""``in_dims`` of the nested vmaps over pairs, heads and batches (with a score: its own axes too)."""


def _calls(fn: Callable[..., Any], block: Block, score: Optional[torch.Tensor]) -> Iterator[tuple[str, Any]]:
    """``(how, result)`` of the two calls torch and the reference backend make, each result shaped
    ``(batches, heads, pairs)``: nested ``torch.vmap`` over 0-d indices, and broadcast index tensors.  Made one
    at a time: a caller that stops at the first difference (or needs torch's call only) makes no other."""
    b, h, q, kv = block
    shape = (len(b), len(h), len(q))
    for how in ("torch.vmap on 0-d index tensors, as create_block_mask and flex_attention call it",
                "index tensors, as the reference backend calls it"):
        try:
            with torch.no_grad():
                if how.startswith("torch"):
                    mapped = fn
                    for dims in _MAPS[score is not None]:
                        mapped = torch.vmap(mapped, in_dims=dims)
                    result = mapped(*((score,) if score is not None else ()), b, h, q, kv)
                else:
                    result = fn(*((score,) if score is not None else ()), b.view(-1, 1, 1), h.view(1, -1, 1),
                                q.view(1, 1, -1), kv.view(1, 1, -1))
            got: Any = torch.as_tensor(result).expand(shape)
        except Exception as exc:  # noqa: BLE001 - a hook that fails when really called is not what was proven
            got = f"{type(exc).__name__}: {exc}"
        yield how, got


def _first(bad: torch.Tensor, block: Block) -> str:
    i, j, k = (int(x) for x in bad.nonzero()[0])
    b, h, q, kv = block
    return f"b={int(b[i])}, h={int(h[j])}, q_idx={int(q[k])}, kv_idx={int(kv[k])}"


def check_mask(hook: Callable[..., Any], pattern: Pattern, num_heads: Optional[int], head_offset: int,
               constants: Sequence[int] = ()) -> str:
    """Empty when ``hook`` called both ways equals ``pattern`` at every chosen point; else what differs."""
    for block in _blocks(pattern, _heads(head_offset, num_heads), constants):
        expected = pattern.allows(block[2], block[3])
        for how, got in _calls(hook, block, None):
            if isinstance(got, str):
                return f"raises {got} when called with {how}"
            if got.dtype != torch.bool:
                return f"returns {got.dtype}, not a boolean mask, when called with {how}"
            bad = got != expected
            if bool(bad.any()):
                allows = bool(got[tuple(bad.nonzero()[0])])
                return (f"behaves differently when called than when traced: called with {how}, at "
                        f"{_first(bad, block)} it {'allows' if allows else 'blocks'} attention, the proven "
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
    gen = torch.Generator().manual_seed(0)
    for block in _blocks(None, (every, ends), constants):
        b, h, q, kv = block
        score = _scores((len(b), len(h), len(q)), gen)
        expected = score.double()
        if kind != "identity" and slopes is not None:
            slope = torch.tensor(slopes, dtype=torch.float64)[h - head_offset].view(1, -1, 1)
            distance = (kv - q).double().view(1, 1, -1)
            expected = expected + slope * (distance if kind == "alibi" else -distance.abs())
        # what the kernel's own float32 sum gives: a finite score plus a bias rounds, it does not overflow
        target = expected.float().double()
        tolerance = 1e-5 * (expected.abs() + score.double().abs() + 1.0)
        for how, got in _calls(hook, block, score):
            if isinstance(got, str):
                return f"raises {got} when called with {how}"
            if not got.dtype.is_floating_point:
                return f"returns {got.dtype}, not a score, when called with {how}"
            bad = ~((got.double() - target).abs() <= tolerance)
            if bool(bad.any()):
                at = tuple(bad.nonzero()[0])
                return (f"behaves differently when called than when traced: called with {how}, at "
                        f"{_first(bad, block)} with score {float(score[at]):.4g} it returns {float(got[at]):.6g}, "
                        f"the proven {kind} gives {float(expected[at]):.6g}")
    return ""


def _scores(shape: tuple[int, int, int], gen: torch.Generator) -> torch.Tensor:
    """Ordinary scores, and on half the points the float32 extremes (`EXTREME_SCORES`)."""
    score = (torch.randn(shape, generator=gen) * 4).float().reshape(-1)
    extreme = torch.tensor(EXTREME_SCORES, dtype=torch.float32)
    half = len(score) // 2
    score[:half] = extreme.repeat(half // len(extreme) + 1)[:half]
    return score.reshape(shape)


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
    keys = torch.arange(8)
    block = (torch.arange(2), torch.arange(2), keys.repeat_interleave(8), keys.repeat(8))
    score = torch.randn((2, 2, 64), generator=torch.Generator().manual_seed(0)) if kind == "score_mod" else None
    how, got = next(_calls(hook, block, score))
    return f"raises {got} when called with {how}" if isinstance(got, str) else ""


__all__ = ["TORCH_CALL_CODES", "as_torch_calls", "check_mask", "check_score", "range_problem", "torch_call_problem"]
