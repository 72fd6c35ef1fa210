"""The fidelity rows read again on 2026-12-02: the newest stored Primus-Turbo, aiter at the tag it pins,
Primus, and the Primus-Turbo pull requests merged after a6a16cd (`primus_ext.testing.fidelity` holds the
whole table; each row has a check in tests/fidelity_round3_checks.py)."""

from __future__ import annotations

from .fidelity_fact import Fact

_PT = "PT primus_turbo/pytorch"
_IMPL = f"{_PT}/kernels/attention/attention_impl.py"
_FLYDSL = f"{_PT}/kernels/attention/attention_flydsl_impl.py"
_AITER = "aiter@0f3c58e6"

ROUND_THREE: tuple[Fact, ...] = (
    Fact("aiter-pinned-tag", "Primus-Turbo requires aiter v0.1.14.post1, aiter@0f3c58e6 (2026-06-05): kernel facts "
         "are read there, not at aiter main.", "PT primus_turbo/common/aiter_utils.py l.18-21",
         "its AITER rows cite that tag", "the dispatch model's AITER rows cite that tag"),
    Fact("flydsl-varlen-strides", "FlyDSL's varlen wrappers check no contiguity, and the kernel reads q at a token "
         "stride of Hq*D and k, v at Hkv*D (heads D apart), whatever the tensors' own strides: a split view is "
         "read at the wrong addresses, with no error.",
         f"{_FLYDSL} l.34-68, l.148-181, l.328-364; PT primus_turbo/flydsl/attention/flash_attn_fwd.py "
         "l.708-746; PT primus_turbo/flydsl/utils/attn_helper.py l.465-466, l.695-705, l.1159-1171",
         "its FlyDSL varlen reads q, k and v at those fixed strides (entries and kernel level)",
         "packed q/k/v stored contiguous on gfx950 wherever FlyDSL varlen can take a call (contiguous-thd); the "
         "compiled pair copies too; a strided drop-in call FlyDSL could take refused (B33)"),
    Fact("flydsl-varlen-runtime", "The varlen dispatcher takes FlyDSL from each call's boundaries: any batch whose "
         "documents are all equal, a single document included.", f"{_IMPL} l.320-326, l.390-394",
         "routes from the host boundaries of each call",
         "varlen calls not promised equal documents are routed both ways ('... with equal documents'); the "
         "self-test runs one-document batches too"),
    Fact("aiter-sink-bias", "aiter's Triton forward (AITER's sink path) raises ValueError for any bias.",
         f"{_AITER} aiter/ops/triton/attention/mha.py l.78-79", "ValueError",
         "refused at build and per call (B33)"),
    Fact("aiter-sink-alibi", "aiter's Triton forward reads alibi_slopes.stride(1) and its one-kernel backward "
         "unpacks two strides: [H] slopes raise IndexError; Primus-Turbo passes the slopes unchanged, and its tests "
         "never pass ALiBi.", f"{_AITER} aiter/ops/triton/attention/mha.py l.275-276, mha_onekernel_bwd.py "
         "l.111-112; PT primus_turbo/pytorch/kernels/attention/attention_aiter_impl.py l.176-194",
         "IndexError where the dispatcher routes such a call",
         "ALiBi with a learned sink refused on both archs (B33) until the [B, H] path is read and modelled"),
    Fact("aiter-sink-1d", "aiter's Triton forward asserts the sink is 1-D with one entry per query head; Primus's "
         "TP > 1 sinks reach it only after FlyDSL's _sink_ok refused them.",
         f"{_AITER} aiter/ops/triton/attention/mha.py l.139-141; P primus/backends/megatron/core/extensions/"
         f"primus_turbo.py l.809, l.881, l.932; {_IMPL} l.58-61",
         "asserts a sink of Hq entries", "each rank passes its own heads' slice of the sink, fp32 [Hq]"),
    Fact("ck-bias-alibi", "aiter's CK forward rejects a bias and ALiBi together; it takes a bias of exactly "
         "[Sq, Sk] and ALiBi [H] or [B, H].", f"{_AITER} csrc/py_itfs_ck/mha_fwd_kernels.cu l.80-94, l.275",
         "RuntimeError", "refused at build and per call (B33)"),
    Fact("ck-head-dims", "aiter's CK forward takes head dims of at most 256 that are multiples of 8 (and "
         "Hq % Hkv == 0); the CK and asm backwards cap head dims at 256 too; Primus-Turbo pads each head dim "
         "up to a multiple of 8 before aiter sees it.",
         f"{_AITER} csrc/py_itfs_ck/mha_fwd_kernels.cu l.247-251, mha_bwd_kernels.cu l.74-75, "
         f"py_itfs_cu/asm_mha_bwd.cu l.70-71; {_PT}/ops/attention/flash_attn_interface.py (AiterFlashAttnFunc, "
         "AiterFlashAttnVarlenFunc: the pad to a multiple of 8)",
         "RuntimeError where AITER's CK path takes a head dim above 256 (after the padding); 12 runs as 16",
         "head dims above 256 refused at build and per call (B33), or run on turbo_flex_attention_backend: "
         "reference"),
    Fact("fp8-bf16-output", "The fp8 Triton attention returns bf16 whatever the input dtype, and its backward "
         "asserts a bf16 do.", f"{_PT}/kernels/attention/attention_triton_impl.py l.89-95; "
         f"{_PT}/ops/attention/flash_attn_interface.py l.415", "returns bf16",
         "fp8 on a layer that computes in another dtype refused at build (fp8-dtype)"),
    Fact("fp8-head-dims", "The fp8 backward asserts head dims >= 32 and even, and the kernel contiguous inputs; "
         "the fp8 wrapper permutes sbhd and bhsd memory contiguous and its kernel reads the copy as bshd, so "
         "the batch (or the heads) takes the sequence's place: another attention, silently.",
         f"{_PT}/kernels/attention/attention_triton_impl.py l.74-78, l.350-351, l.385-393; "
         f"{_PT}/ops/attention/flash_attn_interface.py l.505-565",
         "AssertionError for head dims (in its forward, where the call starts) and for strided bshd-ordered "
         "inputs; the wrong attention for sbhd and bhsd memory, as upstream",
         "refused at build (fp8-head-dim); the direct fp8 path stores q/k/v contiguous bshd, the one layout "
         "the wrapper leaves as it is"),
    Fact("autotune-profile", "Profiling swallows a backend's exception and skips it; autotune is skipped while a "
         "CUDA graph is captured.", "PT primus_turbo/pytorch/core/backend.py l.498-507, l.561-566, l.606, l.661",
         "times the backends that take the call and caches the fastest that does not raise while timed; "
         "with none left, nothing is cached and the default order runs",
         "the plan holds for every backend that takes a call: one skipped while timed only narrows them"),
    Fact("usp-varlen-ring", "The varlen usp entry takes ring_group=None as no ring and raises NotImplementedError "
         "only for a ring of more than one rank; the fp8 usp entry asserts no dropout and allows "
         "return_attn_probs.", f"{_PT}/ops/attention/flash_attn_usp_interface.py l.315-360, l.536-538",
         "the same", "packed batches with CP > 1 refused (cp-packed); fp8 with CP > 1 refused (cp-fp8)"),
    Fact("primus-condition-raises", "Primus's patch runner evaluates every patch's applies_to (condition "
         "included) before any handler, outside its try; a raising condition ends the run as RuntimeError("
         "'Training execution failed: ...').", "P primus/core/patches/patch_runner.py l.100-105; "
         "P primus/core/runtime/train_runtime.py l.95-116",
         "its runner does the same (testing.fake_primus)",
         "the patch's condition raises our error on purpose, before any handler runs: Primus ends the run with "
         "its message"),
    Fact("primus-megatron-version", "Primus's bundled Megatron-LM (d3528a21) reports 0.16.0rc0, which Primus's "
         "adapter reads by parsing package_info.py; core_attention is called directly there too.",
         "P primus/backends/megatron/megatron_adapter.py l.143-165; Megatron-LM@d3528a21 "
         "megatron/core/transformer/attention.py l.321-329", "reads the version from package_info.py alike",
         "the modules take core_attention's call as megatron-core 0.16 makes it"),
    Fact("pt509-gqa-gate", "After a6a16cd, PT #509 widens _gqa_group_ok to a power of two in [1, 256] with "
         "Hq*D % 128 == 0 (its signature gains head_dim).", "PT #509 (attention_impl.py _gqa_group_ok)",
         "kernels='pt509' has the wide gate and the three-argument _gqa_group_ok",
         "the build is read by that signature; MHA and 32/8 layers route to FlyDSL on it, contiguous sbhd"),
    Fact("pt480-deterministic", "PT #480 gives both FlyDSL backward _impls deterministic=False (True: a "
         "reproducible split-K dQ; False: atomic bf16), and flash_attn_func / flash_attn_varlen_func pass "
         "ctx.deterministic.", "PT #480 (attention_flydsl_impl.py, flash_attn_interface.py)",
         "kernels='pt509' has the argument and records what it is given",
         "the compiled FlyDSL pair passes the call's deterministic where the backward takes it"),
    Fact("pt469-gluon", "PT #469 adds the opt-in, forward-only Gluon dense backend (BackendType.GLUON, "
         "autotune=False) after HipKittens; PT #481 a gfx1250-only Triton dense backend; flash_attn_func passes "
         "needs_backward.", "PT #469, #481 (attention_impl.py _DENSE_FWD_BACKENDS)",
         "kernels='pt509' has BackendType.GLUON",
         "Gluon is modelled (pinned only; a training call needs a backward: refused, B33); #481 takes no "
         "gfx942/gfx950 call"),
    Fact("primus-1033-owner", "Primus PR #1033 (open) adds Primus's own use_turbo_flex_attention and hook keys, "
         "routing PrimusTurboAttention through Primus-Turbo's flex entries and refusing CP > 1, fp8, "
         "reset_attention_mask, a right window bound > 0 and a mask hook with a window.",
         "AMD-AGI/Primus@1c296eb2 primus/backends/megatron/core/extensions/turbo_flex_attention.py",
         "fake_primus can stand in for a Primus that has the file",
         "turbo_flex_attention_owner decides which of the two runs (primus-owner, owner)"),
)


__all__ = ["ROUND_THREE"]
