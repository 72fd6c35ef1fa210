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
or edit between build and call (see `MUTATIONS`).
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class ScoreSpec:
    kind: str
    """``identity``, ``alibi`` (``score + slope * (kv - q)``), ``alibi-symmetric``
    (``score - slope * |q - kv|``), ``softcap``, ``other``."""
    reads: Optional[str] = None


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
        return _cuts(list(kw["cuts"]), bool(kw.get("causal", True)), int(kw.get("left", -1)))
    raise KeyError(f"no spec for {spec}")


def _with_reads(spec: MaskSpec, name: str) -> MaskSpec:
    return MaskSpec(spec.provable, spec.kind, name)


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
}
"""Module globals of `tests.fuzz.user_hooks` the fuzzer changes after a build (then restores)."""

__all__ = ["LIB", "MUTATIONS", "MaskSpec", "NOT_KERNEL", "ScoreSpec", "USER", "mask_spec", "score_spec"]
