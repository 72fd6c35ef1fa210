"""Hooks the way a user writes them: plain functions in their own module.

None of these is a library mask, so the project has to *prove* what each one
computes (`primus_ext.hooks.proof`): a hook proven equal to a kernel pattern
runs on the fixed Turbo kernels, anything else is refused on ``turbo`` (B31 /
B31-score) and evaluated exactly on ``reference``.  Settings name them as
``"tests.fuzz.user_hooks:<name>"``; the factories (marked ``@hook_factory``, as a
config may only call marked factories, B32) are used with a ``_kwargs`` mapping.
The oracle evaluates the same functions on its own index grid, so for user hooks
the definition *is* the expected mask or score.

What each hook provably is (for the test's prediction) is written down, from the
definitions alone, in `tests.fuzz.hook_specs`, next to nothing of primus_ext.

Two further families: (a) hooks written across the provable subset of docs/mask_hooks.md
(``torch.where``, ``clamp``, ``minimum`` / ``maximum``, ``abs``, ``remainder``, floor division,
``bucketize``, ``logical_*``, typed captured tables, helper functions, ``and_masks`` /
``or_masks``, attention-gym's exp2 ALiBi, float64 casts), proven where they are a kernel
pattern; (b) hooks outside it (a class attribute through an alias, an object attribute,
nested functions and lambdas, narrow integer tables that wrap, rounding casts, index casts
to int32, ``os.environ`` / ``time`` / ``random`` / ``functools``, type checks, ``try``,
``torch.compiler.is_compiling``, the indices' rank), which turbo must refuse and the
reference must compute as torch calls them (``torch.vmap`` over 0-d indices, the oracle's
convention too).

Module globals here (``WINDOW``, ``BAND``, ``HEAD_WIDTHS``, ``DOC_IDS``, ``ALIBI_LIST``,
``ALIBI_TENSOR``) are read by hooks the way a training script's globals are; the
fuzzer rebinds or edits some of them between build and call (and restores them).
"""

from __future__ import annotations

import functools
import math
import operator
import os
import random
import time

import torch
from torch.nn.attention.flex_attention import and_masks, or_masks

from primus_ext.attention import masks as library
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


# ====================================================================== (a) the provable subset
# Written with the functions and values the provable subset admits (docs/mask_hooks.md): torch.where,
# clamp, minimum / maximum, abs, remainder, floor_divide / div(rounding_mode="floor"), bucketize over
# constant boundaries, logical_*, captured int32 / int64 tables, helper functions that are themselves in
# the subset, math functions, and_masks / or_masks of such masks, attn-gym's exp2 ALiBi, float64 casts.
@hook_factory
def where_window(width):
    """attention-gym's window with ``torch.where``: causal keys within ``width``, else False."""

    def where_mask(b, h, q_idx, kv_idx):
        return torch.where(kv_idx <= q_idx, q_idx - kv_idx <= width, False)

    return where_mask


@hook_factory
def clamp_window(width):
    """The distance clamped to ``[-1, width + 1]``, then compared: a causal window of ``width``."""

    def clamp_mask(b, h, q_idx, kv_idx):
        d = torch.clamp(q_idx - kv_idx, min=-1, max=width + 1)
        return (d >= 0) & (d <= width)

    return clamp_mask


@hook_factory
def minmax_band(left, right, form="max"):
    """``q - kv <= left`` and ``kv - q <= right`` as one ``maximum`` (or ``minimum``) of two distances."""

    def max_band(b, h, q_idx, kv_idx):
        return torch.maximum(q_idx - kv_idx - left, kv_idx - q_idx - right) <= 0

    def min_band(b, h, q_idx, kv_idx):
        return torch.minimum(left - (q_idx - kv_idx), right - (kv_idx - q_idx)) >= 0

    return max_band if form == "max" else min_band


