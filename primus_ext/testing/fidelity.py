"""The fidelity table: each precondition and known behaviour of real Primus-Turbo we rely on, as data.

One `Fact` per row: what upstream does (with file and line at a named commit), what the CPU
fake does about it, and what the plan and call path do (refused at build where it can be
known, routed per call, or fixed by us).  ``tests/test_fidelity.py`` holds each row with a
check of its own, and docs/fidelity.md is this table, rendered; a row without a check, or a
check without a row, fails the tests.  Upstream is AMD-AGI/Primus-Turbo at ``a6a16cd`` (PT),
ROCm/aiter at ``e4048607`` and ROCm/composable_kernel at ``fe6e4fb`` unless a row says otherwise; the
rows read again on 2026-12-02 cite aiter at ``0f3c58e6`` (v0.1.14.post1, the tag Primus-Turbo pins,
primus_turbo/common/aiter_utils.py l.18-21), Primus at ``fd1eeab`` (P) and the Primus-Turbo pull requests
merged after a6a16cd by number.
"""

from __future__ import annotations

from .fidelity_fact import Fact
from .fidelity_round3 import ROUND_THREE


_AITER = "PT primus_turbo/pytorch/kernels/attention/attention_aiter_impl.py"
_IFACE = "PT primus_turbo/pytorch/ops/attention/flash_attn_interface.py"
_IMPL = "PT primus_turbo/pytorch/kernels/attention/attention_impl.py"
_FLYDSL = "PT primus_turbo/pytorch/kernels/attention/attention_flydsl_impl.py"
_BACKEND = "PT primus_turbo/pytorch/core/backend.py"

