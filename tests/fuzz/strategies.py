"""Hypothesis strategies: one generated `Case` is a whole attention layer plus one call.

A case says where it is run (the adapter `TurboFlexAttention` built by `build_plan`,
or Megatron's `PrimusTurboLocalAttention`), which Primus-Turbo build is installed
(none, or the CPU fake with its build knobs), every YAML key and model fact, and the
call: layout, shapes, dtype, per-call arguments, and whether gradients are checked.
Tensor values are not part of the case; they come from ``seed``.

Everything is drawn so that hypothesis can shrink a failure to a small case.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from hypothesis import strategies as st

LIB = "primus_ext.attention.masks"
USER = "tests.fuzz.user_hooks"
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
MASK_TYPES = ("causal", "no_mask", "causal_bottom_right", "padding")
# A window bound: unbounded, zero, or a positive width (small or past the sequence).
BOUND = st.one_of(st.just(-1), st.just(0), st.integers(1, 6), st.integers(7, 40))


def one_in(n: int):
    """True about once in ``n`` draws.

    Hypothesis favours the ends of a range, so the rare value sits in the middle (a
    True at either end would come up far more often than 1/n); it shrinks to False.
    """
    return st.integers(0, n - 1).map(lambda i: n > 1 and i == n // 2)


def weighted(*options):
    """``(value, weight)`` options; the first is the common one and also owns both ends of
    the range, where hypothesis' integer draws pile up, so rare values stay rare."""
    values = [v for v, w in options for _ in range(w)] + [options[0][0]]
    return st.integers(0, len(values) - 1).map(values.__getitem__)