@hook_factory
def abs_band(width):
    """A symmetric band ``|q - kv| <= width`` with ``torch.abs``."""

    def abs_mask(b, h, q_idx, kv_idx):
        return torch.abs(q_idx - kv_idx) <= width

    return abs_mask


@hook_factory
def remainder_chunks(size, causal=True):
    """Chunks from ``torch.remainder``: a chunk starts at ``q - q mod size``."""

    def remainder_mask(b, h, q_idx, kv_idx):
        same = (q_idx - torch.remainder(q_idx, size)) == (kv_idx - torch.remainder(kv_idx, size))
        return same & (kv_idx <= q_idx) if causal else same

    return remainder_mask


@hook_factory
def floor_chunks(size, causal=True, form="floor_divide"):
    """Chunks from ``torch.floor_divide`` or ``torch.div(..., rounding_mode="floor")``."""

    def floor_divide_mask(b, h, q_idx, kv_idx):
        same = torch.floor_divide(q_idx, size) == torch.floor_divide(kv_idx, size)
        return same & (kv_idx <= q_idx) if causal else same

    def div_mask(b, h, q_idx, kv_idx):
        same = torch.div(q_idx, size, rounding_mode="floor") == torch.div(kv_idx, size, rounding_mode="floor")
        return same & (kv_idx <= q_idx) if causal else same

    return floor_divide_mask if form == "floor_divide" else div_mask


@hook_factory
def bucket_documents(cuts, causal=True, right=True, dtype="int64"):
    """Documents from ``torch.bucketize`` over a captured tensor of constant boundaries (sorted).

    ``right=True``: a document starts at each cut; ``right=False``: one position later."""
    bounds = torch.tensor(sorted(int(c) for c in cuts), dtype=getattr(torch, dtype))

    def bucket_mask(b, h, q_idx, kv_idx):
        same = torch.bucketize(q_idx, bounds, right=right) == torch.bucketize(kv_idx, bounds, right=right)
        return same & (kv_idx <= q_idx) if causal else same

    return bucket_mask


@hook_factory
def logical_window(width, form="and_not"):
    """A causal window with ``torch.logical_and`` / ``logical_not``, ``logical_xor`` or ``logical_or``."""

    def and_not_mask(b, h, q_idx, kv_idx):
        return torch.logical_and(kv_idx <= q_idx, torch.logical_not(q_idx - kv_idx > width))

    def xor_mask(b, h, q_idx, kv_idx):
        return torch.logical_xor(kv_idx > q_idx, q_idx - kv_idx <= width)

    def or_mask(b, h, q_idx, kv_idx):
        return torch.logical_or(kv_idx == q_idx, torch.logical_and(kv_idx < q_idx, q_idx - kv_idx <= width))

    return {"and_not": and_not_mask, "xor": xor_mask, "or": or_mask}[form]


@hook_factory
def typed_widths(widths, dtype="int64"):
    """A causal window per head, ``table[h] * 2 + 1`` from a captured table of ``dtype``.

    In uint8, int8 or int16 the doubling wraps for large entries (``130 * 2`` is 4 in uint8), as torch
    computes it; int32 and int64 tables of small widths do not wrap."""
    table = torch.tensor([int(w) for w in widths], dtype=getattr(torch, dtype))

    def typed_width_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= table[h] * 2 + 1)

    return typed_width_mask


def _non_negative(d):
    return d >= 0


def _within(d, width):
    """A helper function in the subset, calling another."""
    return _non_negative(d) & (d <= width)


def _within_global(d):
    return _non_negative(d) & (d <= WINDOW)


@hook_factory
def helper_window(width, form="helper"):
    """A causal window through module-level helper functions (``helper``), or ``math.isqrt`` (``math``)."""

    def helper_mask(b, h, q_idx, kv_idx):
        return _within(q_idx - kv_idx, width)

    def math_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= math.isqrt(width * width))

    return helper_mask if form == "helper" else math_mask


def helper_global_window(b, h, q_idx, kv_idx):
    """A helper reads the module global ``WINDOW``: the proof's assumption is the helper's read."""
    return _within_global(q_idx - kv_idx)


