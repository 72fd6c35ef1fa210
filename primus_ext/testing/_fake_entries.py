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

from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence

import torch
from torch import Tensor

from ..attention.pattern import FULL, Pattern, pattern_from_flash_args
from . import _fake_math
from ._fake_dispatch import check_cu_seqlens, check_layout
from ._fake_flydsl import fixed_strides
from ._fake_fp8 import check_fp8, fp8_layout, fp8_output, fp8_unpermute
from ._fake_masks import MaskClassifier, score_mod_is_identity

if TYPE_CHECKING:
    from ._fake_dispatch import Dispatcher

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


# ----------------------------------------------------------------------------- bodies
def dense_flash(name: str, *, fp8: bool = False, faults: Iterable[str] = (),
                dispatch: Optional["Dispatcher"] = None) -> Body:
    """Body of flash_attn_func and its fp8 twin (bshd); the usp twins are `usp_flash`.

    ``dispatch`` (an arch is set, `._fake_dispatch`): route the call to a kernel backend first;
    it raises what that backend raises and adds the faults of its silent defects."""
    if name.endswith("_usp_func"):
        return usp_flash(name, fp8=fp8, faults=faults)
    faults = _fake_math.check_faults(faults)

    def body(a: Args, _classify: MaskClassifier) -> Any:
        if fp8:  # accepted and never passed on to the kernel, as upstream (flash_attn_interface.py l.505-565)
            a = dict(a, deterministic=False)
        q, k, v = a["q"], a["k"], a["v"]
        _check_dims(name, (q, k, v), 4, "bshd [B, S, H, D]")
        if a.get("qkv_format") not in (None, "bshd"):
            raise NotImplementedError(f"{name}: the fake only models qkv_format='bshd'")
        check_layout(name, q, k, v)
        perm = None
        if fp8:
            q, k, v, perm = fp8_layout(q, k, v)
        _, q_len, hq, d_qk = q.shape
        kv_len, hkv, d_v = k.shape[1], k.shape[2], v.shape[3]
        _check_heads(name, hq, hkv)
        _check_no_probs(name, a)
        _check_dropout(name, a["dropout_p"])
        window = tuple(a["window_size"])
        if fp8:
            check_fp8(name, q, k, v, window)
        _check_bias(name, a["bias"], q, q_len, kv_len)
        _check_alibi(name, a["alibi_slopes"], hq)
        pattern = pattern_from_flash_args(bool(a["causal"]), window)  # type: ignore[arg-type]
        extra = dispatch.dense(a, q, k, v, pattern, a["softmax_scale"]) if dispatch else frozenset()
        _check_sink(name, a.get("sink"), hq, d_qk, d_v)
        if dispatch is not None and dispatch.last == "HipKittens":  # its own forward and backward, as upstream's
            from ._fake_hipkittens import flash_attn                # FlashAttnFunc runs them (zero-max softmax)

            return flash_attn(q, k, v, a["softmax_scale"], bool(a["causal"]), window, bool(a["return_lse"]))
        result = _fake_math.attention(
            q, k, v, window=pattern, scale=a["softmax_scale"], alibi_slopes=a["alibi_slopes"],
            bias=a["bias"], sink=a.get("sink"), dropout_p=float(a["dropout_p"]),
            return_lse=bool(a["return_lse"]), faults=faults | extra,
        )
        return fp8_unpermute(fp8_output(result), perm) if fp8 else result

    return body


