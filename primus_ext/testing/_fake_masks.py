"""How the fake Primus-Turbo flex layer turns a BlockMask into a flash window.

The real flex layer cannot run an arbitrary ``mask_mod``: it evaluates the mask on
the top-left corner of the index grid (at most 512 x 512), decides whether that is
full, causal or a causal sliding window, and hands the matching ``causal`` /
``window_size`` to its fixed flash kernel.  Anything it cannot prove is refused
with ``NotImplementedError``.  This module reproduces that contract on CPU, on
purpose *more* conservatively than the newest real builds (no document or band
recognition), so a project test that passes here cannot depend on a pattern a
given Turbo build may not recognise.

The probe is the expensive part, which is why the real layer memoises it per
BlockMask object; `MaskClassifier` does the same and counts the probes so tests
can check that callers reuse their BlockMask objects.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from ..attention.pattern import CAUSAL, FULL, Pattern

PROBE_LIMIT = 512
"""Largest side of the probed index grid, as in the real flex layer."""

_SCORE_PROBE = 16


def _probe_indices(size: int) -> list[int]:
    """Batch or head indices to probe: 0, 1 and the last one that exists.

    Only existing indices are used so that a mask_mod indexing a per-batch tensor
    (document ids, say) is not driven out of range by the probe itself.
    """
    return sorted({i for i in (0, 1, size - 1) if 0 <= i < size}) or [0]


def _grid(mask_mod: Callable[..., Any], b: int, h: int, nq: int, nk: int) -> Tensor:
    q_idx = torch.arange(nq).view(nq, 1)
    kv_idx = torch.arange(nk).view(1, nk)
    try:
        out = mask_mod(torch.tensor(b), torch.tensor(h), q_idx, kv_idx)
        return torch.as_tensor(out).to(torch.bool).broadcast_to((nq, nk))
    except Exception as exc:  # a mask_mod that cannot be evaluated cannot be classified
        raise NotImplementedError(
            f"fake Primus-Turbo flex layer: could not evaluate block_mask.mask_mod on the "
            f"probe grid ({type(exc).__name__}: {exc})"
        ) from exc


def _point(mask_mod: Callable[..., Any], q: int, kv: int) -> bool:
    zero = torch.tensor(0)
    return bool(torch.as_tensor(mask_mod(zero, zero, torch.tensor(q), torch.tensor(kv))).item())


def classify_grid(mask_mod: Callable[..., Any], batch: int, heads: int,
                  q_len: int, kv_len: int) -> Pattern:
    """Probe ``mask_mod`` and return the flash-convention Pattern it equals.

    Raises ``NotImplementedError`` for batch/head-dependent masks, for anything that
    is not full / causal / causal sliding window, and for windows whose edge is not
    strictly inside the probe grid (their width would have to be guessed).
    """
    nq, nk = min(q_len, PROBE_LIMIT), min(kv_len, PROBE_LIMIT)
    if nq <= 0 or nk <= 0:
        raise ValueError("fake Primus-Turbo flex layer needs positive sequence lengths")
    base = _grid(mask_mod, 0, 0, nq, nk)
    for b in _probe_indices(batch):
        for h in _probe_indices(heads):
            if (b, h) != (0, 0) and not torch.equal(_grid(mask_mod, b, h, nq, nk), base):
                raise NotImplementedError(
                    "fake Primus-Turbo flex layer: batch- or head-dependent block_mask "
                    f"(differs between (b=0, h=0) and (b={b}, h={h}))"
                )
    truncated = q_len > nq or kv_len > nk
    delta = torch.arange(nq).view(nq, 1) - torch.arange(nk).view(1, nk)
    if bool(base.all()):
        far = [(q_len - 1, 0), (0, kv_len - 1), (q_len - 1, kv_len - 1)]
        if truncated and not all(_point(mask_mod, q, kv) for q, kv in far):
            raise NotImplementedError(
                "fake Primus-Turbo flex layer: the probed corner is fully visible but the "
                f"mask restricts something beyond the {PROBE_LIMIT}-wide probe grid"
            )
        return FULL
    if bool((base & (delta < 0)).any()):
        raise NotImplementedError(
            "fake Primus-Turbo flex layer: block_mask lets a query see a later key and is "
            "not full attention (only full, causal and causal sliding window are supported)"
        )
    if not bool(base.any()):
        raise NotImplementedError("fake Primus-Turbo flex layer: block_mask masks everything")
    causal = delta >= 0
    if torch.equal(base, causal):
        if truncated and not _point(mask_mod, q_len - 1, 0):
            raise NotImplementedError(
                "fake Primus-Turbo flex layer: the probed corner is causal but a window edge "
                f"lies beyond the {PROBE_LIMIT}-wide probe grid; refusing to guess its width"
            )
        return CAUSAL
    width = int(delta[base].max())
    if not torch.equal(base, causal & (delta <= width)):
        raise NotImplementedError(
            "fake Primus-Turbo flex layer: block_mask is neither full, causal nor a causal "
            "sliding window (q >= kv and q - kv <= W)"
        )
    # Here width < nq - 1: a wider window would have looked causal on the grid and
    # been handled (or refused) above, so the edge was really observed.
    if truncated:
        last = q_len - 1
        checks = [(last - width, True), (last - width - 1, False)]
        if any(0 <= kv < kv_len and _point(mask_mod, last, kv) is not want for kv, want in checks):
            raise NotImplementedError(
                "fake Primus-Turbo flex layer: the window is not the same at the far end of "
                "the sequence, so no single window size describes it"
            )
    return Pattern(width, 0)


class MaskClassifier:
    """Memoised `classify_grid`, keyed by BlockMask identity and the call's shape.

    A WeakKeyDictionary keeps the memo from holding BlockMasks alive (BlockMask uses
    object identity for hashing).  Only successful classifications are stored, so a
    refused mask raises again on every call, like the real layer.
    """

    def __init__(self) -> None:
        self._memo: "weakref.WeakKeyDictionary[Any, dict[tuple[int, int, int, int], Pattern]]"
        self._memo = weakref.WeakKeyDictionary()
        self.probe_count = 0

    def __call__(self, block_mask: Any, batch: int, heads: int, q_len: int, kv_len: int) -> Pattern:
        key = (batch, heads, q_len, kv_len)
        per_mask = self._memo.get(block_mask)
        if per_mask is not None and key in per_mask:
            return per_mask[key]
        mask_mod = getattr(block_mask, "mask_mod", None)
        if not callable(mask_mod):
            raise NotImplementedError(
                "fake Primus-Turbo flex layer: block_mask has no callable mask_mod; build it "
                "with create_block_mask"
            )
        self.probe_count += 1
        pattern = classify_grid(mask_mod, batch, heads, q_len, kv_len)
        self._memo.setdefault(block_mask, {})[key] = pattern
        return pattern


def score_mod_is_identity(score_mod: Optional[Callable[..., Any]], heads: int,
                          q_len: int, kv_len: int) -> bool:
    """True when ``score_mod`` is None or returns random scores unchanged on a probe."""
    if score_mod is None:
        return True
    nq, nk = min(q_len, _SCORE_PROBE), min(kv_len, _SCORE_PROBE)
    gen = torch.Generator().manual_seed(0)
    score = torch.randn(nq, nk, generator=gen)
    q_idx = torch.arange(nq).view(nq, 1)
    kv_idx = torch.arange(nk).view(1, nk)
    for h in _probe_indices(heads):
        try:
            out = score_mod(score.clone(), torch.tensor(0), torch.tensor(h), q_idx, kv_idx)
        except Exception:
            return False
        if not torch.equal(torch.as_tensor(out).broadcast_to(score.shape), score):
            return False
    return True


__all__ = ["MaskClassifier", "PROBE_LIMIT", "classify_grid", "score_mod_is_identity"]