DEFAULT_WIDTH = 2


def default_window(b, h, q_idx, kv_idx, width=DEFAULT_WIDTH):
    """A width in a default argument; the fuzzer may replace ``__defaults__`` after the build."""
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= width)


@hook_factory
def float64_window(width):
    """A window compared in float64, which holds every index exactly (the prover may still decline)."""

    def float64_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((q_idx - kv_idx).to(torch.float64) <= float(width))

    return float64_mask


def _combined_part(kind, n):
    if kind == "causal":
        return causal
    if kind == "full":
        return everything
    if kind == "lib_causal":
        return library.causal()
    if kind == "lib_window":
        return library.sliding_window(n)
    if kind == "alias":  # outside the subset: the whole composition is dynamic
        return alias_window
    if kind == "left":
        def left_part(b, h, q_idx, kv_idx):
            return q_idx - kv_idx <= n
        return left_part
    if kind == "right":
        def right_part(b, h, q_idx, kv_idx):
            return kv_idx - q_idx <= n
        return right_part
    if kind == "prefix":
        def prefix_part(b, h, q_idx, kv_idx):
            return kv_idx < n
        return prefix_part
    raise KeyError(kind)


@hook_factory
def combined(op, parts):
    """torch's ``and_masks`` / ``or_masks`` (attention-gym's way to build masks) over ``parts``, each
    ``[kind, n]``: ``causal``, ``full``, ``left`` (``q - kv <= n``), ``right`` (``kv - q <= n``), ``prefix``
    (``kv < n``), the library's ``causal()`` / ``sliding_window(n)``, or ``alias`` (a dynamic mask)."""
    mods = [_combined_part(kind, int(n)) for kind, n in parts]
    return (and_masks if op == "and" else or_masks)(*mods)


@hook_factory
def alibi_exp2(H):
    """attention-gym's ``generate_alibi_bias(H)``, as written there: slopes ``exp2(-8 (h + 1) / H)``."""

    def alibi_mod(score, b, h, q_idx, kv_idx):
        scale = torch.exp2(-((h + 1) * 8.0 / H))
        bias = (kv_idx - q_idx) * scale
        return score + bias

    return alibi_mod


@hook_factory
def alibi_float64(slope):
    """ALiBi computed in float64 (``(kv - q).double() * slope``): returns float64 for float32 scores, and
    the slope is the Python float itself (float64 arithmetic), not its float32 rounding."""

    def alibi_float64_score(score, b, h, q_idx, kv_idx):
        return score + (kv_idx - q_idx).double() * slope

    return alibi_float64_score


# ================================================================ (b) outside the provable subset
# Each of these either behaves differently traced than called, or reads state through something a proof
# cannot pin down: the subset checker makes it dynamic (turbo refuses it, B31 / B31-score; reference calls
# it as torch does, under torch.vmap), or the prover declines it (wrapping integers, rounding casts).
class Config:
    """A training script's settings class, read through a local alias."""

    W = 3


class _Settings:
    def __init__(self) -> None:
        self.W = 4
        self.SLOPE = 0.25


CONFIG = _Settings()
"""A settings object, read by attribute."""
SIZES = {"w": 3}
"""A module-global dict (not an immutable constant)."""
ENV_WINDOW = "PRIMUS_FUZZ_WINDOW"
"""The environment variable `env_window` reads (default ``"3"``)."""


def alias_window(b, h, q_idx, kv_idx):
    cfg = Config
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= cfg.W)


def object_window(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= CONFIG.W)


def getattr_window(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= getattr(Config, "W"))


def dict_window(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= SIZES["w"])


def globals_window(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= globals()["WINDOW"])