@dataclass(frozen=True)
class Case:
    """One generated layer + call.  ``level``: ``adapter`` or ``megatron``."""

    level: str
    flex: bool
    backend: str
    """``turbo_flex_attention_backend`` as written (``reference``, ``turbo`` or ``auto``)."""
    fake: Optional[dict]
    """Knobs of ``fake_primus_turbo`` (the Turbo build imitated), or None: no Primus-Turbo."""
    settings: dict
    layer: dict
    """Model facts: heads, head dims, layer number, mask type, config window, CP, ..."""
    call: dict
    """Layout (``thd``), shapes, dtype and the per-call arguments."""
    grad: bool
    seed: int

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
@st.composite
def document_lengths(draw, total: Optional[int] = None, max_docs: int = 5) -> list[int]:
    """Document lengths, empty and length-1 documents included; sum ``total`` if given."""
    if total is None:
        lengths = draw(st.lists(st.one_of(st.just(0), st.just(1), st.integers(2, 9)), min_size=1,
                                max_size=max_docs))
        if sum(lengths) == 0:
            lengths[-1] = draw(st.integers(1, 6))
        return lengths
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=0, max_size=max_docs - 1)))
    bounds = [0, *cuts, total]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def bounds_of(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


@st.composite
def heads(draw, allow_bad: bool) -> tuple[int, int]:
    hq = draw(st.sampled_from((1, 2, 3, 4, 6, 8)))
    if allow_bad and draw(one_in(20)):
        bad = [g for g in (2, 3, 4, 5) if hq % g]
        if bad:
            return hq, draw(st.sampled_from(bad))
    return hq, draw(st.sampled_from([g for g in range(1, hq + 1) if hq % g == 0]))


@st.composite
def mask_hook(draw, q_len: int, kv_len: int) -> tuple[Optional[str], Optional[dict]]:
    """A mask hook setting and its kwargs: library masks, and hooks written as a user would.

    The user's document hook indexes a tensor; it is always long enough for the call
    itself (a hook that cannot be evaluated at the user's own shape is the user's bug),
    but it may be shorter than the grid the project probes it on.
    """
    kind = draw(weighted(("none", 2), ("library", 2), ("user", 1)))
    if kind == "none":
        return None, None
    if kind == "library":
        name = draw(st.sampled_from(("full", "causal", "sliding_window", "prefix_lm", "chunked",
                                     "packed_documents")))
        if name in ("full", "causal"):
            return f"{LIB}:{name}", {}
        if name == "sliding_window":
            return f"{LIB}:{name}", {"left": draw(BOUND), "right": draw(BOUND)}
        if name == "prefix_lm":
            return f"{LIB}:{name}", {"prefix_length": draw(st.integers(0, q_len + 2))}
        if name == "chunked":
            return f"{LIB}:{name}", {"chunk_size": draw(st.integers(1, q_len + 2)), "causal": draw(st.booleans())}
        total = q_len if not draw(one_in(6)) else draw(st.integers(1, q_len + 4))
        bounds = bounds_of(draw(document_lengths(total)))
        return f"{LIB}:{name}", {"cu_seqlens": bounds, "causal": draw(st.booleans()),
                                 "window": [draw(BOUND), draw(BOUND)]}
    name = draw(st.sampled_from(("causal", "everything", "strictly_causal", "prefix_four", "every_other_key",
                                 "first_head_sees_all", "first_batch_causal", "band", "documents")))
    if name == "band":
        return f"{USER}:band", {"left": draw(BOUND), "right": draw(BOUND)}
    if name == "documents":
        longest = max(q_len, kv_len)
        total = longest if not draw(one_in(4)) else draw(st.integers(longest, longest + 12))
        return f"{USER}:documents", {"lengths": draw(document_lengths(total)), "causal": draw(st.booleans())}
    return f"{USER}:{name}", None


SCORE_HOOKS = weighted((None, 12), ("identity", 1), ("alibi", 3), ("alibi_third", 1), ("symmetric_distance", 1),
                       ("softcap", 1), ("doubled", 1))


@st.composite
def turbo_build(draw, need: bool = False) -> Optional[dict]:
    """Knobs of the fake Primus-Turbo build, or None (not installed)."""
    if not need and draw(one_in(10)):
        return None
    return {
        "flex_bshd": draw(st.booleans()),
        "flex_deterministic": not draw(one_in(4)),
        "varlen_sink": not draw(one_in(4)),
        "flex": not draw(one_in(10)),
    }


@st.composite
def common_settings(draw, flex: bool, backend: str, q_len: int) -> dict:
    keys: dict[str, Any] = {
        "use_turbo_attention": not draw(one_in(60)) or not flex,
        "use_turbo_flex_attention": flex,
        "turbo_flex_attention_backend": backend,
        "use_sink_attention": draw(one_in(3)),
        "deterministic_mode": draw(one_in(4)),
        "enable_turbo_attention_float8": draw(one_in(24 if flex else 6)),
        "reset_attention_mask": draw(one_in(50)),
        "sink_window_even_layers_only": draw(st.booleans()),
    }
    choice = draw(weighted(("none", 44), ("window", 15), ("malformed", 1)))
    if choice == "window":
        keys["sink_sliding_window"] = draw(st.integers(1, q_len + 2))
    elif choice == "malformed":
        keys["sink_sliding_window"] = -1  # malformed: refused when the settings are read
    return keys


def with_hooks(keys: dict, mask: tuple, score: Optional[str]) -> dict:
    name, kwargs = mask
    if name is not None:
        keys["turbo_flex_attention_mask_mod"] = name
        if kwargs is not None:
            keys["turbo_flex_attention_mask_mod_kwargs"] = kwargs
    if score is not None:
        keys["turbo_flex_attention_score_mod"] = f"{USER}:{score}"
    return keys


@st.composite
def config_window(draw) -> Optional[tuple[int, int]]:
    if not draw(one_in(6)):
        return None
    return (draw(BOUND), draw(BOUND))


@st.composite
def model_facts(draw, *, megatron: bool, q_len: int) -> dict:
    hq, hkv = draw(heads(allow_bad=not megatron))
    d = draw(st.sampled_from((2, 4, 8, 16, 4, 8, 6, 12)))
    dv = d if megatron or not draw(one_in(6)) else draw(st.sampled_from((2, 4, 6, 8)))
    cp = 2 if draw(one_in(25)) else 1
    layer = {
        "num_heads": hq,
        "num_kv_heads": hkv,
        "head_dim": d,
        "head_dim_v": dv,
        "layer_number": draw(st.integers(1, 4)),
        "attn_mask_type": draw(st.sampled_from(MASK_TYPES[:3])) if not draw(one_in(40)) else "padding",
        "window_size": draw(config_window()),
        "window_attn_skip_freq": draw(st.sampled_from((None, None, 2, 3))),
        "softmax_type": draw(weighted(("vanilla", 10), ("learnable", 1), ("off-by-one", 1))),
        "context_parallel_size": cp,
        "cp_comm_type": draw(st.sampled_from((None, "a2a", "p2p", "all_gather"))) if cp > 1 else None,
        "attention_dropout": draw(weighted((0.0, 8), (0.1, 1))),
        "position_embedding_type": draw(weighted(("learned_absolute", 16), ("rope", 3), ("alibi", 1))),
        "softmax_scale": draw(st.sampled_from((None, None, None, 0.5, 0.125))),
    }
    if not megatron:
        if draw(one_in(50)):
            layer["attention_dropout"] = draw(st.sampled_from((1.0, -0.25)))
        # The probe grid of mask hooks: the training length, unknown, or another length.
        layer["seq_length"] = draw(st.sampled_from((q_len, q_len, None, draw(st.integers(1, 40)))))
    return layer


@st.composite
def fewer_conflicts(draw, keys: dict, layer: dict) -> None:
    """Most of the time, drop one side of the window conflicts (B10, B11) so more cases run."""
    if keys.get("turbo_flex_attention_mask_mod") and keys["use_turbo_flex_attention"] and not draw(one_in(5)):
        keys.pop("sink_sliding_window", None)
        layer["window_size"] = None
    if layer["window_size"] is not None and keys.get("sink_sliding_window", 0) > 0 and not draw(one_in(4)):
        keys.pop("sink_sliding_window")


# ----------------------------------------------------------------------------- adapter level
@st.composite
def adapter_cases(draw) -> Case:
    thd = draw(one_in(4))
    dtype = draw(st.sampled_from(("float32", "float32", "float64", "bfloat16")))
    if thd:
        docs_q = draw(document_lengths())
        docs_kv = docs_q if not draw(one_in(5)) else draw(
            st.lists(st.integers(0, 9), min_size=len(docs_q), max_size=len(docs_q)).filter(lambda x: sum(x) > 0))
        batch, q_len, kv_len = 1, sum(docs_q), sum(docs_kv)
    else:
        docs_q = docs_kv = None
        batch = draw(st.integers(1, 3))
        q_len = draw(st.integers(1, 24))
        kv_len = q_len if not draw(one_in(4)) else draw(st.integers(1, 24))
    fake = draw(turbo_build())
    backend = draw(st.sampled_from(("reference", "reference", "turbo", "turbo", "auto")))
    keys = draw(common_settings(True, backend, q_len))
    mask = draw(mask_hook(q_len, kv_len))
    score = draw(SCORE_HOOKS)
    keys = with_hooks(keys, mask, score)
    layer = draw(model_facts(megatron=False, q_len=q_len))
    draw(fewer_conflicts(keys, layer))
    layer["packed"] = draw(st.sampled_from((None, None, thd)))
    hooked = mask[0] is not None
    # Per-call causal / window: the layer's own (what Megatron passes), or anything.
    if draw(st.booleans()):
        call_causal, call_window = "layer", "layer"
    else:
        call_causal = draw(st.booleans())
        call_window = [draw(BOUND), draw(BOUND)]
    if hooked and not draw(one_in(5)):
        call_causal, call_window = False, [-1, -1]
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
        "sink": draw(weighted(("planned", 8), ("none", 2), ("unplanned", 1))),
        "sink_dtype": draw(st.sampled_from(("float32", "bfloat16", "same"))),
        "alibi": draw(one_in(10)),
        "bias": draw(one_in(12)),
        "scale": draw(st.sampled_from((None, None, None, 0.3))),
        "return_lse": draw(one_in(5)),
        "return_attn_probs": draw(one_in(30)),
        "max_seqlen": draw(st.sampled_from(("exact", "none"))),
    }
    return Case("adapter", True, backend, fake, keys, layer, call, draw(one_in(4)),
                draw(st.integers(0, 2 ** 16)))


# ----------------------------------------------------------------------------- megatron level
@st.composite
def megatron_cases(draw) -> Case:
    flex = not draw(one_in(3))
    thd = draw(one_in(3))
    dtype = draw(st.sampled_from(("float32", "float32", "float64", "bfloat16")))
    if thd:
        docs = draw(document_lengths())
        batch, q_len = 1, sum(docs)
    else:
        docs = None
        batch, q_len = draw(st.integers(1, 3)), draw(st.integers(1, 20))
    fake = draw(turbo_build(need=not flex and not draw(one_in(15))))
    backend = draw(st.sampled_from(("reference", "turbo", "turbo", "auto")))
    keys = draw(common_settings(flex, backend, q_len))
    if flex:
        keys = with_hooks(keys, draw(mask_hook(q_len, q_len)), draw(SCORE_HOOKS))
    layer = draw(model_facts(megatron=True, q_len=q_len))
    draw(fewer_conflicts(keys, layer))
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
    }
    return Case("megatron", flex, backend, fake, keys, layer, call, draw(one_in(3)),
                draw(st.integers(0, 2 ** 16)))


__all__ = ["Case", "DTYPES", "LIB", "USER", "adapter_cases", "bounds_of", "megatron_cases"]