def _varlen_core(name: str, a: Args, q_key: str, *, causal: bool, window: tuple[int, int],
                 scale: Optional[float], require_same_bounds: bool, faults: Iterable[str],
                 dispatch: Optional["Dispatcher"] = None) -> Any:
    q, k, v = a[q_key], a["k" if q_key == "q" else "key"], a["v" if q_key == "q" else "value"]
    _check_dims(name, (q, k, v), 3, "thd [T, H, D]")
    hq, d_qk, hkv, d_v = q.shape[1], q.shape[2], k.shape[1], v.shape[2]
    _check_heads(name, hq, hkv)
    _check_dropout(name, a["dropout_p"])
    bq = check_cu_seqlens(name, "q", a["cu_seqlens_q"], a["max_seqlen_q"], q.shape[0], q.device)
    bk = check_cu_seqlens(name, "k", a["cu_seqlens_k"], a["max_seqlen_k"], k.shape[0], q.device)
    if len(bq) != len(bk):
        raise ValueError(f"{name}: cu_seqlens_q and cu_seqlens_k describe different batch sizes")
    if require_same_bounds and bq != bk:
        raise ValueError(f"{name}: causal=True needs identical q and kv boundaries, got {bq} vs {bk}")
    _check_alibi(name, a["alibi_slopes"], hq)
    pattern = pattern_from_flash_args(causal, window)
    extra = dispatch.varlen(a, q, k, v, pattern, scale, bq, bk) if dispatch else frozenset()
    if dispatch is not None and dispatch.last == "FlyDSL":  # its kernel reads q, k, v at fixed strides
        q, k, v = fixed_strides(q), fixed_strides(k), fixed_strides(v)
    sink = a.get("sink")
    _check_sink(name, sink, hq, d_qk, d_v)
    if (sink is not None and dispatch is not None and dispatch.last == "FlyDSL"
            and not _uniform_shape(len(bq) - 1, a["max_seqlen_q"], q.shape[0], a["max_seqlen_k"], k.shape[0])):
        # FlyDSL's varlen backward computes dsink only where documents * max_seqlen is the token
        # count (its host-only `_uniform_shape`); otherwise the sink silently gets no gradient.
        sink = sink.detach()
    # Each segment pair is one problem, its window aligned bottom-right inside the pair;
    # lse comes back as [Hq, T], the flash-attn varlen layout (AITER).
    result = _fake_math.varlen_attention(
        q, k, v, bq, bk, window=pattern, scale=scale,
        alibi_slopes=a["alibi_slopes"], sink=sink, dropout_p=float(a["dropout_p"]),
        return_lse=bool(a["return_lse"]), faults=frozenset(faults) | extra,
    )
    if a["return_lse"] and dispatch is not None and dispatch.last == "FlyDSL":
        # FlyDSL's varlen lse is [B, Hq, Sq] over its equal-length documents (Primus-Turbo
        # flash_attn_interface.py l.631-632 at a6a16cd).
        out, lse = result
        return out, lse.reshape(hq, len(bq) - 1, -1).transpose(0, 1)
    return result


def _uniform_shape(documents: int, max_q: Any, tokens_q: int, max_k: Any, tokens_k: int) -> bool:
    return documents * int(max_q) == tokens_q and documents * int(max_k) == tokens_k


def varlen_flash(name: str, *, faults: Iterable[str] = (), dispatch: Optional["Dispatcher"] = None) -> Body:
    """Body of flash_attn_varlen_func (thd); flash_attn_varlen_usp_func is `varlen_usp_flash`."""
    if name.endswith("_usp_func"):
        return varlen_usp_flash(name, faults=faults)
    faults = _fake_math.check_faults(faults)

    def body(a: Args, _classify: MaskClassifier) -> Any:
        _check_no_probs(name, a)
        if a["bias"] is not None:
            raise NotImplementedError(f"{name}: the fake does not model a varlen bias")
        return _varlen_core(name, a, "q", causal=bool(a["causal"]), window=tuple(a["window_size"]),
                            scale=a["softmax_scale"], require_same_bounds=False, faults=faults,
                            dispatch=dispatch)

    return body


def flex_varlen(name: str, *, faults: Iterable[str] = (), dispatch: Optional["Dispatcher"] = None) -> Body:
    """Body of flex_attention_varlen (thd): the flex layer's stricter varlen checks."""
    faults = _fake_math.check_faults(faults)

    def body(a: Args, _classify: MaskClassifier) -> Any:
        _check_softcap(name, a["softcap"])
        causal = bool(a["causal"])
        cu = a["cu_seqlens_q"]
        if a.get("sink") is not None and isinstance(cu, Tensor) and cu.dim() == 1:
            bounds = cu.tolist()  # the flex layer reads the boundaries on the host too
            if len({end - start for start, end in zip(bounds, bounds[1:])}) > 1:
                raise ValueError(f"{name}: a sink needs documents of equal length (flex compat layer)")
        return _varlen_core(name, a, "query", causal=causal, window=tuple(a["window_size"]),
                            scale=a["scale"], require_same_bounds=causal, faults=faults, dispatch=dispatch)

    return body


