"""The rows of the dispatch model (`primus_ext.backends.dispatch`): one `KernelBackend` per Primus-Turbo
kernel backend, with when it takes a call, what it then refuses and what it computes wrongly.

Each row cites its upstream source (Primus-Turbo at a6a16cd, files under
``primus_turbo/pytorch/kernels/attention/``; aiter at v0.1.14.post1, the tag Primus-Turbo pins);
what changed in later builds reads `CallFeatures.build` (`primus_ext.backends.turbo_build`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from .turbo_build import BUILD_A6A16CD, TurboBuild

DENSE, VARLEN = "dense", "varlen"
_DTYPE = ("bf16", "fp16", "params_dtype")

@dataclass(frozen=True)
class CallFeatures:
    """What decides the kernel backend of one ``flash_attn_*`` call."""

    arch: str
    entry: str  # DENSE (flash_attn_func) or VARLEN (flash_attn_varlen_func)
    dtype: str  # "bf16", "fp16", "fp32", "fp64"
    head_dim: int
    head_dim_v: int
    heads: int
    kv_heads: int
    causal: bool = True
    window: Tuple[int, int] = (-1, -1)
    sink: bool = False
    dropout: float = 0.0
    bias: bool = False
    alibi: bool = False
    deterministic: bool = False
    default_scale: bool = True
    equal_documents: Optional[bool] = None
    """Varlen: every document has the same length (None: not known, so not assumed)."""
    sbhd_storage: bool = True
    """Dense: q/k/v are sbhd in memory (Megatron's layout), or bshd with batch 1: the order
    upstream's `infer_qkv_format` reads from the strides, contiguous or not."""
    contiguous_sbhd: bool = True
    """Dense: q, k and v are each contiguous in sbhd order (a split view of a fused QKV,
    megatron-core's key and value, is not)."""
    contiguous_bshd: bool = True
    """Dense: q, k and v are each contiguous as bshd (not the strided view of sbhd memory)."""
    q_within_kv: bool = True
    """Dense: the query is no longer than the key/value sequence (``Sq <= Skv``)."""
    contiguous_thd: bool = True
    """Varlen: q, k and v are each contiguous ``[T, H, D]`` (FlyDSL's varlen kernel addresses tokens at
    fixed strides, whatever the tensors' own)."""
    needs_backward: bool = True
    """The call's output takes a gradient (every training call): PT #469's Gluon is forward-only."""
    build: TurboBuild = BUILD_A6A16CD
    """The Primus-Turbo build whose gates apply (`primus_ext.backends.turbo_build`)."""

    @property
    def group(self) -> int:
        return self.heads // max(self.kv_heads, 1)


@dataclass(frozen=True)
class Check:
    """One condition of a row: ``ok(features)``, the words when it does not hold, the user
    settings that decide it and what to do instead."""

    ok: Callable[[CallFeatures], bool]
    text: str
    settings: Tuple[str, ...] = ()
    alternative: str = ""
    raises: Tuple[str, str] = ("ValueError", "")
    """How upstream fails a call this refusal row stops: the exception type (``ValueError`` or
    ``AssertionError``) and upstream's message; the CPU fake raises the same."""


@dataclass(frozen=True)
class KernelBackend:
    """A kernel backend: when it takes a call, what it then refuses, what it gets wrong."""

    name: str
    entries: Tuple[str, ...]
    takes: Tuple[Check, ...]
    refuses: Tuple[Check, ...] = ()
    defects: Tuple[Check, ...] = ()
    fact: str = ""
    since: str = ""
    """The `TurboBuild` flag of the change that added the backend ("" : every build has it)."""
    autotune: bool = True
    """Whether autotune may time and keep it (upstream's ``BackendEntry(autotune=...)``)."""


def registered(backend: KernelBackend, build: TurboBuild) -> bool:
    """Whether ``build``'s dispatcher has ``backend`` at all."""
    return not backend.since or bool(getattr(build, backend.since))


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def flydsl_group_ok(heads: int, kv_heads: int, head_dim: int, build: TurboBuild) -> bool:
    """Upstream's ``_gqa_group_ok``: a power-of-two group G = Hq / Hkv in 8..256 (a6a16cd,
    attention_impl.py l.64-71), or since PT #509 in 1..256 with ``Hq * D % 128 == 0``."""
    if kv_heads <= 0 or heads % kv_heads:
        return False
    g = heads // kv_heads
    if build.wide_gqa:
        return 1 <= g <= 256 and _pow2(g) and (heads * head_dim) % 128 == 0
    return 8 <= g <= 256 and _pow2(g)


def _flydsl_window(f: CallFeatures) -> bool:
    left, right = f.window
    return right in (0, -1) and (left == -1 or left >= 64)


# _check_fwd/_check_bwd check no contiguity for varlen, and the kernel reads q at token stride Hq*D and
# k, v at Hkv*D (attention_flydsl_impl.py l.34-68, flydsl/attention/flash_attn_fwd.py l.708-746 at a6a16cd).
FLYDSL_VARLEN_STRIDES = Check(
    lambda f: f.entry != VARLEN or f.contiguous_thd,
    "FlyDSL's varlen kernel reads q at a token stride of Hq*D and k, v at Hkv*D whatever their strides, so a "
    "non-contiguous THD q, k or v (megatron-core's value is a split view of the fused projection) is read at "
    "the wrong addresses, silently", (),
    "make q, k and v contiguous [T, H, D] before the call (the Megatron modules do so on gfx950 wherever "
    "FlyDSL's varlen kernel can take the layer's calls)")
FLYDSL = KernelBackend(
    "FlyDSL", (DENSE, VARLEN),
    takes=(
        Check(lambda f: f.arch == "gfx950", "FlyDSL runs only on gfx950"),
        Check(lambda f: f.dtype == "bf16", "FlyDSL takes bf16 only", _DTYPE, "train in bf16"),
        Check(lambda f: f.causal, "FlyDSL takes causal attention only"),
        # _flydsl_common_ok reads q's head dim only (attention_impl.py l.87-92 at a6a16cd).
        Check(lambda f: f.head_dim in (64, 128), "FlyDSL takes head dim 64 or 128"),
        Check(_flydsl_window, "FlyDSL takes a window only with right bound 0 and left bound >= 64"),
        Check(lambda f: f.default_scale, "FlyDSL takes only the default softmax scale 1/sqrt(D)"),
        Check(lambda f: f.dropout == 0, "FlyDSL takes no dropout"),
        Check(lambda f: not f.bias and not f.alibi, "FlyDSL takes no bias or ALiBi"),
        Check(lambda f: f.build.wide_gqa or flydsl_group_ok(f.heads, f.kv_heads, f.head_dim, f.build),
              "FlyDSL needs a GQA group (query heads per key/value head) that is a power of two in 8..256",
              ("num_attention_heads", "num_query_groups"), "use 8 to 256 query heads per key/value group"),
        Check(lambda f: not f.build.wide_gqa or flydsl_group_ok(f.heads, f.kv_heads, f.head_dim, f.build),
              "FlyDSL (PT #509) needs a GQA group (query heads per key/value head) that is a power of two in 1..256, "
              "with query heads x head dim a multiple of 128", ("num_attention_heads", "num_query_groups", "kv_channels"),
              "use a power-of-two number of query heads per key/value group, with heads x head dim a multiple of 128"),
        Check(lambda f: f.entry != DENSE or f.sbhd_storage, "FlyDSL dense needs sbhd storage (or batch 1)"),
        Check(lambda f: f.entry != VARLEN or f.equal_documents is True,
              "FlyDSL varlen needs every document of the same length", ("packed_sequences", "packed_equal_documents"),
              "pack documents of equal length and say so with packed_equal_documents: true"),
    ),
    # The gate reads the layout order only; the kernel wrapper then asserts contiguity, with
    # no fallback (attention_impl.py l.147-186, attention_flydsl_impl.py l.37-39, 55-58 at a6a16cd).
    refuses=(
        Check(lambda f: f.entry != DENSE or f.contiguous_sbhd,
              "FlyDSL asserts that q, k and v are contiguous sbhd (\"SBHD tensors must be contiguous\"), and a "
              "split view of a fused QKV is not", (),
              "make q, k and v contiguous in [S, B, H, D] order before the call (the Megatron modules do so on "
              "gfx950 when FlyDSL takes the layer's calls)",
              raises=("AssertionError", "SBHD tensors must be contiguous")),
    ),
    # Its forward allocates out like q and reads v with q's head dim (attention_flydsl_impl.py l.51-68,
    # l.376-398 at a6a16cd): a value head dim of its own is read out of bounds.
    defects=(
        Check(lambda f: f.head_dim_v == f.head_dim,
              "FlyDSL takes the value head dim to be q's (its output is allocated like q), so a value head dim of "
              "its own is read out of bounds", ("kv_channels",),
              "use one head dim for q, k and v, or turbo_flex_attention_backend: reference"),
        FLYDSL_VARLEN_STRIDES,
    ),
    fact="attention_impl.py l.53-100 (gates), l.147-186 (dense), l.320-326, l.375-394 (varlen) at a6a16cd; "
         "docs/fidelity.md, facts `flydsl-gate-order`, `flydsl-contiguous`",
)
AITER_SINK_RIGHT_WINDOW = Check(
    lambda f: not (f.sink and f.window[1] > 0),
    "AITER's sink backward ignores a window's right bound: the gradients would be silently wrong",
    ("use_sink_attention", "window_size", "turbo_flex_attention_mask_mod"),
    "use a window with right bound 0, or use_sink_attention: false")
# aiter's Triton forward (the sink path) sets sliding_window = max(left, 0) and masks only when it is > 0,
# and its backward gets the same (aiter ops/triton/attention/mha.py l.110, _triton_kernels/attention/mha.py
# l.195 at e4048607; Primus-Turbo attention_aiter_impl.py l.323 at a6a16cd): a left bound of 0 is none.
AITER_SINK_LEFT_ZERO = Check(
    lambda f: not (f.sink and f.window[0] == 0),
    "AITER's sink path (Triton kernels) takes a left window bound of 0 as no bound: the layer would attend "
    "further left than asked", ("use_sink_attention", "window_size", "turbo_flex_attention_mask_mod"),
    "use a left window bound of at least 1, or use_sink_attention: false")
# docs/fidelity.md, fact `gfx942-strided`: upstream Primus feeds contiguous bshd on gfx942 only, for this.
AITER_GFX942_STRIDED = Check(
    lambda f: f.arch != "gfx942" or f.contiguous_bshd,
    "on gfx942 AITER's v3 backward mishandles strided q/k/v (the bshd view of sbhd memory) and corrupts the "
    "gradients", (),
    "make q, k and v contiguous bshd before the call (the Megatron modules do so on gfx942)")
# aiter at v0.1.14.post1 (0f3c58e6), the tag Primus-Turbo pins (primus_turbo/common/aiter_utils.py l.18-21).
AITER_SINK_BIAS = Check(
    lambda f: not (f.sink and f.bias),
    "AITER's sink path (aiter's Triton forward) raises ValueError for any bias (aiter ops/triton/attention/mha.py "
    "l.78-79)", ("use_sink_attention",), "drop the bias, or set use_sink_attention: false")
AITER_SINK_ALIBI = Check(
    lambda f: not (f.sink and f.alibi),
    "AITER's sink path (aiter's Triton kernels) reads ALiBi slopes as [B, H] (alibi_slopes.stride(1), aiter "
    "ops/triton/attention/mha.py l.275-276) while Primus-Turbo passes them as given, so [H] slopes raise IndexError; "
    "and whether its ALiBi bias is the hook's is not established", ("use_sink_attention", "turbo_flex_attention_score_mod"),
    "drop the ALiBi score hook or the sink, or set turbo_flex_attention_backend: reference",
    raises=("IndexError", "tuple index out of range"))
AITER_CK_BIAS_ALIBI = Check(
    lambda f: f.sink or not (f.bias and f.alibi),
    "aiter's CK forward rejects a bias and ALiBi together (csrc/py_itfs_ck/mha_fwd_kernels.cu l.275)", (),
    "pass either a bias or ALiBi slopes, not both", raises=("RuntimeError", "cannot apply bias and alibi at the same time"))
AITER_CK_HEAD_DIMS = Check(
    # Primus-Turbo pads q/k and v head dims up to a multiple of 8 before aiter sees them
    # (flash_attn_interface.py, AiterFlashAttnFunc and AiterFlashAttnVarlenFunc at a6a16cd): only the bound binds.
    lambda f: f.sink or all(-(-d // 8) * 8 <= 256 for d in (f.head_dim, f.head_dim_v)),
    "aiter's CK kernels take head dims of at most 256 that are multiples of 8, forward and backward "
    "(mha_fwd_kernels.cu l.247-251, mha_bwd_kernels.cu l.74-75, asm_mha_bwd.cu l.70-71), and Primus-Turbo pads "
    "each head dim up to a multiple of 8 first, so head dims above 256 (after that padding) are refused",
    ("kv_channels",),
    "choose kv_channels (and the value head dim) of at most 256, or set turbo_flex_attention_backend: reference", raises=("RuntimeError", "CK FlashAttention only supports head dimension "
                                                       "at most 256 and a multiple of 8"))
AITER_DENSE = KernelBackend(
    "AITER", (DENSE,),
    takes=(Check(lambda f: f.dtype in ("bf16", "fp16"), "AITER takes fp16 or bf16 only", _DTYPE,
                 "train in bf16 (bf16: true) or fp16, or set use_turbo_flex_attention: true with "
                 "turbo_flex_attention_backend: reference"),),
    refuses=(
        Check(lambda f: not f.sink or (f.head_dim == f.head_dim_v and _pow2(f.head_dim)),
              "AITER's sink kernel needs equal q/k and v head dims and a power-of-two head dim",
              ("use_sink_attention", "kv_channels"), "choose kv_channels as a power of two"),
        Check(lambda f: not (f.sink and f.deterministic),
              "AITER asserts that deterministic and sink are not enabled together",
              ("deterministic_mode", "use_sink_attention"),
              "set deterministic_mode: false or use_sink_attention: false (on gfx950, FlyDSL takes both "
              "when its other conditions hold)",
              raises=("AssertionError", "deterministic and sink cannot be enabled together currently")),
        AITER_SINK_BIAS, AITER_SINK_ALIBI, AITER_CK_BIAS_ALIBI, AITER_CK_HEAD_DIMS,
    ),
    defects=(AITER_SINK_RIGHT_WINDOW, AITER_SINK_LEFT_ZERO, AITER_GFX942_STRIDED),
    fact="attention_impl.py l.107-110, attention_aiter_impl.py l.102-106 at a6a16cd; docs/fidelity.md, facts "
         "`aiter-deterministic-sink`, `aiter-sink-right-window`, `gfx942-strided`",
)
AITER_VARLEN = KernelBackend(
    "AITER", (VARLEN,),
    takes=(
        Check(lambda f: f.dtype in ("bf16", "fp16"), "AITER takes fp16 or bf16 only", _DTYPE,
              "train in bf16 (bf16: true) or fp16"),
        Check(lambda f: not f.sink, "AITER varlen takes no sink", ("use_sink_attention", "packed_sequences"),
              "drop the sink for packed batches, or on gfx950 pack documents of equal length "
              "(packed_equal_documents: true) with 8 to 256 query heads per key/value group in bf16 (FlyDSL)"),
    ),
    refuses=(AITER_CK_BIAS_ALIBI, AITER_CK_HEAD_DIMS),
    fact="attention_impl.py l.329-334 at a6a16cd; docs/fidelity.md, fact `aiter-varlen-no-sink`",
)
HIPKITTENS = KernelBackend(
    "HipKittens", (DENSE,),
    takes=(
        Check(lambda f: f.arch == "gfx950", "HipKittens runs only on gfx950"),
        Check(lambda f: f.dtype == "bf16", "HipKittens takes bf16 only"),
        Check(lambda f: f.causal and not f.sink, "HipKittens takes causal attention without a sink only"),
        Check(lambda f: f.dropout == 0 and not f.bias and not f.alibi, "HipKittens takes no dropout, bias or ALiBi"),
        Check(lambda f: f.window[1] in (0, -1) and f.head_dim in (64, 128), "HipKittens: right bound 0, D 64/128"),
        Check(lambda f: f.entry == DENSE and f.sbhd_storage and f.contiguous_sbhd,
              "HipKittens needs contiguous sbhd q, k and v"),
        # hipkittens_attn_supported: v shaped as k, and Sq <= Skv (its forward skips rows otherwise).
        Check(lambda f: f.head_dim_v == f.head_dim and f.q_within_kv,
              "HipKittens needs v shaped as k and a query no longer than the keys (Sq <= Skv)"),
    ),
    fact="attention_impl.py l.212-250; hipkittens_attn_supported (primus_turbo/hipkittens/attention/attention.py "
         "l.124-182) at a6a16cd",
)
GLUON = KernelBackend(
    "Gluon", (DENSE,), since="gluon", autotune=False,
    takes=(
        Check(lambda f: f.arch == "gfx950", "Gluon runs only on gfx950"),
        Check(lambda f: not f.needs_backward, "Gluon is forward-only (flash_attn_func passes needs_backward), and a "
              "training call needs a backward"),
        Check(lambda f: f.dtype in ("bf16", "fp16"), "Gluon takes fp16 or bf16 only"),
        Check(lambda f: not (f.sink or f.bias or f.alibi or f.dropout) and f.window == (-1, -1),
              "Gluon takes no sink, bias, ALiBi, dropout or window"),
        Check(lambda f: f.head_dim == f.head_dim_v and f.head_dim <= 256 and (not f.causal or f.q_within_kv),
              "Gluon needs v shaped as k, a head dim of at most 256 and, causal, Sq <= Skv"),
        Check(lambda f: f.contiguous_bshd, "Gluon needs contiguous bshd (or bhsd) q, k and v"),
    ),
    fact="PT #469 (DenseAttnFwdGluonBackend.can_handle; BackendEntry(autotune=False)); docs/fidelity.md, "
         "fact `pt469-gluon`",
)
ORDER = {DENSE: (FLYDSL, AITER_DENSE, HIPKITTENS, GLUON), VARLEN: (FLYDSL, AITER_VARLEN)}
"""The dispatcher's order: FlyDSL (the default), then the fallbacks (docs/fidelity.md, fact `dispatch-order`);
a backend a build lacks (`registered`) is not there."""



__all__ = ["AITER_CK_BIAS_ALIBI", "AITER_CK_HEAD_DIMS", "AITER_DENSE", "AITER_GFX942_STRIDED", "AITER_SINK_ALIBI",
           "AITER_SINK_BIAS", "AITER_SINK_LEFT_ZERO", "AITER_SINK_RIGHT_WINDOW", "AITER_VARLEN", "CallFeatures", "Check",
           "DENSE", "FLYDSL", "FLYDSL_VARLEN_STRIDES", "GLUON", "HIPKITTENS", "KernelBackend", "ORDER", "VARLEN",
           "flydsl_group_ok", "registered"]
