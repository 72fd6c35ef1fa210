"""Bodies of the fake Primus-Turbo entries: the real kernels' checks, then the fake's math.

Each body takes the call's bound arguments (defaults applied) and the fake's
`MaskClassifier`.  The checks are the ones the ROCm kernels and the flex layer
perform, so a project bug that would crash or silently differ on an MI300 shows
up on CPU.  The numbers come from `._fake_math` (blockwise online softmax with a
hand-written backward), which shares no code with `primus_ext.backends.exact`, the
reference backend's math: a parity test between the two compares two independent
implementations, and both are held to the float64 oracles of the test suite.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import Tensor

from ..attention.pattern import FULL, pattern_from_flash_args
from . import _fake_math
from ._fake_masks import MaskClassifier, score_mod_is_identity

Args = dict[str, Any]
Body = Callable[[Args, MaskClassifier], Any]


# ----------------------------------------------------------------------------- checks
def _check_dims(name: str, tensors: Sequence[Tensor], ndim: int, layout: str) -> None:
    for label, t in zip(("q", "k", "v"), tensors):
        if not isinstance(t, Tensor) or t.dim() != ndim:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name}: {label} must be a {ndim}-D {layout} tensor, got {got}")


def _check_heads(name: str, hq: int, hkv: int) -> None:
    if hkv <= 0 or hq % hkv:
        raise ValueError(f"{name}: query heads ({hq}) must be a multiple of key/value heads ({hkv})")


def _check_dropout(name: str, p: float) -> None:
    if not 0.0 <= float(p) < 1.0:
        raise ValueError(f"{name}: dropout_p must satisfy 0 <= p < 1, got {p}")


def _check_alibi(name: str, slopes: Optional[Tensor], hq: int) -> None:
    if slopes is None:
        return
    if not isinstance(slopes, Tensor) or slopes.dtype != torch.float32 or slopes.shape != (hq,):
        got = (slopes.dtype, tuple(slopes.shape)) if isinstance(slopes, Tensor) else slopes
        raise ValueError(f"{name}: alibi_slopes must be a 1-D fp32 tensor of length {hq}, got {got}")


def _check_bias(name: str, bias: Optional[Tensor], q: Tensor, q_len: int, kv_len: int) -> None:
    """The kernel takes one [Sq, Skv] bias in q's dtype; other shapes fail inside it."""
    if bias is None:
        return
    if not isinstance(bias, Tensor) or bias.shape != (q_len, kv_len) or bias.dtype != q.dtype:
        got = (bias.dtype, tuple(bias.shape)) if isinstance(bias, Tensor) else bias
        raise RuntimeError(
            f"{name}: bias must be one [{q_len}, {kv_len}] tensor in {q.dtype}, got {got}"
        )


def _check_sink(name: str, sink: Optional[Tensor], hq: int, d_qk: int, d_v: int) -> None:
    if sink is None:
        return
    if not isinstance(sink, Tensor) or sink.dtype != torch.float32:
        got = sink.dtype if isinstance(sink, Tensor) else type(sink).__name__
        raise ValueError(f"{name}: sink must be fp32 (cast with .float()), got {got}")
    if sink.dim() != 1 or sink.numel() != hq:
        raise ValueError(f"{name}: sink must have shape ({hq},), got {tuple(sink.shape)}")
    if d_qk != d_v or d_qk & (d_qk - 1):
        raise ValueError(
            f"{name}: the sink path needs head_dim_qk == head_dim_v and a power-of-two head dim,"
            f" got {d_qk} and {d_v}"
        )


def _check_softcap(name: str, softcap: Optional[float]) -> None:
    if softcap is not None and float(softcap) > 0:
        raise ValueError(f"{name}: softcap={softcap} has no backward kernel; it is refused")


def _check_no_probs(name: str, a: Args) -> None:
    if a.get("return_attn_probs"):
        raise NotImplementedError(f"{name}: return_attn_probs=True is not modelled by the fake")


