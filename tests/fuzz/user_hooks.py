"""Hooks the way a user writes them: plain functions in their own module.

None of these is a library mask, so the project has to *prove* what each one
computes (`primus_ext.attention.hook_proof`): a hook proven equal to a kernel pattern
runs on the fixed Turbo kernels, anything else is refused on ``turbo`` (B31 /
B31-score) and evaluated exactly on ``reference``.  Settings name them as
``"tests.fuzz.user_hooks:<name>"``; the factories (marked ``@hook_factory``, as a
config may only call marked factories, B32) are used with a ``_kwargs`` mapping.
The oracle evaluates the same functions on its own index grid, so for user hooks
the definition *is* the expected mask or score.

What each hook provably is (for the test's prediction) is written down, from the
definitions alone, in `tests.fuzz.hook_specs`, next to nothing of primus_ext.

Module globals here (``WINDOW``, ``BAND``, ``HEAD_WIDTHS``, ``DOC_IDS``, ``ALIBI_LIST``,
``ALIBI_TENSOR``) are read by hooks the way a training script's globals are; the
fuzzer rebinds or edits some of them between build and call (and restores them).
"""

from __future__ import annotations

import torch

from primus_ext.attention.library import hook_factory

# Exactly representable in bfloat16 and float32: the turbo backend hands slopes to
# the kernel as float32, so an inexact slope would be a rounding question, not a bug.
SLOPES = (0.5, 0.25, 0.125, 0.0625, 1.0, 0.75, 0.375, 2.0)


def _slope(h, dtype):
    return torch.tensor(SLOPES, dtype=dtype)[h % len(SLOPES)]


# ------------------------------------------------------------------ module globals
WINDOW = 3
"""A module-global window width (attention-gym's ``SLIDING_WINDOW``)."""
BAND = (2, 1)
"""A module-global ``(left, right)`` band."""
HEAD_WIDTHS = torch.full((8,), 4, dtype=torch.long)
"""A per-head window table (one entry per head, up to 8 heads), all equal: a plain window."""
DOC_IDS = torch.repeat_interleave(torch.arange(6), torch.tensor([5, 9, 1, 14, 7, 28]))
"""Document id of each position (64 tokens): what a data loader hands an attention-gym hook."""
ALIBI_LIST = [0.5, 0.25, 0.125, 0.0625, 0.03125, 1.0, 0.75, 0.375]
"""ALiBi slopes as a Python list, one per head (up to 8 heads)."""
ALIBI_TENSOR = torch.tensor([0.25, 0.5, 0.125, 1.0, 0.0625, 0.375, 0.75, 2.0])
"""ALiBi slopes as a tensor, one per head (up to 8 heads)."""


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


def global_window(b, h, q_idx, kv_idx):
    """attention-gym: ``q_idx - kv_idx <= SLIDING_WINDOW`` with a module-global width."""
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= WINDOW)


def global_band(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx <= BAND[0]) & (kv_idx - q_idx <= BAND[1])


def head_width_table(b, h, q_idx, kv_idx):
    """A causal window whose width is looked up per head in a module-global tensor."""
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= HEAD_WIDTHS[h])


def global_documents(b, h, q_idx, kv_idx):
    """attention-gym document mask over a module-global document-id tensor."""
    return (DOC_IDS[q_idx] == DOC_IDS[kv_idx]) & (kv_idx <= q_idx)


@hook_factory
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


@hook_factory
def titan_window(width):
    """Factory: torchtitan's sliding window, the query itself counted in ``width``."""

    def titan_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < width)

    return titan_mask


@hook_factory
def documents(lengths, causal=True, window=-1):
    """Factory: attention-gym style document mask from a captured id tensor.

    ``doc[q_idx]`` indexes a tensor as long as the packed row; evaluated on a
    longer grid it raises IndexError, as a user's hook would.  ``window`` >= 0 adds
    an attention-gym sliding window (``q_idx - kv_idx <= window``) inside.
    """
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))

    def document_mask(b, h, q_idx, kv_idx):
        same = doc[q_idx] == doc[kv_idx]
        if causal:
            same = same & (kv_idx <= q_idx)
        if window >= 0:
            same = same & (q_idx - kv_idx <= window)
        return same

    return document_mask