def flex_dense(name: str, layout: str, *, faults: Iterable[str] = (),
               dispatch: Optional["Dispatcher"] = None) -> Body:
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
        extra = dispatch.dense(a, q, k, v, pattern, a["scale"]) if dispatch else frozenset()
        if (dispatch is not None and dispatch.last == "HipKittens"  # the same kernels as flash_attn_func's
                and pattern == Pattern(pattern.left, 0)):
            from ._fake_hipkittens import flash_attn

            result = flash_attn(q, k, v, a["scale"], True, pattern.window, bool(a["return_lse"]))
        else:
            result = _fake_math.attention(  # flash alignment (bottom-right), as for the flash entries
                q, k, v, window=pattern, scale=a["scale"], alibi_slopes=a["alibi_slopes"], bias=a["bias"],
                sink=a["sink"], dropout_p=float(a["dropout_p"]), return_lse=bool(a["return_lse"]),
                faults=faults | extra,
            )
        out = result[0] if a["return_lse"] else result
        if layout == "bhsd":
            out = out.transpose(1, 2)
        return (out, result[1]) if a["return_lse"] else out

    return body


# ----------------------------------------------------------------------------- context parallel (usp)
# The usp entries: an all-to-all over ``ulysses_group`` turns this rank's sequence shard
# (all heads) into the whole sequence for 1/n of the heads, then a ring over ``ring_group``
# (None = the WORLD group), then the all-to-all back.  The fake models Ulysses with a ring of
# one: it gathers the sequence over the Ulysses group in group-rank order (rank r holds the
# r-th contiguous shard, as the real all-to-all assumes), runs the plain entry's body on the
# whole sequence and keeps this rank's rows.  Backward sums the whole-sequence gradients of
# every rank and keeps this rank's shard, which is what the all-to-all backward computes.
class _GatherShards(torch.autograd.Function):
    """All-gather of contiguous shards along ``dim`` over ``group`` (rank order), with autograd."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: Any) -> Tensor:  # type: ignore[override]
        import torch.distributed as dist

        ctx.dim, ctx.group, ctx.n, ctx.rank = dim, group, int(group.size()), int(group.rank())
        x = x.contiguous()
        parts = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for _ in range(ctx.n)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:  # type: ignore[override]
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)  # every rank's loss reaches every shard
        width = grad.shape[ctx.dim] // ctx.n
        return grad.narrow(ctx.dim, ctx.rank * width, width), None, None


def _usp_groups(name: str, a: Args, *, fp8: bool, varlen: bool) -> tuple[Any, int, int]:
    """``(ulysses_group, its size, this rank in it)``, after the real entries' group checks."""
    ulysses, ring = a["ulysses_group"], a["ring_group"]
    if ulysses is None:
        raise AttributeError(
            f"{name}: ulysses_group is None ('NoneType' object has no attribute 'size'); the entry "
            "all-to-alls over it, so it is required: pass the context-parallel group"
        )
    if ring is None and varlen:
        ring_size = 1  # the varlen entry takes None as no ring (flash_attn_usp_interface.py l.536-538 at a6a16cd)
    elif ring is None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"{name}: ring_group=None means the WORLD group, but torch.distributed "
                               "has no default process group")
        ring_size = dist.get_world_size()
        if ring_size > 1:
            raise RuntimeError(
                f"{name}: ring_group=None means the WORLD group: after the all-to-all over ulysses_group "
                f"the entry would run a ring over all {ring_size} ranks, mixing other ranks' tokens (and "
                "the other Ulysses ranks' heads) into this rank's attention; pass a size-1 ring group"
            )
    else:
        ring_size = int(ring.size())
    if ring_size != 1:
        why = f"{name}: ring_group has {ring_size} ranks"
        if fp8:
            raise AssertionError(f"{why}; the fp8 usp entry asserts a ring group of size 1")
        if varlen:
            raise NotImplementedError(f"{why}; the varlen usp entry is Ulysses only (a ring of size 1)")
        raise NotImplementedError(f"{why}; the fake models Ulysses with a ring of one only")
    return ulysses, int(ulysses.size()), int(ulysses.rank())


