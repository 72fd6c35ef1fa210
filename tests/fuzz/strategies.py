"""Hypothesis strategies: one generated `Case` is a whole attention layer plus one call.

A case says where it is run (the adapter `TurboFlexAttention` built by `build_plan`,
or Megatron's `PrimusTurboLocalAttention`), which Primus-Turbo build is installed
(none, or the CPU fake with its build knobs), every YAML key and model fact, and the
call: layout, shapes, dtype, per-call arguments, and whether gradients are checked.
Tensor values are not part of the case; they come from ``seed``.

Everything is drawn so that hypothesis can shrink a failure to a small case.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch
from hypothesis import strategies as st

LIB = "primus_ext.attention.masks"
USER = "tests.fuzz.user_hooks"
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
MASK_TYPES = ("causal", "no_mask", "causal_bottom_right", "padding")


# Strategies are made once and reused: hypothesis validates every new strategy object on
# its first draw, and building them afresh per case cost as much as running the case.
@functools.lru_cache(maxsize=None)
def ints(low: int, high: int):
    return st.integers(low, high)


@functools.lru_cache(maxsize=None, typed=True)  # typed: pick(0, 1) is not pick(0.0, 1.0)
def pick(*values):
    return st.sampled_from(values)


# A window bound: unbounded, zero, or a positive width (small or past the sequence).
BOUND = st.one_of(st.just(-1), st.just(0), ints(1, 6), ints(7, 40))


@functools.lru_cache(maxsize=None)
def one_in(n: int):
    """True about once in ``n`` draws.

    Hypothesis favours the ends of a range, so the rare value sits in the middle (a
    True at either end would come up far more often than 1/n); it shrinks to False.
    """
    return ints(0, n - 1).map(lambda i: n > 1 and i == n // 2)


@functools.lru_cache(maxsize=None)
def weighted(*options):
    """``(value, weight)`` options; the first is the common one and also owns both ends of
    the range, where hypothesis' integer draws pile up, so rare values stay rare."""
    values = [v for v, w in options for _ in range(w)] + [options[0][0]]
    return ints(0, len(values) - 1).map(values.__getitem__)


@dataclass(frozen=True)
class Case:
    """One generated layer + call.  ``level``: ``adapter`` or ``megatron``."""

    level: str
    flex: bool
    backend: str
    """``turbo_flex_attention_backend`` as written (``reference``, ``turbo``, ``flex`` or ``auto``)."""
    fake: Optional[dict]
    """Knobs of ``fake_primus_turbo`` (the Turbo build imitated), or None: no Primus-Turbo."""
    settings: dict
    layer: dict
    """Model facts: heads, head dims, layer number, mask type, config window, CP, ..."""
    call: dict
    """Layout (``thd``), shapes, dtype and the per-call arguments."""
    grad: bool
    seed: int
    compiled: Optional[str] = None
    """``torch.compile(fullgraph=True)`` backend the call runs under (``aot_eager``, ``inductor``), or None: eager."""

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.call["dtype"]]

    @property
    def resolved_backend(self) -> str:
        """The flex backend that ``auto`` resolves to here."""
        if self.backend == "auto":
            return "turbo" if self.fake is not None else "reference"
        return self.backend

    @property
    def mask_hook(self) -> Optional[str]:
        return self.settings.get("turbo_flex_attention_mask_mod")

    @property
    def score_hook(self) -> Optional[str]:
        return self.settings.get("turbo_flex_attention_score_mod")


# ----------------------------------------------------------------------------- pieces
@functools.lru_cache(maxsize=None)
def _lists(elements, min_size: int, max_size: int):
    return st.lists(elements, min_size=min_size, max_size=max_size)


@functools.lru_cache(maxsize=None)
def _doc_lengths(max_docs: int):
    return _lists(st.one_of(st.just(0), st.just(1), ints(2, 9)), 1, max_docs)