@hook_factory
def head_or(k):
    """Factory: causal, but head ``k`` sees everything (``k`` may be past the layer's heads)."""

    def head_or_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (h == k)

    return head_or_mask


@hook_factory
def head_not(k):
    """Factory: causal, and head ``k`` sees nothing at all."""

    def head_not_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (h != k)

    return head_not_mask


@hook_factory
def batch_or(k):
    """Factory: causal, but sequence ``k`` of the batch sees everything."""

    def batch_or_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (b == k)

    return batch_or_mask


@hook_factory
def head_widths(widths):
    """Factory: a causal window per head, from a captured per-head tensor indexed by ``h``."""
    table = torch.tensor(list(widths), dtype=torch.long)

    def head_width_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= table[h])

    return head_width_mask


@hook_factory
def chunks(size, causal=True):
    """Factory: Llama-4 style local chunks, written by hand."""

    def chunk_mask(b, h, q_idx, kv_idx):
        same = (q_idx // size) == (kv_idx // size)
        return same & (kv_idx <= q_idx) if causal else same

    return chunk_mask


@hook_factory
def cut_documents(cuts, causal=True, left=-1):
    """Factory: documents that start at constant positions ``cuts`` (a window inside)."""
    cuts = tuple(int(c) for c in cuts)  # immutable: the proof is cached per value

    def cut_mask(b, h, q_idx, kv_idx):
        ok = (q_idx >= 0) & (kv_idx >= 0)
        for cut in cuts:
            ok = ok & ((q_idx >= cut) == (kv_idx >= cut))
        if causal:
            ok = ok & (kv_idx <= q_idx)
        if left >= 0:
            ok = ok & (q_idx - kv_idx <= left)
        return ok

    return cut_mask


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


def alibi_list(score, b, h, q_idx, kv_idx):
    """ALiBi with the slopes in a module-global Python list."""
    return score + torch.tensor(ALIBI_LIST)[h] * (kv_idx - q_idx)


def alibi_tensor(score, b, h, q_idx, kv_idx):
    """ALiBi with the slopes in a module-global tensor."""
    return score + ALIBI_TENSOR[h] * (kv_idx - q_idx)


@hook_factory
def alibi_table(slopes, dtype="float32"):
    """Factory: ALiBi from per-head slopes held in a ``dtype`` table indexed by ``h``.

    The bias is cast to the score's dtype: a score_mod returns the dtype it is given.
    """
    values = tuple(float(s) for s in slopes)
    table_dtype = getattr(torch, dtype)

    def alibi_table_score(score, b, h, q_idx, kv_idx):
        return score + (torch.tensor(values, dtype=table_dtype)[h] * (kv_idx - q_idx)).to(score.dtype)

    return alibi_table_score


@hook_factory
def distance_threshold(threshold, penalty):
    """Factory: subtract ``penalty`` from keys more than ``threshold`` positions back."""

    def threshold_score(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx - kv_idx > threshold, score - penalty, score)

    return threshold_score


@hook_factory
def clipped_alibi(slope, floor):
    """Factory: ALiBi whose (negative) bias is clipped at ``-floor``."""

    def clipped_score(score, b, h, q_idx, kv_idx):
        return score + torch.clamp(slope * (kv_idx - q_idx), min=-floor)

    return clipped_score


@hook_factory
def hard_clamp(limit):
    """Factory: clamp the score to ``[-limit, limit]``."""

    def clamp_score(score, b, h, q_idx, kv_idx):
        return torch.clamp(score, -limit, limit)

    return clamp_score


MASK_HOOKS = ("causal", "everything", "strictly_causal", "prefix_four", "every_other_key",
              "first_head_sees_all", "first_batch_causal", "global_window", "global_band", "head_width_table",
              "global_documents")
MASK_FACTORIES = ("band", "titan_window", "documents", "head_or", "head_not", "batch_or", "head_widths", "chunks",
                  "cut_documents")
SCORE_HOOKS = ("identity", "alibi", "alibi_third", "symmetric_distance", "softcap", "doubled", "alibi_list",
               "alibi_tensor")
SCORE_FACTORIES = ("alibi_table", "distance_threshold", "clipped_alibi", "hard_clamp")