@hook_factory
def nested_window(width, form="def"):
    """A causal window through a function defined inside the hook (``def``) or a ``lambda``."""

    def nested_def_mask(b, h, q_idx, kv_idx):
        def near(d):
            return d <= width
        return (kv_idx <= q_idx) & near(q_idx - kv_idx)

    def nested_lambda_mask(b, h, q_idx, kv_idx):
        near = lambda d: d <= width  # noqa: E731
        return (kv_idx <= q_idx) & near(q_idx - kv_idx)

    return nested_def_mask if form == "def" else nested_lambda_mask


@hook_factory
def int32_index(form="to"):
    """Indices cast to int32 (``.to(torch.int32)`` or ``.int()``): causal below 2**31, wraps above."""

    def to_int32_mask(b, h, q_idx, kv_idx):
        return kv_idx.to(torch.int32) <= q_idx.to(torch.int32)

    def int_mask(b, h, q_idx, kv_idx):
        return kv_idx.int() <= q_idx.int()

    return to_int32_mask if form == "to" else int_mask


def env_window(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= int(os.environ.get(ENV_WINDOW, "3")))


def clock_window(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= 3 + int(time.time() > 0))


@hook_factory
def random_window(width):
    def random_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= random.randint(width, width))

    return random_mask


@functools.lru_cache(maxsize=None)
def _cached_width(width):
    return width


def _add(a, c):
    return a + c


@hook_factory
def functools_window(width, form="reduce"):
    """A width from ``functools.reduce``, an ``lru_cache``-wrapped helper, or a ``functools.partial``."""

    def reduce_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= functools.reduce(operator.add, (width, 0)))

    def cache_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= _cached_width(width))

    def partial_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= functools.partial(_add, width)(0))

    return {"reduce": reduce_mask, "cache": cache_mask, "partial": partial_mask}[form]


@hook_factory
def isinstance_window(width, form="isinstance"):
    """A type check of an index: a real call (vmap, grids) takes the window, a tracer's proxy causal."""

    def isinstance_mask(b, h, q_idx, kv_idx):
        if isinstance(q_idx, torch.Tensor):
            return (kv_idx <= q_idx) & (q_idx - kv_idx <= width)
        return kv_idx <= q_idx

    def type_mask(b, h, q_idx, kv_idx):
        if type(q_idx) is torch.Tensor:
            return (kv_idx <= q_idx) & (q_idx - kv_idx <= width)
        return kv_idx <= q_idx

    return isinstance_mask if form == "isinstance" else type_mask


@hook_factory
def try_window(width):
    """``try`` / ``except`` around an operation that fails under vmap and on grids (and on a tracer)."""

    def try_mask(b, h, q_idx, kv_idx):
        try:
            extra = int(q_idx)
        except Exception:  # noqa: BLE001
            extra = width
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= extra)

    return try_mask


@hook_factory
def compiling_window(width):
    """A branch on ``torch.compiler.is_compiling()``: eager calls take the window."""

    def compiling_mask(b, h, q_idx, kv_idx):
        if torch.compiler.is_compiling():
            return kv_idx <= q_idx
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= width)

    return compiling_mask


@hook_factory
def dim_window(width):
    """Tells torch's call from a grid by the indices' rank: a window when called as torch calls it (0-d
    indices under vmap), causal on broadcast grids (and when traced).  Its meaning is torch's."""

    def dim_mask(b, h, q_idx, kv_idx):
        if q_idx.dim() == 0:
            return (kv_idx <= q_idx) & (q_idx - kv_idx <= width)
        return kv_idx <= q_idx

    return dim_mask


def rank_branch(b, h, q_idx, kv_idx):
    """Tells torch's call (0-d indices under vmap) from a grid, then branches on a value under vmap,
    which raises: no backend can compute what it means (B31 everywhere)."""
    if q_idx.dim() == 0:
        return kv_idx <= q_idx if bool(q_idx >= 0) else kv_idx >= 0
    return kv_idx <= q_idx


def object_alibi(score, b, h, q_idx, kv_idx):
    """ALiBi with the slope read from a settings object."""
    return score + CONFIG.SLOPE * (kv_idx - q_idx)


