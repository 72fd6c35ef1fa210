"""Checks of one attention call's own inputs, the same on every backend (B34).

What a caller hands the adapter per call (tensor dtypes and ranks, ``window_size``,
packed boundaries) is honoured or refused here with the project's error, before any
kernel sees it; a kernel's own ``ValueError`` or a torch ``RuntimeError`` from deep
inside would name neither the argument nor the way out.

Packed boundaries are checked without a host sync: the value checks (start at 0,
never decrease, end at the token count, no document longer than ``max_seqlen``) are
one on-device assertion.  On CPU it fails at once and is raised as our error; on a GPU
it fails as a device-side assert carrying the same text, asynchronously.
"""

from __future__ import annotations

import weakref
import operator
from typing import Any, Callable, Optional, Tuple

import torch
from torch import Tensor

from ..attention.pattern import Pattern
from ..errors import PrimusExtError, Reason, UnsupportedInputError
from ..backends.check_op import assert_on_device, check_same_boundaries, tensor_version

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _refuse(settings: Tuple[str, ...], reason: str, alternative: str = "") -> UnsupportedInputError:
    return UnsupportedInputError(Reason(settings, reason, alternative, "B34"))


def check_heads(q: Tensor, k: Tensor, heads: int, kv_heads: int) -> None:
    """The call's query and key/value head counts are those the layer was planned for."""
    if q.shape[-2] != heads or k.shape[-2] != kv_heads:
        # Hooks are proven for the planned heads only, and sinks / slopes are per head.
        raise _refuse(("num_attention_heads", "num_query_groups"),
                      f"the call has {q.shape[-2]} query and {k.shape[-2]} key/value heads, but the layer "
                      f"was planned for {heads} and {kv_heads}.",
                      "build the layer with the head counts (per tensor-parallel rank) it is called with.")