def document_lengths(draw, total: Optional[int] = None, max_docs: int = 5) -> list[int]:
    """Document lengths, empty and length-1 documents included; sum ``total`` if given."""
    if total is None:
        lengths = draw(_doc_lengths(max_docs))
        if sum(lengths) == 0:
            lengths[-1] = draw(ints(1, 6))
        return lengths
    cuts = sorted(draw(_lists(ints(0, total), 0, max_docs - 1)))
    bounds = [0, *cuts, total]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def bounds_of(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def heads(draw, allow_bad: bool) -> tuple[int, int]:
    hq = draw(pick(*(1, 2, 3, 4, 6, 8)))
    if allow_bad and draw(one_in(20)):
        bad = [g for g in (2, 3, 4, 5) if hq % g]
        if bad:
            return hq, draw(pick(*bad))
    return hq, draw(pick(*[g for g in range(1, hq + 1) if hq % g == 0]))


def mask_hook(draw, q_len: int, kv_len: int) -> tuple[Optional[str], Optional[dict]]:
    """A mask hook setting and its kwargs: library masks, and hooks written as a user would.

    The user's document hooks index a tensor; it is always long enough for the call
    itself (a hook that cannot be evaluated at the user's own shape is the user's bug),
    but it may be shorter than the 8x8 grid a hook is first checked on.
    """
    kind = draw(weighted(("none", 8), ("library", 7), ("user", 4), ("user_new", 5), ("subset", 4), ("outside", 3)))
    if kind == "none":
        return None, None
    if kind == "library":
        name = draw(pick(*("full", "causal", "sliding_window", "prefix_lm", "chunked",
                                     "packed_documents")))
        if name in ("full", "causal"):
            return f"{LIB}:{name}", {}
        if name == "sliding_window":
            return f"{LIB}:{name}", {"left": draw(BOUND), "right": draw(BOUND)}
        if name == "prefix_lm":
            return f"{LIB}:{name}", {"prefix_length": draw(ints(0, q_len + 2))}
        if name == "chunked":
            return f"{LIB}:{name}", {"chunk_size": draw(ints(1, q_len + 2)), "causal": draw(st.booleans())}
        total = q_len if not draw(one_in(6)) else draw(ints(1, q_len + 4))
        bounds = bounds_of(document_lengths(draw, total))
        return f"{LIB}:{name}", {"cu_seqlens": bounds, "causal": draw(st.booleans()),
                                 "window": [draw(BOUND), draw(BOUND)]}
    if kind == "user":
        name = draw(pick(*("causal", "everything", "strictly_causal", "prefix_four", "every_other_key",
                                     "first_head_sees_all", "first_batch_causal", "band", "documents")))
        if name == "band":
            return f"{USER}:band", {"left": draw(BOUND), "right": draw(BOUND)}
        if name == "documents":
            return f"{USER}:documents", document_kwargs(draw, max(q_len, kv_len))
        return f"{USER}:{name}", None
    if kind == "subset":
        return subset_mask_hook(draw)
    if kind == "outside":
        return outside_mask_hook(draw)
    return new_mask_hook(draw, q_len, kv_len)


def document_kwargs(draw, longest: int) -> dict:
    total = longest if not draw(one_in(4)) else draw(ints(longest, longest + 12))
    kwargs: dict[str, Any] = {"lengths": document_lengths(draw, total), "causal": draw(st.booleans())}
    if draw(one_in(3)):
        kwargs["window"] = draw(BOUND)
    return kwargs


# Per-head values (widths, slopes) are tables of 8, the most heads a case has; entries at
# or past the layer's head count are never read by it.
HEAD_TABLE = 8
# Document starts: small, or past every sequence drawn here.
CUT = st.one_of(ints(1, 12), ints(13, 60))
WIDTH = st.one_of(ints(0, 6), ints(7, 40))
THRESHOLD = st.one_of(ints(-2, 8), ints(9, 60))  # a distance, often past every sequence here


def new_mask_hook(draw, q_len: int, kv_len: int) -> tuple[str, Optional[dict]]:
    """Hooks that read b and h (indices past the layer's heads too), captured tensors and
    module globals, chunks and documents at constant positions."""
    name = draw(pick(*("head_or", "head_not", "batch_or", "head_widths", "head_width_table",
                                 "global_window", "global_band", "global_documents", "documents", "chunks",
                                 "cut_documents", "titan_window")))
    if name in ("head_or", "head_not"):
        return f"{USER}:{name}", {"k": draw(ints(0, HEAD_TABLE))}
    if name == "batch_or":
        return f"{USER}:{name}", {"k": draw(ints(0, 4))}
    if name == "head_widths":
        base = draw(WIDTH)
        widths = [base] * HEAD_TABLE
        if not draw(one_in(3)):
            widths[draw(ints(0, HEAD_TABLE - 1))] = draw(ints(0, 8))
        return f"{USER}:{name}", {"widths": widths}
    if name == "documents":
        return f"{USER}:{name}", document_kwargs(draw, max(q_len, kv_len))
    if name == "chunks":
        return f"{USER}:{name}", {"size": draw(ints(1, q_len + 4)), "causal": draw(st.booleans())}
    if name == "cut_documents":
        cuts = sorted(set(draw(_lists(CUT, 0, 4))))
        return f"{USER}:{name}", {"cuts": cuts, "causal": draw(st.booleans()), "left": draw(BOUND)}
    if name == "titan_window":
        return f"{USER}:{name}", {"width": draw(WIDTH)}
    return f"{USER}:{name}", None


# Hook parameters for the subset / outside families: few values, so that proofs (cached per factory
# arguments) are reused across cases; each set has a negative (empty) value, 0 and one past every sequence.
SMALL_WIDTH = pick(-1, 0, 1, 2, 3, 5, 8, 30)
SMALL_BOUND = pick(-2, -1, 0, 1, 2, 3, 6, 30)
SIZE = pick(1, 2, 3, 4, 5, 8, 30)
SMALL_CUT = pick(1, 2, 3, 5, 7, 10, 13, 40)
PART_KINDS = ("causal", "full", "left", "right", "prefix", "lib_causal", "lib_window", "alias")
# typed_widths: small entries, and entries whose doubling wraps in narrow dtypes (uint8 128 -> 1,
# int8 64, int16 16384, int32 2**30 wrap; uint8 127 and int16 16383 just fit)
TYPED_BASES = {"int64": (0, 1, 3, 2 ** 40), "int32": (0, 2, 2 ** 30), "uint8": (0, 2, 127, 128, 130),
               "int16": (-1, 1, 16383, 16384), "int8": (-1, 3, 63, 64)}


def subset_mask_hook(draw) -> tuple[str, dict]:
    """A mask written in the provable subset (docs/mask_hooks.md): torch.where, clamp, minimum / maximum,
    abs, remainder, floor division, bucketize, logical_*, typed captured tables, helper functions, math,
    default arguments, float64 casts, and_masks / or_masks compositions."""
    name = draw(pick(*("where_window", "clamp_window", "minmax_band", "abs_band", "remainder_chunks",
                       "floor_chunks", "bucket_documents", "logical_window", "typed_widths", "helper_window",
                       "helper_global_window", "default_window", "float64_window", "combined", "combined")))
    if name in ("where_window", "clamp_window", "abs_band", "float64_window"):
        return f"{USER}:{name}", {"width": draw(SMALL_WIDTH)}
    if name == "minmax_band":
        return f"{USER}:{name}", {"left": draw(SMALL_BOUND), "right": draw(SMALL_BOUND),
                                  "form": draw(pick("max", "min"))}
    if name == "remainder_chunks":
        return f"{USER}:{name}", {"size": draw(SIZE), "causal": draw(st.booleans())}
    if name == "floor_chunks":
        return f"{USER}:{name}", {"size": draw(SIZE), "causal": draw(st.booleans()),
                                  "form": draw(pick("floor_divide", "div"))}
    if name == "bucket_documents":
        return f"{USER}:{name}", {"cuts": sorted(set(draw(_lists(SMALL_CUT, 0, 3)))), "causal": draw(st.booleans()),
                                  "right": draw(st.booleans()), "dtype": draw(pick("int64", "int32"))}
    if name == "logical_window":
        return f"{USER}:{name}", {"width": draw(SMALL_BOUND), "form": draw(pick("and_not", "xor", "or"))}
    if name == "typed_widths":
        dtype = draw(pick(*TYPED_BASES))
        widths = [draw(pick(*TYPED_BASES[dtype]))] * HEAD_TABLE
        if draw(one_in(3)):
            widths[draw(ints(0, HEAD_TABLE - 1))] = draw(pick(*TYPED_BASES[dtype]))
        return f"{USER}:{name}", {"widths": widths, "dtype": dtype}
    if name == "helper_window":
        return f"{USER}:{name}", {"width": draw(SMALL_WIDTH), "form": draw(pick("helper", "math"))}
    if name == "combined":
        parts = []
        for _ in range(draw(ints(2, 3))):
            kind = draw(pick(*PART_KINDS))
            n = draw(pick(-1, 0, 1, 3, 8)) if kind == "lib_window" else draw(SMALL_BOUND)
            parts.append([kind, n])
        return f"{USER}:{name}", {"op": draw(pick("and", "or")), "parts": parts}
    return f"{USER}:{name}", None


def outside_mask_hook(draw) -> tuple[str, Optional[dict]]:
    """A mask outside the subset: class / object attributes (through an alias, getattr, a dict, globals()),
    nested functions and lambdas, int32 index casts, the environment, the clock, random, functools, type
    checks, try / except, torch.compiler.is_compiling, the indices' rank (0-d as torch calls a hook), and a
    branch that raises under vmap."""
    name = draw(pick(*("alias_window", "object_window", "getattr_window", "dict_window", "globals_window",
                       "env_window", "clock_window", "rank_branch", "nested_window", "int32_index",
                       "random_window", "functools_window", "isinstance_window", "try_window",
                       "compiling_window", "dim_window")))
    if name == "nested_window":
        return f"{USER}:{name}", {"width": draw(SMALL_WIDTH), "form": draw(pick("def", "lambda"))}
    if name == "int32_index":
        return f"{USER}:{name}", {"form": draw(pick("to", "int"))}
    if name == "functools_window":
        return f"{USER}:{name}", {"width": draw(SMALL_WIDTH), "form": draw(pick("reduce", "cache", "partial"))}
    if name == "isinstance_window":
        return f"{USER}:{name}", {"width": draw(SMALL_WIDTH), "form": draw(pick("isinstance", "type"))}
    if name in ("random_window", "try_window", "compiling_window", "dim_window"):
        return f"{USER}:{name}", {"width": draw(SMALL_WIDTH)}
    return f"{USER}:{name}", None


ROUNDING_SCORES = frozenset({"bf16_score", "fp16_score", "fp16_overflow"})
"""Score hooks that round the score: a step function of it, compared only where scores are exact
(float64 inputs, or the exact large-score cases), so that a rounding tie is not a difference."""


def hook_dtype(score: tuple, dtype: str, exact_scores: bool) -> str:
    """The inputs' dtype for a case with this score hook (float64 for a rounding hook on inexact scores)."""
    name = (score[0] or ":").partition(":")[2]
    return "float64" if name in ROUNDING_SCORES and not exact_scores else dtype


def score_hook(draw, exact_scores: bool = False, dtype: str = "float32") -> tuple[Optional[str], Optional[dict]]:
    """A score hook and its kwargs: fixed hooks, ALiBi from tables, thresholds and clamps.

    ``exact_scores``: q and k are exact (`magnitude`), so every score is a float32 integer
    and a large penalty is subtracted exactly; from a random score, float32 would round
    ``score - 1000`` by ~3e-5, a rounding of the hook itself, not a difference to find.
    """
    name = draw(weighted((None, 24), ("identity", 2), ("alibi", 5), ("alibi_third", 2), ("symmetric_distance", 2),
                         ("softcap", 2), ("doubled", 2), ("alibi_list", 3), ("alibi_tensor", 3),
                         ("alibi_table", 3), ("distance_threshold", 3), ("clipped_alibi", 2), ("hard_clamp", 2),
                         ("alibi_exp2", 2), ("alibi_float64", 2), ("object_alibi", 1), ("nested_alibi", 1),
                         ("bf16_score", 1), ("fp16_score", 1), ("fp16_overflow", 1)))
    if name is None:
        return None, None
    kwargs: Optional[dict] = None
    if name == "alibi_table":
        exact = pick(*(0.0, 0.5, 0.25, 0.125, 1.0, 2.0, 0.0625, 0.75))
        slopes = [draw(exact)] * HEAD_TABLE if draw(one_in(4)) else draw(
            _lists(exact, HEAD_TABLE, HEAD_TABLE))
        dtype = draw(pick("float32", "float64"))
        if dtype == "float64" and draw(one_in(3)):
            # A slope that is no float32 value, at a head inside or past the layer's heads:
            # refused by B31-score only if some head reads it.  (In a float32 table it would
            # be rounded when the table is made, so only the float64 table carries it.)
            slopes[draw(ints(0, HEAD_TABLE - 1))] = draw(pick(1 / 3, 0.1, 0.3))
        kwargs = {"slopes": slopes, "dtype": dtype}
    elif name == "distance_threshold":
        kwargs = {"threshold": draw(THRESHOLD),
                  "penalty": draw(pick(*((0.0, 0.5, 3.0, 1000.0, -2.0) if exact_scores else
                                          (0.0, 0.5, 3.0, 16.0, -2.0))))}
    elif name == "clipped_alibi":
        kwargs = {"slope": draw(pick(*(0.0, 0.25, 0.5, 2.0))),
                  "floor": draw(pick(*(0.0, 1.0, 4.0, 100.0)))}
    elif name == "hard_clamp":
        kwargs = {"limit": draw(pick(*(1.0, 50.0, 100.0, 1000.0)))}
    elif name == "alibi_exp2":
        # attn-gym's H (the model's head count, or not). Slopes of H = 3, 6 are no powers of two, so the
        # hook's own float32 product rounds, which a proof over the reals does not model (docs/mask_hooks.md):
        # with float64 inputs the kernels' exact bias would differ by that rounding, so only powers of two.
        # Exact scores (a large gain) claim every score exact in float32: powers of two there too.
        kwargs = {"H": draw(pick(1, 2, 4, 8) if dtype == "float64" or exact_scores else pick(1, 2, 3, 4, 6, 8))}
    elif name == "alibi_float64":
        # 0.1 and 0.3 are no float32 values: in float64 arithmetic torch uses the doubles, so B31-score must
        # refuse them (test_regression_float64_arithmetic_proven_with_the_constant_rounded_to_float32).  Exact
        # scores (a large gain) claim every score exact in float32: there score + 0.1 * d, rounded to float32 by
        # the reference backend, is the hook's own rounding (~3e-5 at scores of hundreds), so exact slopes only.
        inexact = () if exact_scores else (0.1, 0.3)
        kwargs = {"slope": draw(pick(*(0.0, 0.5, 0.25, 2.0, 0.75) + inexact))}
    elif name == "nested_alibi":
        kwargs = {"slope": draw(pick(*(0.0, 0.5, 0.25)))}
    return f"{USER}:{name}", kwargs


# Module globals of user_hooks a hook reads, and the new value a mutation gives them.
GLOBAL_READS = {"global_window": "WINDOW", "global_band": "BAND", "head_width_table": "HEAD_WIDTHS",
                "alibi_list": "ALIBI_LIST", "alibi_tensor": "ALIBI_TENSOR", "helper_global_window": "WINDOW",
                "globals_window": "WINDOW", "default_window": "DEFAULTS", "alias_window": "Config.W",
                "getattr_window": "Config.W", "object_window": "CONFIG.W", "env_window": "ENV",
                "object_alibi": "CONFIG.SLOPE"}


def mutation(draw, mask: tuple, score: tuple) -> Optional[dict]:
    """Sometimes change a module global the hooks read, after the build and before the call."""
    targets = [GLOBAL_READS[spec.partition(":")[2]] for spec in (mask[0], score[0])
               if spec and spec.startswith(USER) and spec.partition(":")[2] in GLOBAL_READS]
    if not targets or not draw(one_in(3)):
        return None
    target = draw(pick(*targets))
    if target == "WINDOW":
        return {"target": target, "value": draw(pick(*(0, 1, 5, 30)))}
    if target == "BAND":
        return {"target": target, "value": [draw(ints(0, 4)), draw(ints(0, 4))]}
    if target in ("Config.W", "CONFIG.W", "ENV", "DEFAULTS"):
        return {"target": target, "value": draw(pick(*(0, 1, 5, 30)))}
    if target == "CONFIG.SLOPE":
        return {"target": target, "value": draw(pick(*(0.0, 0.5, 2.0)))}
    index = draw(ints(0, HEAD_TABLE - 1))
    if target == "HEAD_WIDTHS":
        return {"target": target, "index": index, "value": draw(ints(0, 8))}
    return {"target": target, "index": index, "value": draw(pick(*(0.0, 4.0, 0.3)))}


def magnitude(draw) -> tuple[Optional[int], Optional[float]]:
    """``(q gain, softmax scale)``: scores beyond +-100 from a scaled q or a large scale.

    q and k are then exact multiples of 1/4 and the gain and the scale powers of two,
    so every score is exact in float32 and a difference from the oracle is not rounding.
    """
    if not draw(one_in(8)):
        return None, None
    if draw(st.booleans()):
        return draw(pick(*(64, 512))), draw(pick(*(0.25, 0.5, 1.0)))
    return 1, draw(pick(*(16.0, 64.0)))


def turbo_build(draw, need: bool = False) -> Optional[dict]:
    """Knobs of the fake Primus-Turbo build, or None (not installed)."""
    if not need and draw(one_in(10)):
        return None
    return {
        "flex_bshd": draw(st.booleans()),
        "flex_deterministic": not draw(one_in(4)),
        "varlen_sink": not draw(one_in(4)),
        "flex": not draw(one_in(10)),
        # the arch whose kernel dispatch (and upstream's per-arch defects) the fake models, presented as the
        # device's: turbo_arch auto plans for it (B33)
        "arch": draw(weighted((None, 6), ("gfx942", 2), ("gfx950", 2))),
    }


def compiled(draw) -> Optional[str]:
    """Eager, or under ``torch.compile(fullgraph=True)``: about one case in eight in the long profile (at least
    2,000 of its 20,000), one in thirty in ci (each compile costs a fraction of a second)."""
    from hypothesis import settings as hyp_settings

    long = hyp_settings.get_current_profile_name() == "long"
    return draw(_COMPILED_LONG if long else _COMPILED_CI)


_COMPILED_LONG = weighted((None, 14), ("aot_eager", 2), ("inductor", 1))
_COMPILED_CI = weighted((None, 58), ("aot_eager", 1), ("inductor", 1))


def common_settings(draw, flex: bool, backend: str, q_len: int) -> dict:
    keys: dict[str, Any] = {
        "use_turbo_attention": not draw(one_in(60)) or not flex,
        "use_turbo_flex_attention": flex,
        "turbo_flex_attention_backend": backend,
        "use_sink_attention": draw(one_in(3)),
        "deterministic_mode": draw(one_in(4)),
        "enable_turbo_attention_float8": draw(one_in(24 if flex else 6)),
        "reset_attention_mask": draw(one_in(15)),
        "sink_window_even_layers_only": draw(st.booleans()),
    }
    choice = draw(weighted(("none", 44), ("window", 15), ("malformed", 1)))
    if choice == "window":
        keys["sink_sliding_window"] = draw(ints(1, q_len + 2))
    elif choice == "malformed":
        keys["sink_sliding_window"] = -1  # malformed: refused when the settings are read
    return keys


def with_hooks(keys: dict, mask: tuple, score: tuple) -> dict:
    for kind, (name, kwargs) in (("mask", mask), ("score", score)):
        if name is not None:
            keys[f"turbo_flex_attention_{kind}_mod"] = name
            if kwargs is not None:
                keys[f"turbo_flex_attention_{kind}_mod_kwargs"] = kwargs
    return keys


def config_window(draw) -> Optional[tuple[int, int]]:
    if not draw(one_in(6)):
        return None
    return (draw(BOUND), draw(BOUND))


def model_facts(draw, *, megatron: bool, q_len: int) -> dict:
    hq, hkv = heads(draw, allow_bad=not megatron)
    d = draw(pick(*(2, 4, 8, 16, 4, 8, 6, 12)))
    dv = d if megatron or not draw(one_in(6)) else draw(pick(*(2, 4, 6, 8)))
    cp = 2 if draw(one_in(25)) else 1
    layer = {
        "num_heads": hq,
        "num_kv_heads": hkv,
        "head_dim": d,
        "head_dim_v": dv,
        "layer_number": draw(ints(1, 4)),
        "attn_mask_type": draw(pick(*MASK_TYPES[:3])) if not draw(one_in(40)) else "padding",
        "window_size": config_window(draw),
        "window_attn_skip_freq": draw(pick(*(None, None, 2, 3))),
        "softmax_type": draw(weighted(("vanilla", 10), ("learnable", 1), ("off-by-one", 1))),
        "context_parallel_size": cp,
        "cp_comm_type": draw(pick(*(None, "a2a", "p2p", "all_gather"))) if cp > 1 else None,
        "attention_dropout": draw(weighted((0.0, 8), (0.1, 1))),
        "position_embedding_type": draw(weighted(("learned_absolute", 16), ("rope", 3), ("alibi", 1))),
        "softmax_scale": draw(pick(*(None, None, None, 0.5, 0.125))),
    }
    if not megatron:
        if draw(one_in(50)):
            layer["attention_dropout"] = draw(pick(*(1.0, -0.25)))
        # The training length, unknown, or another length (hook proofs assume none).
        layer["seq_length"] = draw(pick(*(q_len, q_len, None, draw(ints(1, 40))))) or None  # 0: a call without queries
    return layer


def fewer_conflicts(draw, keys: dict, layer: dict) -> None:
    """Most of the time, drop one side of the window conflicts (B10, B11) so more cases run."""
    if keys.get("turbo_flex_attention_mask_mod") and keys["use_turbo_flex_attention"] and not draw(one_in(5)):
        keys.pop("sink_sliding_window", None)
        layer["window_size"] = None
    if layer["window_size"] is not None and keys.get("sink_sliding_window", 0) > 0 and not draw(one_in(4)):
        keys.pop("sink_sliding_window")
    if layer["window_size"] is None and not draw(one_in(4)):
        layer["window_attn_skip_freq"] = None  # skip-freq-window: megatron-core applies it to window_size only
    if layer["softmax_type"] == "off-by-one" and keys.get("use_sink_attention") and not draw(one_in(4)):
        keys["use_sink_attention"] = False  # B10-sink: two sources for one sink


# ----------------------------------------------------------------------------- adapter level
@st.composite
def adapter_cases(draw) -> Case:
    thd = draw(one_in(4))
    dtype = draw(pick(*("float32", "float32", "float64", "bfloat16")))
    degenerate = draw(one_in(30))  # no query: batch 0, sequence 0, or no token (the reference's empty result)
    if thd:
        docs_q = document_lengths(draw) if not degenerate else [0]
        docs_kv = docs_q if not draw(one_in(5)) or degenerate else draw(
            st.lists(ints(0, 9), min_size=len(docs_q), max_size=len(docs_q)).filter(lambda x: sum(x) > 0))
        batch, q_len, kv_len = 1, sum(docs_q), sum(docs_kv)
    else:
        docs_q = docs_kv = None
        batch = draw(ints(1, 4))
        q_len = draw(ints(1, 24))
        kv_len = q_len if not draw(one_in(4)) else draw(ints(1, 24))
        if degenerate:
            batch, q_len, kv_len = (0, q_len, kv_len) if draw(st.booleans()) else (batch, 0, 0)
    fake = turbo_build(draw)
    backend = draw(weighted(("reference", 5), ("turbo", 5), ("auto", 3), ("flex", 2)))
    keys = common_settings(draw, True, backend, q_len)
    mask = mask_hook(draw, q_len, kv_len)
    gain, scale = magnitude(draw)
    score = score_hook(draw, exact_scores=gain is not None, dtype=dtype)
    dtype = hook_dtype(score, dtype, gain is not None)
    keys = with_hooks(keys, mask, score)
    layer = model_facts(draw, megatron=False, q_len=q_len)
    fewer_conflicts(draw, keys, layer)
    layer["packed"] = draw(pick(*(None, None, thd)))
    hooked = mask[0] is not None
    # Per-call causal / window: the layer's own (what Megatron passes), left out (None: the plan's), or
    # anything; in drop-in mode (the setting, or the adapter's argument) a call's own run, checked by the
    # layer's rules, otherwise a call asking for another mask is refused (B34).
    choice = draw(weighted(("layer", 4), ("default", 2), ("any", 5)))
    if choice != "any":
        call_causal, call_window = choice, choice
    else:
        call_causal = draw(st.booleans())
        call_window = [draw(BOUND), draw(BOUND)]
    if hooked and not draw(one_in(5)):
        call_causal, call_window = False, [-1, -1]
    drop_in = draw(weighted(("setting", 3), ("off", 2), ("argument", 1)))
    if drop_in == "setting":
        keys["turbo_flex_attention_call_flags"] = "drop_in"
    call = {
        "thd": thd,
        "batch": batch,
        "q_len": q_len,
        "kv_len": kv_len,
        "docs_q": docs_q,
        "docs_kv": docs_kv,
        "dtype": dtype,
        "causal": call_causal,
        "window": call_window,
        "drop_in": drop_in,
        "sink": draw(weighted(("planned", 8), ("none", 2), ("unplanned", 1))),
        "sink_dtype": draw(pick(*("float32", "bfloat16", "same"))),
        "alibi": draw(one_in(10)),
        "bias": draw(one_in(12)),
        "scale": draw(pick(*(None, None, None, 0.3))),
        "gain": None,
        "mutate": mutation(draw, mask, score),
        "return_lse": draw(one_in(5)),
        "return_attn_probs": draw(one_in(30)),
        "max_seqlen": draw(pick(*("exact", "none"))),
    }
    if gain is not None:
        call["gain"], call["scale"] = gain, scale
    return Case("adapter", True, backend, fake, keys, layer, call, draw(one_in(4)),
                draw(ints(0, 2 ** 16)), compiled(draw))


# ----------------------------------------------------------------------------- megatron level
@st.composite
def megatron_cases(draw) -> Case:
    flex = not draw(one_in(3))
    thd = draw(one_in(3))
    dtype = draw(pick(*("float32", "float32", "float64", "bfloat16")))
    equal_declared = draw(one_in(6))  # B36: documents declared of one length, kept (mostly) or broken
    degenerate = draw(one_in(30))
    if thd:
        docs = document_lengths(draw)
        if equal_declared and not draw(one_in(3)):
            docs = [max(max(docs), 1)] * len(docs)
        if degenerate:
            docs = [0]
        batch, q_len = 1, sum(docs)
    else:
        docs = None
        batch, q_len = draw(ints(1, 4)), draw(ints(1, 20))
        if degenerate:
            batch, q_len = (0, q_len) if draw(st.booleans()) else (batch, 0)
    fake = turbo_build(draw, need=not flex and not draw(one_in(15)))
    backend = draw(weighted(("turbo", 5), ("reference", 3), ("auto", 3), ("flex", 2)))
    keys = common_settings(draw, flex, backend, q_len)
    gain, scale = magnitude(draw)
    mask = score = (None, None)
    if flex:
        mask, score = mask_hook(draw, q_len, q_len), score_hook(draw, exact_scores=gain is not None, dtype=dtype)
        dtype = hook_dtype(score, dtype, gain is not None)
        keys = with_hooks(keys, mask, score)
    layer = model_facts(draw, megatron=True, q_len=q_len)
    fewer_conflicts(draw, keys, layer)
    declared = draw(weighted(("unset", 8), ("match", 2), ("other", 1)))  # packed_sequences vs the call
    if declared != "unset":
        keys["packed_sequences"] = thd if declared == "match" else not thd
    if equal_declared:
        keys["packed_equal_documents"] = True
    if draw(one_in(4)):  # the modules pass the plan's own causal / window: drop-in mode changes nothing
        keys["turbo_flex_attention_call_flags"] = "drop_in"
    layer["params_bf16"] = draw(one_in(6))
    padded = draw(weighted(("none", 6), ("same", 1), ("different", 1), ("kv_clone", 1)))
    call = {
        "thd": thd,
        "batch": batch,
        "q_len": q_len,
        "kv_len": q_len,
        "docs_q": docs,
        "docs_kv": docs,
        "dtype": dtype,
        "padded": padded if thd else "none",
        "packed_params": "thd" if thd else draw(weighted(("none", 16), ("empty", 1), ("sbhd_bounds", 1))),
        "attention_bias": draw(one_in(25)),
        "four_dim_thd": thd and draw(st.booleans()),
        "gain": None,
        "mutate": mutation(draw, mask, score),
    }
    if gain is not None:
        call["gain"], layer["softmax_scale"] = gain, scale
    return Case("megatron", flex, backend, fake, keys, layer, call, draw(one_in(3)),
                draw(ints(0, 2 ** 16)), compiled(draw))


__all__ = ["Case", "DTYPES", "LIB", "USER", "adapter_cases", "bounds_of", "megatron_cases"]