def _check_cu_seqlens(name: str, which: str, cu: Any, max_seqlen: Any, total: int,
                      device: torch.device) -> list[int]:
    """Validate one boundary vector like the flex layer does, returning it on the host."""
    label = f"cu_seqlens_{which}"
    if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.dtype != torch.int32:
        got = (cu.dtype, tuple(cu.shape)) if isinstance(cu, Tensor) else type(cu).__name__
        raise ValueError(f"{name}: {label} must be a 1-D int32 tensor, got {got}")
    if cu.device != device:
        raise ValueError(f"{name}: {label} is on {cu.device}, q is on {device}")
    # The real layer copies the boundaries to the host too (one sync per call).
    bounds = [int(x) for x in cu.tolist()]
    if len(bounds) < 2 or bounds[0] != 0 or any(x > y for x, y in zip(bounds, bounds[1:])):
        raise ValueError(f"{name}: {label} must start at 0 and not decrease, got {bounds}")
    if bounds[-1] != total:
        raise ValueError(f"{name}: {label}[-1]={bounds[-1]} but there are {total} tokens")
    longest = max(y - x for x, y in zip(bounds, bounds[1:]))
    if int(max_seqlen) < longest:
        raise ValueError(f"{name}: max_seqlen_{which}={max_seqlen} < longest segment {longest}")
    return bounds


# ----------------------------------------------------------------------------- bodies
def dense_flash(name: str, *, fp8: bool = False, faults: Iterable[str] = ()) -> Body:
    """Body of flash_attn_func and its fp8 / usp twins (bshd)."""
    faults = _fake_math.check_faults(faults)

    def body(a: Args, _classify: MaskClassifier) -> Any:
        q, k, v = a["q"], a["k"], a["v"]
        _check_dims(name, (q, k, v), 4, "bshd [B, S, H, D]")
        if a.get("qkv_format") not in (None, "bshd"):
            raise NotImplementedError(f"{name}: the fake only models qkv_format='bshd'")
        _, q_len, hq, d_qk = q.shape
        kv_len, hkv, d_v = k.shape[1], k.shape[2], v.shape[3]
        _check_heads(name, hq, hkv)
        _check_no_probs(name, a)
        _check_dropout(name, a["dropout_p"])
        window = tuple(a["window_size"])
        if fp8 and window != (-1, -1):
            raise ValueError(f"{name}: the fp8 kernel only takes window_size=(-1, -1), got {window}")
        _check_bias(name, a["bias"], q, q_len, kv_len)
        _check_alibi(name, a["alibi_slopes"], hq)
        _check_sink(name, a.get("sink"), hq, d_qk, d_v)
        pattern = pattern_from_flash_args(bool(a["causal"]), window)  # type: ignore[arg-type]
        return _fake_math.attention(
            q, k, v, window=pattern, scale=a["softmax_scale"], alibi_slopes=a["alibi_slopes"],
            bias=a["bias"], sink=a.get("sink"), dropout_p=float(a["dropout_p"]),
            return_lse=bool(a["return_lse"]), faults=faults,
        )

    return body


def _varlen_core(name: str, a: Args, q_key: str, *, causal: bool, window: tuple[int, int],
                 scale: Optional[float], require_same_bounds: bool, faults: Iterable[str]) -> Any:
    q, k, v = a[q_key], a["k" if q_key == "q" else "key"], a["v" if q_key == "q" else "value"]
    _check_dims(name, (q, k, v), 3, "thd [T, H, D]")
    hq, d_qk, hkv, d_v = q.shape[1], q.shape[2], k.shape[1], v.shape[2]
    _check_heads(name, hq, hkv)
    _check_dropout(name, a["dropout_p"])
    bq = _check_cu_seqlens(name, "q", a["cu_seqlens_q"], a["max_seqlen_q"], q.shape[0], q.device)
    bk = _check_cu_seqlens(name, "k", a["cu_seqlens_k"], a["max_seqlen_k"], k.shape[0], q.device)
    if len(bq) != len(bk):
        raise ValueError(f"{name}: cu_seqlens_q and cu_seqlens_k describe different batch sizes")
    if require_same_bounds and bq != bk:
        raise ValueError(f"{name}: causal=True needs identical q and kv boundaries, got {bq} vs {bk}")
    _check_alibi(name, a["alibi_slopes"], hq)
    _check_sink(name, a.get("sink"), hq, d_qk, d_v)
    # Each segment pair is one problem, its window aligned bottom-right inside the pair;
    # lse comes back as [Hq, T], the flash-attn varlen layout.
    return _fake_math.varlen_attention(
        q, k, v, bq, bk, window=pattern_from_flash_args(causal, window), scale=scale,
        alibi_slopes=a["alibi_slopes"], sink=a.get("sink"), dropout_p=float(a["dropout_p"]),
        return_lse=bool(a["return_lse"]), faults=faults,
    )


