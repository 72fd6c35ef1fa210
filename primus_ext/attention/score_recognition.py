"""Recognise a user ``score_mod`` hook as something Primus-Turbo's kernels take.

The kernels take no arbitrary score function: only the identity and ALiBi (as
``alibi_slopes``) run there.  A logit softcap is recognised so that its refusal can
say exactly why (no Turbo backward supports it).  Everything else is ``other``.
The hook is probed on random scores over a small position grid; see each check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor

from .pattern import ScoreMod, index_grid
from .recognition import Device, shaped as _shaped

@dataclass(frozen=True)
class ScoreRecognition:
    """``kind``: ``identity``, ``alibi`` (slopes in Turbo's sign), ``softcap`` or ``other``."""

    kind: str
    alibi_slopes: Optional[tuple[float, ...]]
    softcap: Optional[float]
    reason: str


_PROBE_LEN = 16
_SCORE_RANGE = 60.0
_SATURATION_PROBE = 1.0e6


def _score_probe(score_mod: ScoreMod, scores: Tensor) -> Tensor:
    out = score_mod(scores.clone(), *index_grid(*scores.shape, scores.device))
    return _shaped(out, tuple(scores.shape), "score_mod", scores.device)


def _close(a: Tensor, b: Tensor, rtol: float, atol: float) -> bool:
    return bool(torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol))


def _check_alibi(mod: ScoreMod, s64: Tensor, s64b: Tensor, s32: Tensor,
                 out64: Tensor, out32: Tensor) -> Union[tuple[float, ...], str]:
    """Slopes if ``mod(s) == s + slope[h] * (kv - q)`` with float32 slopes, else why not."""
    _, H, Q, K = s64.shape
    pos = torch.arange(max(Q, K), device=s64.device)
    rel = (pos[:K].view(1, -1) - pos[:Q].view(-1, 1)).double()
    d, d2 = out64.double() - s64, _score_probe(mod, s64b).double() - s64b
    if not _close(d, d2, 0.0, 1e-9):
        return "score_mod(s) - s changes with the score s"
    slopes = (d[0] * rel).sum((-2, -1)) / (rel * rel).sum()  # least squares per head
    slopes32 = slopes.float()
    bias = slopes32.double().view(1, H, 1, 1) * rel
    tol = 1e-9 * (_SCORE_RANGE + Q * float(slopes.abs().max()))
    if not bool(((d - bias).abs() <= tol).all()):
        b, h, q, k = ((d - bias).abs() > tol).nonzero()[0].tolist()
        if bool(((d - slopes.view(1, H, 1, 1) * rel).abs() <= tol).all()):
            return (f"the ALiBi slope of head {h} ({float(slopes[h])!r}) is not a float32 value "
                    "(Primus-Turbo's alibi_slopes are float32)")
        return (f"score_mod(s) - s at b={b}, h={h}, q={q}, kv={k} is {float(d[b, h, q, k]):.6g}, "
                f"not slope[h] * (kv - q) = {float(bias[0, h, q, k]):.6g}")
    expected32 = s32 + slopes32.view(1, H, 1, 1) * rel.float()
    if not _close(out32, expected32, 4e-7, 4e-7 * (_SCORE_RANGE + Q * float(slopes.abs().max()))):
        return "on float32 scores it does not match s + slope[h] * (kv - q)"
    return tuple(float(x) for x in slopes32)