def check_qkv(q: Any, k: Any, v: Any) -> None:
    """q, k, v are floating tensors of one dtype, one device and one rank."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise _refuse((name,), f"{name} must be a torch.Tensor, got {type(t).__name__}.")
        if t.dtype not in _FLOATS:
            raise _refuse((name,), f"{name} has dtype {t.dtype}; attention takes floating point inputs.",
                          "pass bf16 or fp16 tensors (float32 / float64 on the reference backend).")
    if not (q.dtype == k.dtype == v.dtype):
        raise _refuse(("q", "k", "v"), f"q, k and v have different dtypes ({q.dtype}, {k.dtype}, {v.dtype}); "
                      "no kernel mixes them.", "cast all three to one dtype.")
    if not (q.device == k.device == v.device):
        raise _refuse(("q", "k", "v"), f"q, k and v are on different devices ({q.device}, {k.device}, {v.device}).")
    if not (q.dim() == k.dim() == v.dim()):
        raise _refuse(("q", "k", "v"), f"q, k and v have different ranks ({q.dim()}, {k.dim()}, {v.dim()}).")
    if q.shape[-1] != k.shape[-1] or k.shape[:-1] != v.shape[:-1]:
        raise _refuse(("q", "k", "v"), f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do "
                      "not fit: q and k need one head dim, k and v one shape up to the head dim.")


def check_bias(bias: Any, q: Tensor, k: Tensor, *, kernel_shape: bool) -> None:
    """A bias is a floating tensor on q's device that broadcasts to ``[B, Hq, Sq, Skv]``; with
    ``kernel_shape`` (Primus-Turbo's kernels) exactly one ``[Sq, Skv]`` matrix in q's dtype."""
    if bias is None:
        return
    q_len, kv_len = q.shape[1], k.shape[1]
    if not isinstance(bias, Tensor) or bias.dtype not in _FLOATS or bias.device != q.device:
        got = f"{bias.dtype} on {bias.device}" if isinstance(bias, Tensor) else type(bias).__name__
        raise _refuse(("bias",), f"the bias must be a floating tensor on {q.device}, got {got}.")
    if kernel_shape:
        if tuple(bias.shape) != (q_len, kv_len) or bias.dtype != q.dtype:
            raise _refuse(("bias",), f"Primus-Turbo's kernels take one [{q_len}, {kv_len}] bias in {q.dtype}, "
                          f"got {tuple(bias.shape)} in {bias.dtype}.",
                          "pass one [Sq, Skv] bias in q's dtype, or set turbo_flex_attention_backend: reference.")
        return
    full = (q.shape[0], q.shape[2], q_len, kv_len)
    if bias.dim() > 4 or any(b not in (1, f) for b, f in zip(reversed(bias.shape), reversed(full))):
        raise _refuse(("bias",), f"the bias of shape {tuple(bias.shape)} does not broadcast to [B, Hq, Sq, Skv] "
                      f"= {list(full)}.")


def _per_head(t: Any, q: Tensor, name: str, settings: Tuple[str, ...], alternative: str = "") -> None:
    """``t`` is a floating tensor of one value per query head, on q's device."""
    heads = q.shape[-2]
    if not isinstance(t, Tensor) or t.dtype not in _FLOATS:
        got = t.dtype if isinstance(t, Tensor) else type(t).__name__
        raise _refuse(settings, f"{name} must be a floating tensor, got {got}.", alternative)
    if tuple(t.shape) != (heads,) or t.device != q.device:
        raise _refuse(settings, f"{name} must hold one value per local query head ([{heads}]) on {q.device}, got "
                      f"shape {tuple(t.shape)} on {t.device}.", alternative)


def check_sink(sink: Any, q: Tensor) -> None:
    """A sink: one floating logit per query head, on q's device."""
    _per_head(sink, q, "the sink", ("use_sink_attention", "sink"))


def check_alibi(slopes: Any, q: Tensor, *, kernel_dtype: bool) -> None:
    """ALiBi slopes: one floating value per query head, on q's device; fp32 for Primus-Turbo."""
    _per_head(slopes, q, "alibi_slopes", ("alibi_slopes",),
              f"pass torch.tensor(slopes, dtype=torch.float32, device=q.device) with {q.shape[-2]} entries.")
    if kernel_dtype and slopes.dtype != torch.float32:
        raise _refuse(("alibi_slopes",), f"Primus-Turbo's kernels take fp32 alibi_slopes, got {slopes.dtype}.",
                      "pass the slopes in float32.")


def check_kernel_alibi(pattern: Pattern, return_lse: bool, *, symmetric: bool = False,
                       lengths: Optional[Tuple[int, int]] = None) -> None:
    """ALiBi on Primus-Turbo only where its kernels compute the hook's (or the slopes') bias (B35).

    AITER's CK kernels add ``-slope * |q - kv|`` for any mask but plain causal and ``+slope * kv`` for
    plain causal; with a sink its Triton kernels add ``-slope * |q + Skv - Sq - kv|`` for every mask
    (composable_kernel ``block_position_encoding.hpp``; aiter ``_compute_alibi_block``).  So ALiBi
    ``slope * (kv - q)`` (explicit slopes mean that here, as on the reference) runs where no key lies
    right of the diagonal, the symmetric form on every mask; both with equal q and kv lengths (the
    kernels align it bottom-right, a hook top-left); the lse never (plain causal CK adds ``slope * q``).
    """
    if not symmetric and pattern.right != 0:
        raise UnsupportedInputError(Reason(
            ("alibi_slopes", "causal", "window_size"), f"alibi_slopes with a {pattern.describe()} mask, which reaches "
            "right of the diagonal: Primus-Turbo's ALiBi kernels add the symmetric -slope * |q - kv| there, the "
            "project's ALiBi (and the reference backend) slope * (kv - q).",
            "use ALiBi with a causal mask (right bound 0), a symmetric ALiBi score hook, or "
            "turbo_flex_attention_backend: reference.", "B35"))
    if lengths is not None and lengths[0] != lengths[1]:
        raise UnsupportedInputError(Reason(
            ("alibi_slopes", "turbo_flex_attention_score_mod"), f"ALiBi with q_len={lengths[0]} != kv_len={lengths[1]}: "
            "Primus-Turbo's kernels measure the distance bottom-right aligned, a hook (and the reference) top-left.",
            "use equal q and kv lengths, or turbo_flex_attention_backend: reference.", "B35"))
    if return_lse:
        raise UnsupportedInputError(Reason(
            ("alibi_slopes", "return_lse"), "return_lse with ALiBi on Primus-Turbo: the causal ALiBi kernel adds "
            "slope * kv (not slope * (kv - q)), so its lse is off by slope * q per row.",
            "call with return_lse=False, or use turbo_flex_attention_backend: reference.", "B35"))


def check_packing(declared: Optional[bool], packed_call: bool, eod_documents: bool = False) -> None:
    """A call of the kind the layer declared (``packed_sequences``): the plan checked only those
    calls' kernels, and a dense call on a layer whose documents come from EOD tokens
    (``reset_attention_mask``) would attend across them (B25, B34)."""
    if declared is None or declared is packed_call:
        return
    if packed_call:
        raise UnsupportedInputError(Reason(
            ("packed_sequences", "cu_seqlens_q"), "a packed (thd) call reached a layer declared packed_sequences: "
            "false; its packed kernels were never checked for this layer.",
            "set packed_sequences: true (or leave it out) to train packed batches.", "B34"))
    lost = (" with reset_attention_mask: its documents come from EOD tokens as cu_seqlens, and a dense call "
            "would attend across them") if eod_documents else ""
    raise UnsupportedInputError(Reason(
        ("packed_sequences", "reset_attention_mask") if eod_documents else ("packed_sequences",),
        f"a dense call reached a layer declared packed_sequences: true{lost}.",
        "convert each micro-batch with primus_ext.megatron.pack_eod_micro_batch (packed_seq_params with "
        "cu_seqlens), or set packed_sequences: false (or leave it out) for dense batches.",
        "B25" if eod_documents else "B34"))


def check_dropout(dropout_p: Any) -> float:
    """The dropout probability as a float in [0, 1)."""
    try:
        p = float(dropout_p)
    except (TypeError, ValueError, RuntimeError):
        p = float("nan")
    if not 0.0 <= p < 1.0:
        raise _refuse(("dropout_p",), f"dropout_p must be a probability in [0, 1), got {dropout_p!r}.",
                      "pass 0.0 for no dropout.")
    return p


def check_window(window_size: Any) -> Tuple[int, int]:
    """``window_size`` as two ints, each -1 (unbounded) or >= 0."""
    try:  # operator.index: integers only, so 2.5 is refused rather than truncated to 2
        left, right = (operator.index(window_size[0]), operator.index(window_size[1]))
        if len(window_size) != 2:
            raise ValueError
    except (TypeError, ValueError, IndexError, OverflowError, RuntimeError):
        raise _refuse(("window_size",), f"window_size must be a pair (left, right) of ints, got {window_size!r}.",
                      "use (-1, -1) for no window, (W, 0) for a causal sliding window.") from None
    if left < -1 or right < -1:
        raise _refuse(("window_size",), f"window_size={window_size!r}: each bound is -1 (unbounded) or >= 0.",
                      "use (-1, -1) for no window, (W, 0) for a causal sliding window.")
    return left, right


def _boundaries(name: str, cu: Any, device: torch.device) -> Tensor:
    if not isinstance(cu, Tensor):
        raise _refuse((name,), f"{name} must be a 1-D int32 tensor on the inputs' device, got {type(cu).__name__}.",
                      f"pass torch.tensor({name}, dtype=torch.int32, device=q.device).")
    if cu.dim() != 1 or cu.numel() < 2:
        raise _refuse((name,), f"{name} must be 1-D with at least two entries (0 and the token count), got "
                      f"shape {tuple(cu.shape)}.")
    if cu.dtype not in (torch.int32, torch.int64):
        raise _refuse((name,), f"{name} has dtype {cu.dtype}; document boundaries are integers.",
                      "pass int32 boundaries.")
    if cu.device != device:
        raise _refuse((name,), f"{name} is on {cu.device} but the inputs are on {device}.",
                      f"move {name} to the inputs' device.")
    return cu


def _int32(cu: Tensor) -> Tensor:
    """torch's default integer type cast for the kernels: one small on-device cast, documented.
    Done after the value check, which bounds every entry by the token count, so nothing wraps."""
    return cu.to(torch.int32) if cu.dtype == torch.int64 else cu


def _max_seqlen(name: str, value: Any, tokens: int) -> Any:
    if value is None:
        return tokens  # bounds every document, with no host read of the boundaries
    if isinstance(value, Tensor):
        if torch.compiler.is_compiling():
            raise _refuse((name,), f"{name} is a tensor; a compiled graph passes max_seqlen to the kernel op as a "
                          "Python int.", "pass an int (Megatron's PackedSeqParams holds one), or leave it None.")
        if value.numel() != 1 or value.dtype.is_floating_point:
            raise _refuse((name,), f"{name} must be a positive int, got a tensor of shape {tuple(value.shape)} "
                          f"and dtype {value.dtype}.")
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _refuse((name,), f"{name} must be a positive int, got {value!r}.",
                      "pass the longest document's length, or leave it None.")
    return value


def check_packed(q: Tensor, k: Tensor, cu_q: Any, cu_kv: Any, max_q: Any, max_kv: Any, *,
                 equal_documents: bool = False) -> Tuple[Tensor, Tensor, Any, Any]:
    """Validated ``(cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv)`` of a thd call.

    The same object comes back for q and kv when one tensor was given for both, so a
    kernel (and `turbo`'s same-boundaries check) still sees one tensor.  With
    ``equal_documents`` (``packed_equal_documents``, B36) every document must be
    ``max_seqlen`` long: ``documents * max_seqlen == tokens`` here, from the shapes, and
    the on-device check that no document is longer make that exact, without a host read.
    """
    same = cu_q is cu_kv
    if same and k.shape[0] != q.shape[0]:
        raise _refuse(("cu_seqlens_q", "cu_seqlens_kv"), f"one boundary tensor was given for q and kv, but q has "
                      f"{q.shape[0]} tokens and k {k.shape[0]}; one set of boundaries cannot end at both.",
                      "pass each side's own boundaries.")
    cu_q = _boundaries("cu_seqlens_q", cu_q, q.device)
    cu_kv = cu_q if same else _boundaries("cu_seqlens_kv", cu_kv, q.device)
    if cu_q.numel() != cu_kv.numel():
        raise _refuse(("cu_seqlens_q", "cu_seqlens_kv"), f"cu_seqlens_q has {cu_q.numel() - 1} documents and "
                      f"cu_seqlens_kv {cu_kv.numel() - 1}; q and kv need the same documents.")
    max_q = _max_seqlen("max_seqlen_q", max_q, q.shape[0])
    max_kv = _max_seqlen("max_seqlen_kv", max_kv, k.shape[0])
    if equal_documents:
        _check_equal_documents("q", cu_q, q.shape[0], max_q)
        _check_equal_documents("kv", cu_kv, k.shape[0], max_kv)
    assert_boundaries("cu_seqlens_q", cu_q, q.shape[0], max_q)
    if not same:
        assert_boundaries("cu_seqlens_kv", cu_kv, k.shape[0], max_kv)
    cu_q = _int32(cu_q)
    return cu_q, (cu_q if same else _int32(cu_kv)), max_q, max_kv


def _check_equal_documents(side: str, cu: Tensor, tokens: int, longest: Any) -> None:
    documents = cu.numel() - 1
    if isinstance(longest, Tensor):
        raise UnsupportedInputError(Reason(
            ("packed_equal_documents", f"max_seqlen_{side}"),
            f"packed_equal_documents is true, but max_seqlen_{side} is a tensor: the documents' one length "
            "cannot be checked without reading it on the host.",
            f"pass max_seqlen_{side} as an int (the length of every document).", "B36"))
    if documents * longest != tokens:
        raise UnsupportedInputError(Reason(
            ("packed_equal_documents", f"max_seqlen_{side}", f"cu_seqlens_{side}"),
            f"packed_equal_documents is true, but {documents} documents of max_seqlen_{side}={longest} tokens make "
            f"{documents * longest}, not the {tokens} tokens given: the documents are not all of one length "
            "(or max_seqlen is not it).",
            f"pack documents of one length with max_seqlen_{side} equal to it, or set packed_equal_documents: false.",
            "B36"))


_PROVEN: list = []
"""The last boundaries proven, ``(weakref, version, tokens, longest)``: every layer of a step gets
the same tensor, so the value check runs once per step, not once per layer and call."""


def assert_boundaries(name: str, cu: Tensor, tokens: int, longest: Any) -> None:
    """The values of ``cu`` (start 0, no decrease, end at ``tokens``, no document over ``longest``),
    checked on the device once per tensor.  Under ``torch.compile`` nothing is traced: the
    varlen op checks its boundaries itself when it runs (`ops.varlen_attention`)."""
    if torch.compiler.is_compiling():
        return
    if isinstance(longest, Tensor):
        _check_boundaries(name, cu, tokens, longest)
        return
    version = tensor_version(cu)
    for ref, seen, n, bound in _PROVEN:
        if ref() is cu and seen == version is not None and n == tokens and bound <= longest:
            return
    _check_boundaries(name, cu, tokens, longest)
    if version is not None:
        _PROVEN[:] = [(weakref.ref(cu), version, tokens, longest)] + _PROVEN[:1]


def _check_boundaries(name: str, cu: Tensor, tokens: int, longest: Any) -> None:
    # Lengths at full size (entry 0 set to 0): a slice of n - 1 entries would make a compiled
    # graph specialise on n == 2, one more recompile per batch shape.
    first = torch.arange(cu.numel(), device=cu.device) == 0
    lengths = torch.where(first, torch.zeros_like(cu), cu - cu.roll(1))
    ok = (cu[0] == 0) & (cu[-1] == tokens) & (lengths >= 0).all() & (lengths.max() <= longest)
    why = (f"{name} must start at 0, never decrease, end at the token count ({tokens}), and have no document "
           f"longer than max_seqlen ({longest if not isinstance(longest, Tensor) else 'the tensor given'}) (B34)")
    assert_on_device(ok, why, lambda: _refuse(
        (name, "max_seqlen_q" if name.endswith("_q") else "max_seqlen_kv"), why + ".",
        "build the boundaries as the cumulative document lengths, and max_seqlen as the longest document "
        "(or leave it None)."))


__all__ = ["assert_boundaries", "assert_on_device", "check_alibi", "check_bias", "check_dropout", "check_heads",
           "check_kernel_alibi", "check_packed", "check_packing", "check_qkv", "check_sink",
           "check_window", "tensor_version"]
