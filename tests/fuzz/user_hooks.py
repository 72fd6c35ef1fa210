"""Hooks the way a user writes them: plain functions in their own module.

None of these carries a ``primus_pattern`` tag, so the project has to evaluate
(probe) each one to find out what it is.  Settings name them as
``"tests.fuzz.user_hooks:<name>"``; the factories (``band``, ``documents``,
``alibi_scaled``) are used with a ``_kwargs`` mapping.  The oracle evaluates the
same functions on its own index grid, so for user hooks the definition *is* the
expected mask.
"""

from __future__ import annotations

import torch

# Exactly representable in bfloat16 and float32: the turbo backend hands slopes to
# the kernel as float32, so an inexact slope would be a rounding question, not a bug.
SLOPES = (0.5, 0.25, 0.125, 0.0625, 1.0, 0.75, 0.375, 2.0)


def _slope(h, dtype):
    return torch.tensor(SLOPES, dtype=dtype)[h % len(SLOPES)]


# ----------------------------------------------------------------------- mask hooks
def causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def everything(b, h, q_idx, kv_idx):
    return (q_idx >= 0) & (kv_idx >= 0)


def strictly_causal(b, h, q_idx, kv_idx):
    """Row 0 sees nothing at all: its output must be zeros."""
    return kv_idx < q_idx


def prefix_four(b, h, q_idx, kv_idx):
    return (kv_idx < 4) | (kv_idx <= q_idx)


def every_other_key(b, h, q_idx, kv_idx):
    return (kv_idx % 2 == 0) & (kv_idx <= q_idx)


def first_head_sees_all(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) | (h == 0)


def first_batch_causal(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) | (b > 0)


def band(left, right):
    """Factory: flash-convention window written out by hand (-1 = unbounded)."""

    def band_mask(b, h, q_idx, kv_idx):
        ok = (q_idx >= 0) & (kv_idx >= 0)
        if left >= 0:
            ok = ok & (q_idx - kv_idx <= left)
        if right >= 0:
            ok = ok & (kv_idx - q_idx <= right)
        return ok

    return band_mask


def documents(lengths, causal=True):
    """Factory: attention-gym style document mask from a captured id tensor.

    ``doc[q_idx]`` indexes a tensor as long as the packed row; evaluated on a
    longer grid it raises IndexError, as a user's hook would.
    """
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))

    def document_mask(b, h, q_idx, kv_idx):
        same = doc[q_idx] == doc[kv_idx]
        return same & (kv_idx <= q_idx) if causal else same

    return document_mask


# ---------------------------------------------------------------------- score hooks
def identity(score, b, h, q_idx, kv_idx):
    return score


def alibi(score, b, h, q_idx, kv_idx):
    return score + _slope(h, score.dtype) * (kv_idx - q_idx)


def alibi_third(score, b, h, q_idx, kv_idx):
    """ALiBi with slope 1/3, not a float32 value: Turbo cannot take it exactly."""
    return score + (kv_idx - q_idx) / 3.0


def symmetric_distance(score, b, h, q_idx, kv_idx):
    return score - 0.25 * (q_idx - kv_idx).abs()


def softcap(score, b, h, q_idx, kv_idx):
    return 5.0 * torch.tanh(score / 5.0)


def doubled(score, b, h, q_idx, kv_idx):
    return score * 2.0


MASK_HOOKS = ("causal", "everything", "strictly_causal", "prefix_four", "every_other_key",
              "first_head_sees_all", "first_batch_causal")
SCORE_HOOKS = ("identity", "alibi", "alibi_third", "symmetric_distance", "softcap", "doubled")