def _usp_asserts(name: str, a: Args, hq: int, hkv: int, n: int, fp8: bool = False) -> None:
    """What every usp entry asserts (raised explicitly, so ``python -O`` keeps them); the fp8 one lets
    return_attn_probs through (flash_attn_usp_interface.py l.315-360 at a6a16cd)."""
    if float(a["dropout_p"]) != 0.0:
        raise AssertionError(f"{name}: dropout_p must be 0 on the context-parallel entries, got {a['dropout_p']}")
    if a["bias"] is not None:
        raise AssertionError(f"{name}: bias must be None on the context-parallel entries")
    if a.get("return_attn_probs") and not fp8:
        raise AssertionError(f"{name}: return_attn_probs is not supported on the context-parallel entries")
    if hq % n or hkv % n:
        raise AssertionError(
            f"{name}: query heads ({hq}) and key/value heads ({hkv}) must both divide by the "
            f"ulysses_group size ({n})"
        )


def usp_flash(name: str, *, fp8: bool = False, faults: Iterable[str] = ()) -> Body:
    """Body of flash_attn_usp_func and flash_attn_fp8_usp_func (bshd, local sequence shard)."""
    local = dense_flash(name.replace("_usp", ""), fp8=fp8, faults=faults)

    def body(a: Args, classify: MaskClassifier) -> Any:
        q, k, v = a["q"], a["k"], a["v"]
        _check_dims(name, (q, k, v), 4, "bshd [B, S, H, D]")
        group, n, rank = _usp_groups(name, a, fp8=fp8, varlen=False)
        _usp_asserts(name, a, q.shape[2], k.shape[2], n, fp8)
        if n == 1:
            return local(a, classify)
        whole = dict(a, **{key: _GatherShards.apply(t, 1, group) for key, t in (("q", q), ("k", k), ("v", v))})
        result = local(whole, classify)
        s, heads = q.shape[1], q.shape[2] // n
        if a["return_lse"]:  # lse of this rank's heads over the whole sequence, as after the all-to-all
            out, lse = result
            return out[:, rank * s:(rank + 1) * s], lse[:, rank * heads:(rank + 1) * heads]
        return result[:, rank * s:(rank + 1) * s]

    return body


def varlen_usp_flash(name: str, *, faults: Iterable[str] = ()) -> Body:
    """Body of flash_attn_varlen_usp_func (thd): bf16, Ulysses only, global cu_seqlens/max_seqlen."""
    local = varlen_flash(name.replace("_usp", ""), faults=faults)

    def body(a: Args, classify: MaskClassifier) -> Any:
        q, k, v = a["q"], a["k"], a["v"]
        _check_dims(name, (q, k, v), 3, "thd [T, H, D] (this rank's token shard)")
        group, n, rank = _usp_groups(name, a, fp8=False, varlen=True)
        _usp_asserts(name, a, q.shape[1], k.shape[1], n)
        if any(t.dtype != torch.bfloat16 for t in (q, k, v)):
            raise ValueError(f"{name}: bf16 only, got {q.dtype}, {k.dtype}, {v.dtype}")
        if n == 1:
            return local(a, classify)
        whole = dict(a, **{key: _GatherShards.apply(t, 0, group) for key, t in (("q", q), ("k", k), ("v", v))})
        result = local(whole, classify)  # cu_seqlens and max_seqlen describe the whole sequence
        t, heads = q.shape[0], q.shape[1] // n
        if a["return_lse"]:  # varlen lse is [Hq, T]
            out, lse = result
            return out[rank * t:(rank + 1) * t], lse[rank * heads:(rank + 1) * heads]
        return result[rank * t:(rank + 1) * t]

    return body


__all__ = ["Args", "Body", "dense_flash", "flex_dense", "flex_varlen", "usp_flash", "varlen_flash",
           "varlen_usp_flash"]