def varlen_flash(name: str, *, faults: Iterable[str] = ()) -> Body:
    """Body of flash_attn_varlen_func and flash_attn_varlen_usp_func (thd)."""
    faults = _fake_math.check_faults(faults)

    def body(a: Args, _classify: MaskClassifier) -> Any:
        _check_no_probs(name, a)
        if a["bias"] is not None:
            raise NotImplementedError(f"{name}: the fake does not model a varlen bias")
        return _varlen_core(name, a, "q", causal=bool(a["causal"]), window=tuple(a["window_size"]),
                            scale=a["softmax_scale"], require_same_bounds=False, faults=faults)

    return body


def flex_varlen(name: str, *, faults: Iterable[str] = ()) -> Body:
    """Body of flex_attention_varlen (thd): the flex layer's stricter varlen checks."""
    faults = _fake_math.check_faults(faults)

    def body(a: Args, _classify: MaskClassifier) -> Any:
        _check_softcap(name, a["softcap"])
        causal = bool(a["causal"])
        return _varlen_core(name, a, "query", causal=causal, window=tuple(a["window_size"]),
                            scale=a["scale"], require_same_bounds=causal, faults=faults)

    return body


def flex_dense(name: str, layout: str, *, faults: Iterable[str] = ()) -> Body:
    """Body of flex_attention (``bhsd``) and flex_attention_bshd (``bshd``)."""
    seq_dim = 2 if layout == "bhsd" else 1
    faults = _fake_math.check_faults(faults)

    def body(a: Args, classify: MaskClassifier) -> Any:
        q, k, v = a["query"], a["key"], a["value"]
        _check_dims(name, (q, k, v), 4, f"{layout} tensor")
        q_len, kv_len = q.shape[seq_dim], k.shape[seq_dim]
        if layout == "bhsd":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        batch, _, hq, d_qk = q.shape
        hkv, d_v = k.shape[2], v.shape[3]
        if hq != hkv and not a["enable_gqa"]:
            raise ValueError(f"{name}: {hq} query heads vs {hkv} key/value heads needs enable_gqa=True")
        _check_heads(name, hq, hkv)
        _check_softcap(name, a["softcap"])
        _check_dropout(name, a["dropout_p"])
        _check_alibi(name, a["alibi_slopes"], hq)
        _check_bias(name, a["bias"], q, q_len, kv_len)
        _check_sink(name, a["sink"], hq, d_qk, d_v)
        if not score_mod_is_identity(a["score_mod"], hq, q_len, kv_len):
            if a["alibi_slopes"] is not None:
                raise ValueError(f"{name}: alibi_slopes together with a non-identity score_mod")
            raise NotImplementedError(f"{name}: the fake only accepts an identity score_mod")
        pattern = FULL
        block_mask = a["block_mask"]
        if block_mask is not None:
            lengths = tuple(int(x) for x in getattr(block_mask, "seq_lengths", (q_len, kv_len)))
            if lengths != (q_len, kv_len):
                raise ValueError(
                    f"{name}: block_mask was built for (Q_LEN, KV_LEN)={lengths} but the {layout} "
                    f"inputs have ({q_len}, {kv_len}); is the layout (transpose) right?"
                )
            pattern = classify(block_mask, batch, hq, q_len, kv_len)
        result = _fake_math.attention(  # flash alignment (bottom-right), as for the flash entries
            q, k, v, window=pattern, scale=a["scale"], alibi_slopes=a["alibi_slopes"], bias=a["bias"],
            sink=a["sink"], dropout_p=float(a["dropout_p"]), return_lse=bool(a["return_lse"]),
            faults=faults,
        )
        out = result[0] if a["return_lse"] else result
        if layout == "bhsd":
            out = out.transpose(1, 2)
        return (out, result[1]) if a["return_lse"] else out

    return body


__all__ = ["Args", "Body", "dense_flash", "flex_dense", "flex_varlen", "varlen_flash"]
