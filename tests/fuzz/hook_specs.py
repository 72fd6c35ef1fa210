"""What each generated hook *is*, worked out from its definition, for the test's prediction.

No primus_ext code is consulted here.  For a mask hook with its kwargs and the layer's head
count, `mask_spec` says which fixed-kernel mask it equals for *every* batch index
``b >= 0``, head ``0 <= h < H`` and positions ``q, kv >= 0`` (no sequence length), or
that it equals none.  For a score hook, `score_spec` says whether it is the identity,
ALiBi with float32 slopes, a tanh softcap, or something else, over all real scores.

These are the semantics B31 promises: a hook is run on a fixed kernel only when it is
*proven* equal to one; anything else is refused on ``turbo`` and evaluated exactly on
``reference``.  A ``provable`` of ``None`` marks shapes whose equality holds but which
the documented prover does not claim (documents whose window reaches no earlier key):
either outcome is then accepted.

``reads``: the module global the hook's proof relies on, which the fuzzer may rebind
or edit between build and call (see `MUTATIONS`); for a hook outside the provable subset,
the state it reads (a class or object attribute, the environment), which only the
reference evaluates.

Hooks outside the provable subset (a type check, ``try``, a nested function, the
environment, an object's attribute, ...) are ``DYNAMIC``: never proven, so refused on
``turbo`` whatever they compute, and called as torch calls them on ``reference``; one that
raises when torch calls it (``raises``) is refused on every backend (B31).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

import torch

LIB = "primus_ext.attention.masks"
USER = "tests.fuzz.user_hooks"


@dataclass(frozen=True)
class MaskSpec:
    provable: Optional[bool]
    """True: must be proven (runs on turbo); False: must be refused on turbo (B31); None: either."""
    kind: Optional[str] = None
    """When provable: ``full``, ``causal``, ``window`` or ``documents`` (chunks, cuts, boundaries)."""
    reads: Optional[str] = None
    """The module global whose value the proof relies on (a mutation target), if any."""
    raises: bool = False
    """Raises when called as torch calls it (torch.vmap over 0-d indices): no backend can compute what it
    means, so every backend refuses it at build (B31)."""
    dynamic: Optional[bool] = False
    """Outside the provable subset (docs/mask_hooks.md, the three classes): refused on ``flex`` at build
    (``flex-dynamic``); None: not claimed either way."""
    untraceable: bool = False
    """torch's flex_attention may not trace it into its kernel (``math.isqrt`` of a captured int, once Dynamo
    has made that int symbolic): a dense call on ``flex`` may be refused (B34.flex-trace)."""


@dataclass(frozen=True)
class ScoreSpec:
    kind: str
    """``identity``, ``alibi`` (``score + slope * (kv - q)``), ``alibi-symmetric``
    (``score - slope * |q - kv|``), ``softcap``, ``other`` (a hook outside the provable subset is
    ``other`` whatever it computes: turbo must refuse it)."""
    reads: Optional[str] = None
    raises: bool = False
    """Raises when called as torch calls it: refused on every backend (B31)."""
    dynamic: Optional[bool] = False
    """Outside the provable subset: refused on ``flex`` at build (``flex-dynamic``)."""


NOT_KERNEL = MaskSpec(False)


def _window(left: int, right: int) -> MaskSpec:
    """A flash window (``-1`` unbounded); an empty mask (left or right below -1) is no kernel mask."""
    if left < -1 or right < -1:
        return NOT_KERNEL
    if (left, right) == (-1, -1):
        return MaskSpec(True, "full")
    if (left, right) == (-1, 0):
        return MaskSpec(True, "causal")
    return MaskSpec(True, "window")


DOCUMENTS = MaskSpec(True, "documents")


def mask_spec(spec: Optional[str], kwargs: Optional[dict], heads: int) -> Optional[MaskSpec]:
    """The kernel mask a hook equals for heads ``0 .. heads - 1``; None for no hook."""
    if spec is None:
        return None
    module, _, name = spec.partition(":")
    kw = kwargs or {}
    if module == LIB:
        return _library(name, kw)
    assert module == USER, spec
    fixed = {
        "causal": MaskSpec(True, "causal"),
        "everything": MaskSpec(True, "full"),
        "strictly_causal": NOT_KERNEL,  # the diagonal itself is blocked
        "prefix_four": NOT_KERNEL,
        "every_other_key": NOT_KERNEL,
        "first_batch_causal": NOT_KERNEL,  # b is unbounded: b = 1 exists
        "global_documents": NOT_KERNEL,  # a fixed-length id tensor indexed by position
    }
    if name in fixed:
        return fixed[name]
    if name == "first_head_sees_all":
        return _head_or(0, heads)
    if name == "global_window":
        import tests.fuzz.user_hooks as hooks
        return MaskSpec(True, "window", reads="WINDOW") if hooks.WINDOW >= 0 else NOT_KERNEL
    if name == "global_band":
        import tests.fuzz.user_hooks as hooks
        left, right = hooks.BAND
        return _with_reads(_explicit_band(left, right), "BAND")
    if name == "head_width_table":
        import tests.fuzz.user_hooks as hooks
        widths = [int(w) for w in hooks.HEAD_WIDTHS[:heads].tolist()]
        return _with_reads(_head_widths(widths), "HEAD_WIDTHS")
    if name == "band":
        return _window(int(kw["left"]), int(kw["right"]))
    if name == "titan_window":
        width = int(kw["width"])
        return MaskSpec(True, "window") if width >= 1 else NOT_KERNEL  # width 0 allows nothing
    if name == "documents":
        return NOT_KERNEL  # indexes a tensor of fixed length by position
    if name == "head_or":
        return _head_or(int(kw["k"]), heads)
    if name == "head_not":
        k = int(kw["k"])
        return MaskSpec(True, "causal") if not 0 <= k < heads else NOT_KERNEL
    if name == "batch_or":
        return NOT_KERNEL  # every k >= 0 is some batch index
    if name == "head_widths":
        return _head_widths([int(w) for w in kw["widths"][:heads]])
    if name == "chunks":
        return _chunks(int(kw["size"]), bool(kw.get("causal", True)))
    if name == "cut_documents":
        return DYNAMIC  # a loop over the cuts: outside the provable subset, whatever it computes
    if name in SUBSET_MASKS:
        return SUBSET_MASKS[name](kw, heads)
    if name in OUTSIDE_MASKS:
        return OUTSIDE_MASKS[name]
    raise KeyError(f"no spec for {spec}")


# ------------------------------------------------------------------------- the provable subset
DYNAMIC = MaskSpec(False, dynamic=True)
"""Outside the provable subset (docs/mask_hooks.md): never proven, refused on turbo (B31) whatever it
computes; the reference calls it as torch does."""


def _causal_width(width: int) -> MaskSpec:
    """``kv <= q`` and ``q - kv <= width``: empty below 0."""
    return _window(width, 0) if width >= 0 else NOT_KERNEL


def _logical(kw: dict, heads: int) -> MaskSpec:
    width, form = int(kw["width"]), kw.get("form", "and_not")
    if width >= 0:
        return _window(width, 0)
    # and_not: empty; xor: kv > q xor kv >= q + |width|: empty at -1, off the diagonal below;
    # or: only the diagonal is left (kv == q)
    return _window(0, 0) if form == "or" else NOT_KERNEL


def _bucket(kw: dict, heads: int) -> MaskSpec:
    """``bucketize(x, bounds, right=True)`` counts the bounds ``<= x`` (a document starts at each), with
    ``right=False`` those ``< x`` (one position later)."""
    shift = 0 if kw.get("right", True) else 1
    return _cuts([int(c) + shift for c in kw["cuts"]], bool(kw.get("causal", True)), -1)


def _typed_widths(kw: dict, heads: int) -> MaskSpec:
    """``table[h] * 2 + 1`` in the table's dtype, as torch computes it (wrapping).  The prover does not
    claim an integer operation that wraps: refused, unless torch's wrapped values make a kernel mask,
    where proving that mask would also be right."""
    dtype = getattr(torch, kw.get("dtype", "int64"))
    widths = [int(w) for w in kw["widths"][:heads]]
    table = torch.tensor([int(w) for w in kw["widths"]], dtype=dtype)
    computed = [int(x) for x in (table * 2 + 1)[:heads].tolist()]
    info = torch.iinfo(dtype)
    wraps = any(not (info.min <= 2 * w <= info.max and info.min <= 2 * w + 1 <= info.max) for w in widths)
    spec = _head_widths(computed)
    if wraps:
        return MaskSpec(None) if spec.provable else NOT_KERNEL
    return spec


def _helper(kw: dict, heads: int) -> MaskSpec:
    width = int(kw["width"])
    if kw.get("form", "helper") == "math":  # math.isqrt(width * width)
        return dataclasses.replace(_window(abs(width), 0), untraceable=True)
    return _causal_width(width)


_INF = float("inf")


def _part_interval(kind: str, n: int) -> Optional[tuple[float, float]]:
    """A part of `combined` as the interval of ``kv - q`` it allows (None: not such a part)."""
    if kind in ("causal", "lib_causal"):
        return (-_INF, 0)
    if kind == "full":
        return (-_INF, _INF)
    if kind == "left":
        return (-n, _INF)
    if kind == "right":
        return (-_INF, n)
    if kind == "lib_window":  # sliding_window(n): q - n <= kv <= q, -1 unbounded
        return (-_INF if n < 0 else -n, 0)
    return None


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for lo, hi in sorted(i for i in intervals if i[0] <= i[1]):
        if out and lo <= out[-1][1] + 1:  # integer offsets: [a, b] and [b + 1, c] join
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def _interval_spec(lo: float, hi: float) -> MaskSpec:
    """``q + lo <= kv <= q + hi``: a flash window when it holds the diagonal."""
    if not lo <= 0 <= hi:
        return NOT_KERNEL  # empty, or the diagonal blocked
    return _window(-1 if lo == -_INF else int(-lo), -1 if hi == _INF else int(hi))


def _combined(kw: dict, heads: int) -> MaskSpec:
    """torch's ``and_masks`` / ``or_masks``: the intersection / union of the parts' sets."""
    parts = [(str(kind), int(n)) for kind, n in kw["parts"]]
    if any(kind == "alias" for kind, _ in parts):
        return DYNAMIC
    intervals = [_part_interval(kind, n) for kind, n in parts if kind != "prefix"]
    prefixes = [n for kind, n in parts if kind == "prefix"]
    if kw["op"] == "and":
        if prefixes:
            return NOT_KERNEL  # kv < n: empty, or bounded by a fixed position
        lo, hi = max(i[0] for i in intervals), min(i[1] for i in intervals)
        return _interval_spec(lo, hi)
    union = _union([i for i in intervals if i is not None])
    prefix = max(prefixes, default=0)
    if len(union) != 1:
        return NOT_KERNEL  # no part, or a gap between the parts (kv < n alone is bounded by a position)
    lo, hi = union[0]
    if prefix >= 1 and not (lo == -_INF and hi >= prefix - 1):
        return NOT_KERNEL  # the prefix adds keys no flash window has (row 0 sees kv < n, a far row kv = 0)
    return _interval_spec(lo, hi)


def _global_helper(kw: dict, heads: int) -> MaskSpec:
    import tests.fuzz.user_hooks as hooks
    return _with_reads(_causal_width(int(hooks.WINDOW)), "WINDOW")


def _default(kw: dict, heads: int) -> MaskSpec:
    import tests.fuzz.user_hooks as hooks
    return _with_reads(_causal_width(int(hooks.default_window.__defaults__[0])), "DEFAULTS")


def _float64(kw: dict, heads: int) -> MaskSpec:
    # equal to a causal window (float64 holds every index exactly), but computed with floating-point
    # index values, which the prover does not claim: either outcome
    return MaskSpec(None) if int(kw["width"]) >= 0 else NOT_KERNEL


SUBSET_MASKS = {
    "where_window": lambda kw, heads: _causal_width(int(kw["width"])),
    "clamp_window": lambda kw, heads: _causal_width(int(kw["width"])),
    "minmax_band": lambda kw, heads: _explicit_band(int(kw["left"]), int(kw["right"])),
    "abs_band": lambda kw, heads: MaskSpec(True, "window") if int(kw["width"]) >= 0 else NOT_KERNEL,
    "remainder_chunks": lambda kw, heads: _chunks(int(kw["size"]), bool(kw.get("causal", True))),
    "floor_chunks": lambda kw, heads: _chunks(int(kw["size"]), bool(kw.get("causal", True))),
    "bucket_documents": _bucket,
    "logical_window": _logical,
    "typed_widths": _typed_widths,
    "helper_window": _helper,
    "helper_global_window": _global_helper,
    "default_window": _default,
    "float64_window": _float64,
    "combined": _combined,
}
"""Hooks written in the provable subset: what each is, from its definition."""

OUTSIDE_MASKS = {
    **{name: DYNAMIC for name in ("alias_window", "object_window", "getattr_window", "dict_window",
                                  "globals_window", "env_window", "clock_window", "nested_window",
                                  "random_window", "functools_window", "isinstance_window", "try_window",
                                  "compiling_window", "dim_window")},
    "int32_index": NOT_KERNEL,  # causal below 2**31 only: the int32 cast wraps past it
    # a branch on a value under vmap raises (B31 on every backend); whether flex-dynamic is named too is not claimed
    "rank_branch": MaskSpec(False, raises=True, dynamic=None),
}
"""Hooks outside the subset (dynamic) or that the prover declines (a narrowing index cast)."""


def _with_reads(spec: MaskSpec, name: str) -> MaskSpec:
    return MaskSpec(spec.provable, spec.kind, name, spec.raises, spec.dynamic)


def _explicit_band(left: int, right: int) -> MaskSpec:
    """``q - kv <= left`` and ``kv - q <= right`` (both always bounded)."""
    if left + right < 0:
        return NOT_KERNEL  # empty
    if left < 0 or right < 0:
        return NOT_KERNEL  # the diagonal is blocked: no flash window has that shape
    return MaskSpec(True, "window")


def _head_or(k: int, heads: int) -> MaskSpec:
    if not 0 <= k < heads:
        return MaskSpec(True, "causal")  # no head of this layer is head k
    if heads == 1:
        return MaskSpec(True, "full")  # the only head sees everything
    return NOT_KERNEL


def _head_widths(widths: list[int]) -> MaskSpec:
    if len(set(widths)) > 1:
        return NOT_KERNEL  # heads differ
    width = widths[0]
    if width < 0:
        return NOT_KERNEL  # kv <= q and q - kv <= negative: empty
    return MaskSpec(True, "window")


def _chunks(size: int, causal: bool) -> MaskSpec:
    if size == 1:
        return MaskSpec(True, "window")  # only the diagonal
    return DOCUMENTS


def _cuts(cuts: list[int], causal: bool, left: int) -> MaskSpec:
    cuts = sorted({c for c in cuts if c >= 1})
    if left == 0:
        if causal:
            return MaskSpec(True, "window")  # the diagonal
        # documents with window (0, -1): a kernel mask, but with no earlier key visible the
        # prover cannot see where a document starts; not claimed either way
        return MaskSpec(None) if cuts else MaskSpec(True, "window")
    if not cuts:
        return _window(left, 0 if causal else -1)
    return DOCUMENTS


def _library(name: str, kw: dict) -> MaskSpec:
    if name == "full":
        return MaskSpec(True, "full")
    if name == "causal":
        return MaskSpec(True, "causal")
    if name == "sliding_window":
        return _window(int(kw["left"]), int(kw.get("right", 0)))
    if name == "packed_documents":
        return DOCUMENTS  # fixed boundaries, known by identity
    if name == "prefix_lm":
        # kv < 1 is kv == 0, which every query q >= 0 already sees causally
        return MaskSpec(True, "causal") if int(kw["prefix_length"]) <= 1 else NOT_KERNEL
    if name == "chunked":
        return _chunks(int(kw["chunk_size"]), bool(kw.get("causal", True)))
    raise KeyError(name)


# ----------------------------------------------------------------------------- scores
def _float32(x: float) -> bool:
    return Fraction(torch.tensor(x, dtype=torch.float32).item()) == Fraction(x)


def score_spec(spec: Optional[str], kwargs: Optional[dict], heads: int) -> Optional[ScoreSpec]:
    if spec is None:
        return None
    module, _, name = spec.partition(":")
    assert module == USER, spec
    kw = kwargs or {}
    fixed = {"identity": "identity", "alibi": "alibi", "alibi_third": "other", "symmetric_distance": "alibi-symmetric",
             "softcap": "softcap", "doubled": "other", "hard_clamp": "other"}
    if name in fixed:
        return ScoreSpec(fixed[name])
    if name == "alibi_list":
        import tests.fuzz.user_hooks as hooks
        return ScoreSpec(_alibi_kind([float(torch.tensor(hooks.ALIBI_LIST[:heads])[i]) for i in range(heads)]),
                         reads="ALIBI_LIST")
    if name == "alibi_tensor":
        import tests.fuzz.user_hooks as hooks
        return ScoreSpec(_alibi_kind([float(x) for x in hooks.ALIBI_TENSOR[:heads].tolist()]), reads="ALIBI_TENSOR")
    if name == "alibi_table":
        # the table holds the slopes in its dtype: a float32 table rounds them when made
        table = torch.tensor([float(s) for s in kw["slopes"]], dtype=getattr(torch, kw.get("dtype", "float32")))
        return ScoreSpec(_alibi_kind([float(x) for x in table[:heads].tolist()]))
    if name == "distance_threshold":
        return ScoreSpec("identity" if float(kw["penalty"]) == 0 else "other")  # q - kv > T holds for some q
    if name == "clipped_alibi":
        slope, floor = float(kw["slope"]), float(kw["floor"])
        if slope == 0 and floor >= 0:
            return ScoreSpec("identity")
        return ScoreSpec("other")  # the bias is clipped at some distance
    if name == "alibi_exp2":
        # attn-gym: exp2(-((h + 1) * 8.0 / H)) computed by torch in float32, so float32 slopes
        scale = torch.exp2(-((torch.arange(heads) + 1) * 8.0 / int(kw["H"])))
        return ScoreSpec(_alibi_kind([float(x) for x in scale.tolist()]))
    if name == "alibi_float64":
        # float64 arithmetic: the slope is the Python float itself, which Turbo takes only if float32
        return ScoreSpec(_alibi_kind([float(kw["slope"])] * heads))
    if name == "object_alibi":
        return ScoreSpec("other", reads="CONFIG.SLOPE", dynamic=True)  # outside the subset: reads an object
    if name == "nested_alibi":
        return ScoreSpec("other", dynamic=True)  # a lambda: outside the subset
    if name in ("bf16_score", "fp16_score", "fp16_overflow"):
        return ScoreSpec("other")  # casts that round (and overflow): in the subset, admitted
    raise KeyError(spec)


def _alibi_kind(slopes: list[float]) -> str:
    if all(s == 0 for s in slopes):
        return "identity"
    return "alibi" if all(_float32(s) for s in slopes) else "other"


# ----------------------------------------------------------------------------- mutations
MUTATIONS = {
    # global: (how it is changed between build and call)
    "WINDOW": "rebind",
    "BAND": "rebind",
    "HEAD_WIDTHS": "in place",
    "ALIBI_LIST": "edit",
    "ALIBI_TENSOR": "in place",
    "Config.W": "class attribute",
    "CONFIG.W": "object attribute",
    "CONFIG.SLOPE": "object attribute",
    "ENV": "environment variable",
    "DEFAULTS": "default arguments replaced",
}
"""Module globals of `tests.fuzz.user_hooks` the fuzzer changes after a build (then restores)."""

__all__ = ["DYNAMIC", "LIB", "MUTATIONS", "MaskSpec", "NOT_KERNEL", "OUTSIDE_MASKS", "SUBSET_MASKS",
           "ScoreSpec", "USER", "mask_spec", "score_spec"]