@hook_factory
def nested_alibi(slope):
    def nested_alibi_score(score, b, h, q_idx, kv_idx):
        bias = lambda d: d * slope  # noqa: E731
        return score + bias(kv_idx - q_idx)

    return nested_alibi_score


def bf16_score(score, b, h, q_idx, kv_idx):
    """The score cast to bfloat16: rounds it (8 bits of mantissa)."""
    return score.to(torch.bfloat16)


def fp16_score(score, b, h, q_idx, kv_idx):
    """The score rounded to float16 and back."""
    return score.half().float()


def fp16_overflow(score, b, h, q_idx, kv_idx):
    """Scaled by 4096 into float16: rounds, and scores below -16 overflow to -inf (masked out)."""
    return torch.clamp(score * 4096.0, max=60000.0).half().float() / 4096.0


MASK_HOOKS = ("causal", "everything", "strictly_causal", "prefix_four", "every_other_key",
              "first_head_sees_all", "first_batch_causal", "global_window", "global_band", "head_width_table",
              "global_documents")
MASK_FACTORIES = ("band", "titan_window", "documents", "head_or", "head_not", "batch_or", "head_widths", "chunks",
                  "cut_documents")
SCORE_HOOKS = ("identity", "alibi", "alibi_third", "symmetric_distance", "softcap", "doubled", "alibi_list",
               "alibi_tensor")
SCORE_FACTORIES = ("alibi_table", "distance_threshold", "clipped_alibi", "hard_clamp")
SUBSET_MASK_HOOKS = ("helper_global_window", "default_window")
SUBSET_MASK_FACTORIES = ("where_window", "clamp_window", "minmax_band", "abs_band", "remainder_chunks",
                         "floor_chunks", "bucket_documents", "logical_window", "typed_widths", "helper_window",
                         "float64_window", "combined")
SUBSET_SCORE_FACTORIES = ("alibi_exp2", "alibi_float64")
OUTSIDE_MASK_HOOKS = ("alias_window", "object_window", "getattr_window", "dict_window", "globals_window",
                      "env_window", "clock_window", "rank_branch")
OUTSIDE_MASK_FACTORIES = ("nested_window", "int32_index", "random_window", "functools_window",
                          "isinstance_window", "try_window", "compiling_window", "dim_window")
OUTSIDE_SCORE_HOOKS = ("object_alibi", "bf16_score", "fp16_score", "fp16_overflow")
OUTSIDE_SCORE_FACTORIES = ("nested_alibi",)


# ------------------------------------------------------------------ state the fuzzer changes
def change_state(target, value):
    """Change a piece of state some hook reads (after the build); return the function that restores it.

    ``Config.W`` (a class attribute), ``CONFIG.W`` / ``CONFIG.SLOPE`` (an object's), ``ENV`` (the variable
    `env_window` reads), ``DEFAULTS`` (`default_window`'s default argument, replaced as a new tuple)."""
    if target in ("Config.W", "CONFIG.W", "CONFIG.SLOPE"):
        owner = Config if target == "Config.W" else CONFIG
        name = target.partition(".")[2]
        old = getattr(owner, name)
        setattr(owner, name, value if value != old else old + 1)
        return lambda: setattr(owner, name, old)
    if target == "ENV":
        old = os.environ.get(ENV_WINDOW)
        os.environ[ENV_WINDOW] = str(value)

        def restore_env():
            if old is None:
                os.environ.pop(ENV_WINDOW, None)
            else:
                os.environ[ENV_WINDOW] = old
        return restore_env
    if target == "DEFAULTS":
        old = default_window.__defaults__
        default_window.__defaults__ = (value if (value,) != old else value + 1,)

        def restore_defaults():
            default_window.__defaults__ = old
        return restore_defaults
    raise KeyError(target)


STATE = ("Config.W", "CONFIG.W", "CONFIG.SLOPE", "ENV", "DEFAULTS")