FIDELITY: tuple[Fact, ...] = (
    Fact("aiter-can-handle", "Each AITER kernel-level op checks can_handle first and raises ValueError "
         "('cannot handle the given inputs'); the dense ops' can_handle checks only a sink's head dims and "
         "qkv_format, not the dtype (the varlen op's does), so dense fp32 reaches aiter, whose CK mha_fwd / mha_bwd "
         "raise RuntimeError ('FlashAttention only support fp16, bf16 ...'); with a sink it reaches aiter's Triton "
         "kernels. The dispatcher's own gate checks fp16/bf16: flash_attn_func finds no backend for fp32.",
         f"{_AITER} l.84-111, l.202-236, l.336-380, l.543-549; {_IMPL} l.107-110; aiter aiter/ops/mha.py l.2097, "
         "l.2421-2461, csrc/py_itfs_ck/mha_fwd_kernels.cu l.206-207, mha_bwd_kernels.cu l.43-44, "
         "py_itfs_cu/asm_mha_bwd.cu l.38-39",
         "the dense ops raise aiter's RuntimeError for fp32/fp64 (with a sink: a RuntimeError saying the fake cannot "
         "say what the Triton kernels do); flash_attn_func: ValueError 'No compatible backend'",
         "fp32/fp64 refused at build (B33)"),
    Fact("aiter-out-layout", "The dense forward allocates out in the storage order qkv_format names.",
         f"{_AITER} l.135-144", "out allocated sbhd / bhsd / bshd as asked",
         "the kernel pair passes the format inferred from q, k and v"),
    Fact("aiter-rng-sink", "With a sink the Triton forward returns rng_state = CPU int64 [seed, offset]; the "
         "Triton backward asserts a CPU int64 tensor of shape [2].", f"{_AITER} l.195, l.290-295",
         "returns and asserts the same", "the forward op hands the kernel's rng_state to the backward op"),
    Fact("aiter-undeclared-writes", "The dense backward writes dsink and dbias in place without declaring "
         "the mutation.", f"{_AITER} l.419-447", "writes them in place too",
         "both buffers are allocated inside primus_ext's own backward op"),
    Fact("aiter-sink-right-window", "The sink backward passes sliding_window=left only: a window's right bound "
         "is ignored in the gradients (aiter at e4048607 goes further: its Triton forward raises ValueError for any "
         "right bound but -1, aiter ops/triton/attention/mha.py l.108-109).", f"{_AITER} l.323",
         "fault sink_backward_ignores_right_window, on by the arch", "refused at build and per call (B33)"),
    Fact("aiter-sink-left-zero", "The sink path's Triton kernels take sliding_window = max(left, 0) and mask only "
         "when it is > 0: a left bound of 0 is no bound, forward and backward.",
         f"aiter aiter/ops/triton/attention/mha.py l.110, _triton_kernels/attention/mha.py l.195 at e4048607; "
         f"{_AITER} l.323", "fault sink_left_window_zero_unbounded, on by the arch",
         "refused at build and per call (B33)"),
    Fact("aiter-deterministic-sink", "FlashAttnFunc asserts not (deterministic and sink) on the AITER path.",
         f"{_IFACE} l.153-156", "AssertionError", "refused where AITER takes the call (B33)"),
    Fact("aiter-varlen-int32", "The varlen op's can_handle needs int32 cu_seqlens.", f"{_AITER} l.543-549",
         "ValueError for other dtypes", "int64 boundaries are checked, then cast to int32 once"),
    Fact("aiter-pad8", "The public autograd pads head dims to a multiple of 8 before the kernel-level ops.",
         f"{_IFACE} l.170-176", "the kernel-level ops refuse unpadded head dims",
         "the kernel pair pads as the public entry does"),
    Fact("aiter-v3-flags", "The backward's is_v3_atomic_fp32 comes from PRIMUS_TURBO_ATTN_V3_ATOMIC_FP32 "
         "(default '1'); how_v3_bf16_cvt is 0 at compute capability >= 9.5 (gfx950), else 1.",
         "PT primus_turbo/pytorch/ops/attention/attention_utils.py l.18-20; " + f"{_IFACE} l.162-163",
         "takes the flags as given", "the kernel pair passes them exactly as flash_attn_func chooses them"),
    Fact("layout-three-tensors", "flash_attn_func infers the layout from q, k and v strides and asserts they "
         "share one (and stride[-1] == 1).", "PT primus_turbo/pytorch/ops/attention/attention_utils.py l.28-83",
         "AssertionError", "refused per call (B34); the modules pass one layout"),
    Fact("flydsl-gate-order", "FlyDSL's gate reads the layout order (sbhd, or bshd with batch 1), not contiguity.",
         f"{_IMPL} l.147-186", "routes by the order", "the plan decides AttentionPlan.storage from the route"),
    Fact("flydsl-contiguous", "FlyDSL's wrappers assert contiguous sbhd q, k and v ('SBHD tensors must be "
         "contiguous'), with no fallback.", f"{_FLYDSL} l.37-39, l.55-58", "AssertionError",
         "modules copy to contiguous sbhd where FlyDSL runs; drop-in calls refused per call (B33)"),
    Fact("flydsl-window-64", "Windows with left bound in [0, 64) are not FlyDSL's (its backward gives NaN there).",
         f"{_IMPL} l.46-50", "routes them to AITER", "the dispatch model's FlyDSL row"),
    Fact("flydsl-gqa-group", "FlyDSL takes a GQA group that is a power of two in [8, 256] (a6a16cd; see "
         "pt509-gqa-gate for the builds after PT #509).", f"{_IMPL} l.64-71",
         "routes others to AITER", "the dispatch model's FlyDSL row"),
    Fact("flydsl-scale", "FlyDSL takes softmax_scale None or within 1e-6 (absolute) of 1/sqrt(D).",
         f"{_IMPL} _scale_ok", "the same test", "dispatch.default_scale is that test"),
    Fact("flydsl-varlen-equal", "FlyDSL varlen takes only documents of one length (a host check).",
         "PT primus_turbo/pytorch/kernels/attention/attention_flydsl_impl.py l.71-81", "routes others to AITER",
         "unknown document lengths are not assumed equal"),
    Fact("aiter-varlen-no-sink", "AITER varlen refuses a sink at can_handle.", f"{_IMPL} l.331-334",
         "no backend: ValueError 'No compatible backend'", "a packed sink refused at build unless FlyDSL takes it "
         "(equal documents declared with packed_equal_documents, B36)"),
    Fact("dispatch-order", "A user pin (code or PRIMUS_TURBO_ATTN_BACKEND) first, then autotune "
         "(PRIMUS_TURBO_AUTO_TUNE=1), then FlyDSL, then the fallbacks in order.", f"{_BACKEND} l.635-680",
         "its GlobalBackendManager and dispatcher do the same", "the plan routes with the build's selection"),
    Fact("pin-cannot-handle", "A pinned backend that cannot take a call raises ValueError ('User specified "
         "backend X cannot handle the given inputs'); no fallback.", f"{_BACKEND} l.645-660", "the same",
         "refused at build (B33)"),
    Fact("autotune-any", "Autotune keeps the fastest backend that takes a call.", f"{_BACKEND} l.662-667",
         "takes the worst of them (never kinder)", "the plan holds for every backend that takes the call"),
    Fact("autotune-cache-key", "Autotune caches the backend per key (q's shape, Hkv, dtype, causal, window, layout, "
         "sink, return_softmax; varlen: token counts and max_seqlen. Not dropout, scale, ALiBi, bias, deterministic, "
         "Dv, the kv length, contiguity or the document count) and returns a hit without can_handle; FlyDSL's and "
         "HipKittens' entries read neither dropout, ALiBi nor bias.",
         f"{_IMPL} l.283-312, l.436-454; {_BACKEND} l.550-554; {_IFACE} l.102-151",
         "a tune cache keyed so: a hit on a backend that does not take the call raises NotImplementedError rather "
         "than computing it right",
         "a backend any call of the key may cache counts as a candidate (B33); a packed layer without "
         "packed_equal_documents is refused under autotune where FlyDSL may be cached"),
    Fact("flydsl-dv", "FlyDSL's gate reads q's head dim only, and its forward allocates out like q and reads v "
         "with q's head dim.", f"{_IMPL} l.87-92; {_FLYDSL} l.51-68, l.376-398",
         "refuses to compute it (cannot reproduce the out-of-bounds read)", "refused at build and per call (B33)"),
    Fact("fp8-deterministic", "flash_attn_fp8_func (and its usp twin) accept deterministic and never pass it on.",
         f"{_IFACE} l.505-565", "drops it", "refused at build (B24-fp8)"),
    Fact("gfx942-strided", "On gfx942 AITER's v3 backward mishandles the strided bshd view of sbhd memory and "
         "corrupts gradients; upstream Primus feeds contiguous bshd there.",
         "AMD-AGI/Primus primus/backends/megatron/core/extensions/primus_turbo_local_spec.py l.159-166, l.204-206 "
         "at fd1eeab", "refuses to compute it (cannot reproduce the corruption)",
         "modules copy to contiguous bshd on gfx942; drop-in calls refused (B33)"),
    Fact("ck-alibi", "CK fmha's ALiBi: +slope*kv for plain causal, -slope*|q + max(Sk-Sq,0) - kv - max(Sq-Sk,0)| "
         "for any other mask.", "composable_kernel include/ck_tile/ops/fmha/block/block_position_encoding.hpp",
         "computes that", "a hook slope*(kv-q) runs on right-bound-0 masks only (B35)"),
    Fact("triton-alibi", "aiter's Triton attention (the sink path): -slope*|q + Sk - Sq - kv| for every mask, "
         "forward and backward.", "aiter aiter/ops/triton/_triton_kernels/attention/mha.py _compute_alibi_block; "
         "mha_onekernel_bwd.py l.249-252", "computes that (no arch modelled)",
         "not reached: ALiBi with a sink is refused on gfx942 and gfx950 (aiter-sink-alibi, B33)"),
    Fact("cp-shard-order", "The usp all-to-all concatenates the shards in rank order; Megatron's own split is "
         "load-balanced (chunks r and 2*CP-1-r).",
         "PT primus_turbo/pytorch/ops/attention/usp/attention_a2a_helper.py l.82-101; megatron-core utils.py "
         "l.1994-2034", "gathers in rank order", "context parallelism runs on primus_ext's own reordering Ulysses"),
    Fact("hipkittens-zero-max", "HipKittens' forward softmax has a fixed zero reference max, not an online one: "
         "P = exp2(s * softmax_scale * log2 e) in fp32 overflows once s * softmax_scale > ~88.7 (that row: out NaN, "
         "lse inf; a sum that alone overflows: out 0 or NaN, lse inf), and a row whose every kept logit is below "
         "~-87.3 flushes to 0 (out NaN, lse -inf).",
         "PT csrc/kernels/attention/hipkittens/hk_attn_fwd_d128_gfx950.cu l.49-56, l.845-846, l.947-965, "
         "l.1131-1140; hk_attn_fwd_d64_gfx950.cu l.764-765, l.867-885, l.1025-1034",
         "its kernel level, and flash_attn_func where its dispatcher picks HipKittens, compute those rows as the "
         "kernels do (the online softmax elsewhere)",
         "not refused: logits are not known at build; HipKittens runs only pinned (PRIMUS_TURBO_ATTN_BACKEND="
         "hipkittens) or autotuned on gfx950, and the NaN is visible (docs/capabilities.md)"),
    Fact("set-attn-backend-none", "GlobalBackendManager.set_attn_backend(None), with or without a precision, "
         "forgets every code setting (_attn_backend = None): PRIMUS_TURBO_ATTN_BACKEND applies again. reset() also "
         "clears the environment parse cache and every dispatcher's autotune cache.",
         f"{_BACKEND} l.290-306, l.381-392",
         "the same (it keeps no parse or autotune cache)",
         "kernel_selection reads the manager, so the plan sees the environment's pin again"),
) + ROUND_THREE
"""Every row; ids are unique and each has a check in tests/test_fidelity.py."""


def markdown() -> str:
    """docs/fidelity.md's table (the test compares the file with it)."""
    lines = ["| id | upstream | source | the fake | the plan / call path |", "|---|---|---|---|---|"]
    lines += [f"| `{f.id}` | {f.fact} | {f.source} | {f.fake} | {f.plan} |" for f in FIDELITY]
    return "\n".join(lines) + "\n"


__all__ = ["FIDELITY", "Fact", "markdown"]