def _check_softcap(mod: ScoreMod, s64: Tensor, s32: Tensor,
                   out64: Tensor, out32: Tensor) -> Union[float, str]:
    """``c`` if ``mod(s) == c * tanh(s / c)`` for every position, else why not."""
    perm = torch.randperm(s64.numel(), generator=torch.Generator().manual_seed(1)).to(s64.device)
    shuffled = _score_probe(mod, s64.flatten()[perm].view(s64.shape))
    if not _close(shuffled.flatten(), out64.flatten()[perm], 1e-12, 1e-12):
        return "it depends on the position (b, h, q or kv), not only on the score"
    big = _score_probe(mod, torch.full_like(s64, _SATURATION_PROBE)).double()
    c = float(big.mean())
    if not (0.0 < c < 0.99 * _SATURATION_PROBE) or not bool((big == big.flatten()[0]).all()):
        return f"it does not saturate (score_mod({_SATURATION_PROBE:g}) = {c:.6g})"
    for _ in range(20):  # c * tanh(x / c) = y; exact in one step once tanh(x / c) == 1
        c = float(big.flatten()[0]) / math.tanh(_SATURATION_PROBE / c)
    if not _close(out64, c * torch.tanh(s64 / c), 1e-9, 1e-9 * c):
        return f"it saturates at {c:.6g} but is not {c:.6g} * tanh(s / {c:.6g})"
    if not _close(out32, c * torch.tanh(s32.double() / c), 1e-5, 1e-5 * c):
        return f"on float32 scores it is not {c:.6g} * tanh(s / {c:.6g})"
    return c


def recognize_score(score_mod: Optional[ScoreMod], num_heads: int, *,
                    device: Device = "cpu") -> ScoreRecognition:
    """Classify ``score_mod`` as identity, ALiBi, tanh softcap or other.

    Probed with seeded random scores in [-60, 60] (float64 and float32) on a
    ``B=2, H=num_heads, 16 x 16`` position grid.

    * identity: the score comes back unchanged, bit for bit, in both dtypes.
    * ALiBi: ``score_mod(s) - s == slope[h] * (kv - q)`` with one float32 slope per
      head (Primus-Turbo's ``alibi_slopes`` are float32), read from the probe,
      independent of b and of s, to the rounding of the arithmetic.  Slopes use
      Turbo's sign: standard ALiBi, which penalises keys further in the past, has
      positive slopes.
    * softcap: depends on s alone and equals ``c * tanh(s / c)``; ``c`` is read from
      a saturating probe (s = 1e6) and then checked on the random scores.

    Only offsets ``kv - q`` within +-15 are seen: e.g. an ALiBi clipped beyond 15
    positions would pass.
    """
    if int(num_heads) < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")
    if score_mod is None:
        return ScoreRecognition("identity", None, None, "no score_mod")
    gen = torch.Generator().manual_seed(0)
    shape = (2, int(num_heads), _PROBE_LEN, _PROBE_LEN)

    def draw(dtype: torch.dtype) -> Tensor:
        return ((torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * _SCORE_RANGE).to(
            device=device, dtype=dtype)

    s64, s64b, s32 = draw(torch.float64), draw(torch.float64), draw(torch.float32)
    out64, out32 = _score_probe(score_mod, s64), _score_probe(score_mod, s32)
    if bool((out64 == s64).all()) and bool((out32 == s32).all()):
        return ScoreRecognition("identity", None, None, "returns the score unchanged")
    same = s64[:1].expand(shape).contiguous()
    by_batch = _score_probe(score_mod, same)
    if not _close(by_batch[1], by_batch[0], 1e-12, 1e-12):
        return ScoreRecognition("other", None, None, "depends on the batch index")
    alibi = _check_alibi(score_mod, s64, s64b, s32, out64, out32)
    if isinstance(alibi, tuple):
        return ScoreRecognition("alibi", alibi, None,
                                f"ALiBi: score + slope[h] * (kv - q) with slopes {list(alibi)}")
    cap = _check_softcap(score_mod, s64, s32, out64, out32)
    if isinstance(cap, float):
        return ScoreRecognition("softcap", None, cap,
                                f"tanh softcap: {cap:g} * tanh(score / {cap:g})")
    return ScoreRecognition("other", None, None,
                            f"is not identity, ALiBi or a tanh softcap: not ALiBi because {alibi}; "
                            f"not a softcap because {cap}")


__all__ = ["ScoreRecognition", "recognize_score"]
