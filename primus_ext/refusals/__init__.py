"""The catalogue of call-time refusals: every way one attention call is refused.

Build-time rules are a table too (`primus_ext.plan.rules.RULES`), evaluated together when a
layer is built.  A call is refused for what only the call shows (a tensor's dtype, the
boundaries passed, a flag the plan did not approve), so these are raised one at a time, but
from one place: each is a `Refusal` here, with its code, the settings and arguments it
names, its one wording and the alternative; a raise site only fills in the values
(``raise refuse(RULE, got=...)``).  ``err.codes`` always holds the rule's code, and
docs/refusals.md lists every code (``tests/test_docs.py`` holds both ways).

Codes are a behaviour number (docs/behaviours.md) where one wording covers it, else the
number with a dotted name (``B34.dtype``): B34, "every input honoured or refused", has many
causes, each with its own wording.
"""

from __future__ import annotations

from .catalogue import (BUILD_REFUSALS, CALL_RULES, CompiledCallRefusal, Refusal, build_rule, on_ranks, refuse,
                        refuse_all, refuse_build, refuse_compiled, refuse_naming, refuse_option, rule)
from .build import *  # noqa: F401,F403 - the catalogue is one namespace
from .build import __all__ as _BUILD
from .megatron_calls import *  # noqa: F401,F403
from .megatron_calls import __all__ as _MEGATRON_CALLS

# -- the flash-attn-compatible entries (`primus_ext.call.entries`) --------------------------
ATTN_PROBS = rule("B26", ("return_attn_probs",), "attention probabilities are never materialised (B26).",
                  "call with return_attn_probs=False.")
HOOK_ASSUMPTION = rule(
    "B31.assumption", ("turbo_flex_attention_mask_mod", "turbo_flex_attention_score_mod"),
    "the hook {hooks} was proven equal to a fixed kernel's attention while {what}; that no longer holds, so the "
    "proof does not either (B31).",
    "keep the values a hook reads constant, or set turbo_flex_attention_backend: reference, which evaluates the "
    "hook at every call.")
HOOK_CHANGED = rule(
    "B34.hook-changed", ("turbo_flex_attention_mask_mod", "turbo_flex_attention_score_mod"),
    "what the hook {hooks} reads changed between this call's forward and its backward: the backward evaluates the "
    "hook again, so the gradient would be that of another attention than the forward computed.",
    "change what a hook reads only after the backward of every call that used it (write the next micro-batch's "
    "values into another tensor, or after the optimizer step).")
MASK_LENGTH = rule(
    "B34.mask-length", ("turbo_flex_attention_mask_mod",),
    "the document mask covers {covered} tokens but the sequence has {length}.",
    "build the mask for the training sequence length.")
BACKEND_LACKS = rule(
    "B34.backend-lacks", ("{what}",),
    "{what} was passed, and the {backend} backend declares that its fixed kernels take none: it would be dropped.",
    "drop {what}, or use a backend whose kernels take it (turbo_flex_attention_backend: reference computes it).")
UNEQUAL_LENGTHS = rule(
    "B34.unequal-lengths", (),  # named at the call: the hook's setting, or the call's flags
    "a {mask} mask with q_len={q_len} != kv_len={kv_len} is ambiguous on Turbo's fixed kernels (flash aligns it "
    "bottom-right, a mask_mod top-left).",
    "use equal lengths, or turbo_flex_attention_backend: reference.")
UNPLANNED_SINK = rule(
    "B34.unplanned-sink", ("use_sink_attention",),
    "a sink tensor was passed but the plan has no sink; it would change the softmax the config asked for.",
    "set use_sink_attention: true.")
MISSING_SINK = rule(
    "B34.missing-sink", ("use_sink_attention", "sink"),
    "the layer was planned with a learned sink but the call passes none; it would run without one (B34).",
    "pass the layer's sink tensor.")
ALIBI_GRAD = rule(
    "B34.alibi-grad", ("alibi_slopes",),
    "the alibi_slopes require a gradient, and Primus-Turbo's backward computes none for them: they would "
    "silently not train (B34).",
    "pass constant slopes (detach them), or set turbo_flex_attention_backend: reference, which differentiates them.")
ALIBI_TWICE = rule(
    "B34.alibi-twice", ("turbo_flex_attention_score_mod", "alibi_slopes"),
    "alibi_slopes were passed and the score hook is ALiBi too; adding both would double the bias.",
    "pass only one of them.")
DENSE_RANK = rule(
    "B34.dense-rank", ("qkv_format",), "dense inputs are bshd [B, S, H, D]; got a {rank}-D query.",
    "call the adapter's varlen entry (flash_attn_varlen_func's arguments) for packed thd inputs.")
PACKED_RANK = rule(
    "B34.packed-rank", ("qkv_format",), "packed inputs are thd [T, H, D]; got a {rank}-D query.",
    "pass [T, H, D] tensors to the varlen entry, or bshd tensors to the dense one.")
PACKED_EXTRAS = rule(
    "B17", (),
    "packed (thd) attention runs the document kernel, which takes no mask_mod, score_mod or bias; they would be "
    "dropped (B17).",
    "remove them for packed batches, or pass dense bshd inputs.")

# -- the Megatron modules (`primus_ext.megatron.core`) --------------------------------------
ATTENTION_BIAS = rule(
    "B29", ("position_embedding_type", "attention_bias"),
    "an attention_bias tensor (ALiBi) reached core attention; Primus-Turbo attention cannot take a dense bias, so "
    "it would be ignored (B27, B29).",
    "give ALiBi as turbo_flex_attention_score_mod, or use another position embedding.")
MASK_TYPE = rule(
    "B34.mask-type", ("attn_mask_type",),
    "the call asks for attn_mask_type={asked} but the layer was built and checked for {built}.",
    "build the layer with the mask type it runs.")
NO_PACKED_ENTRY = rule(
    "B21.no-packed-entry", ("packed_seq_params", "context_parallel_size", "enable_turbo_attention_float8"),
    "packed_seq_params were passed but this layer's path has no packed kernel ({entry}); they would be ignored "
    "(B21).",
    "use context_parallel_size: 1 without fp8 for packed training, or do not pack.")
BOUNDS_NOT_THD = rule(
    "B21", ("packed_seq_params",),
    "packed_seq_params carry cu_seqlens but qkv_format={fmt!r}; the document boundaries would be ignored (B21).",
    "set qkv_format='thd'.")
THD_WITHOUT_BOUNDS = rule(
    "B34.thd-bounds", ("packed_seq_params",), "qkv_format='thd' without cu_seqlens_q/cu_seqlens_kv.",
    "pass packed_seq_params with cu_seqlens_q and cu_seqlens_kv for thd inputs.")
PADDED_TYPE = rule(
    "B19.type", ("{name}",),
    "packed_seq_params.{name} is a {kind}, not a tensor; the boundaries could not be checked or passed on.",
    "pass int32 tensors, as megatron-core's PackedSeqParams holds them.")
PADDED = rule(
    "B19", ("{padded}",),
    "{padded} differ from {plain}; the kernel takes one pair of boundaries, so per-sequence padding would be "
    "attended as tokens (B19).",
    "pack without per-sequence padding (padded == unpadded boundaries).")
MASK_WITH_THD = rule(
    "B34.mask-with-thd", ("attention_mask", "packed_seq_params"),
    "an attention_mask tensor came with a packed (thd) call; the documents are the cu_seqlens, the mask would be "
    "ignored.",
    "pass attention_mask=None with packed batches.")
WINDOW_ALIGNMENT = rule(
    "B34.window-alignment", ("window_size", "use_turbo_flex_attention"),
    "window_size={window} on a non-causal layer with {unequal}: megatron-core (and the direct path's flash "
    "kernels) align the window bottom-right, the flex path top-left (FlexAttention's convention).",
    "use_turbo_flex_attention: false, whose flash kernels align it as megatron-core does, or equal q and kv "
    "lengths.")
BOTTOM_RIGHT = rule(
    "B34.bottom-right", ("attn_mask_type", "use_turbo_flex_attention"),
    "attn_mask_type=causal_bottom_right with {unequal}: the flex path aligns masks top-left (FlexAttention's "
    "convention).",
    "use_turbo_flex_attention: false, whose flash kernels align bottom-right.")
TOP_LEFT = rule(
    "B34.top-left", ("attn_mask_type", "use_turbo_flex_attention"),
    "attn_mask_type=causal (top-left) with {unequal}: the direct path's flash kernels align it bottom-right.",
    "use attn_mask_type=causal_bottom_right if that is meant, or use_turbo_flex_attention: true with "
    "turbo_flex_attention_backend: reference for top-left.")


# -- the call's own inputs (`primus_ext.call.checks`) -----------------------------------------
HEADS = rule(
    "B34.heads", ("num_attention_heads", "num_query_groups"),
    "the call has {q_heads} query and {kv_heads} key/value heads, but the layer was planned for {heads} and "
    "{planned_kv}.",
    "build the layer with the head counts (per tensor-parallel rank) it is called with.")
QKV_TYPE = rule("B34.qkv-type", ("{name}",), "{name} must be a torch.Tensor, got {kind}.",
                "pass q, k and v as torch tensors.")
QKV_DTYPE = rule("B34.dtype", ("{name}",), "{name} has dtype {dtype}; attention takes floating point inputs.",
                 "pass bf16 or fp16 tensors (float32 / float64 on the reference backend).")
MIXED_DTYPES = rule("B34.mixed-dtypes", ("q", "k", "v"),
                    "q, k and v have different dtypes ({q}, {k}, {v}); no kernel mixes them.",
                    "cast all three to one dtype.")
MIXED_DEVICES = rule("B34.mixed-devices", ("q", "k", "v"), "q, k and v are on different devices ({q}, {k}, {v}).",
                     "move all three to one device.")
MIXED_RANKS = rule("B34.mixed-ranks", ("q", "k", "v"), "q, k and v have different ranks ({q}, {k}, {v}).",
                   "pass all three as bshd [B, S, H, D] (dense) or thd [T, H, D] (the varlen entry).")
QKV_SHAPES = rule("B34.qkv-shapes", ("q", "k", "v"),
                  "shapes q {q}, k {k}, v {v} do not fit: q and k need one head dim and one batch size, k and v one "
                  "shape up to the head dim.", "pass k and v of one shape (up to v's head dim), and q with k's head "
                  "dim and batch size.")
HEAD_DIM = rule("B34.head-dim", ("q", "k", "v"),
                "q, k and v need head dims of at least 1; got q {q}, k {k}, v {v}.",
                "pass q, k and v with the layer's head dims (kv_channels).")
PLANNED_DIMS = rule("B34.head-dims", ("kv_channels", "q", "v"),
                    "the layer was planned for head dim {head_dim} (q, k) and {head_dim_v} (v); the call's are "
                    "{got} and {got_v}. The kernel routes, sink and hook checks were made for the planned ones.",
                    "pass q, k and v of the model's head dims, or build the layer for these (kv_channels).")
BIAS_TYPE = rule("B34.bias-type", ("bias",), "the bias must be a floating tensor on {device}, got {got}.",
                 "pass the bias as a floating tensor on q's device, or leave it None.")
BIAS_KERNEL = rule("B34.bias-kernel", ("bias",),
                   "Primus-Turbo's kernels take one [{q_len}, {kv_len}] bias in {dtype}, got {shape} in {got}.",
                   "pass one [Sq, Skv] bias in q's dtype, or set turbo_flex_attention_backend: reference.")
BIAS_SHAPE = rule("B34.bias-shape", ("bias",),
                  "the bias of shape {shape} does not broadcast to [B, Hq, Sq, Skv] = {full}.",
                  "pass a bias that broadcasts to [B, Hq, Sq, Skv].")
SINK_TYPE = rule("B34.sink-type", ("use_sink_attention", "sink"), "the sink must be a floating tensor, got {got}.",
                 "pass the layer's sink parameter (one fp32 logit per local query head).")
SINK_SHAPE = rule("B34.sink-shape", ("use_sink_attention", "sink"),
                  "the sink must hold one value per local query head ([{heads}]) on {device}, got shape {shape} on "
                  "{got}.", "pass the layer's sink parameter (one fp32 logit per local query head, on q's device).")
_SLOPES = "pass torch.tensor(slopes, dtype=torch.float32, device=q.device) with {heads} entries."
ALIBI_TYPE = rule("B34.alibi-type", ("alibi_slopes",), "alibi_slopes must be a floating tensor, got {got}.", _SLOPES)
ALIBI_SHAPE = rule("B34.alibi-shape", ("alibi_slopes",),
                   "alibi_slopes must hold one value per local query head ([{heads}]) on {device}, got shape {shape} "
                   "on {got}.", _SLOPES)
ALIBI_DTYPE = rule("B34.alibi-dtype", ("alibi_slopes",), "Primus-Turbo's kernels take fp32 alibi_slopes, got {dtype}.",
                   "pass the slopes in float32.")
ALIBI_RIGHT = rule(
    "B35.right", ("alibi_slopes", "causal", "window_size"),
    "alibi_slopes with a {mask} mask, which reaches right of the diagonal: Primus-Turbo's ALiBi kernels add the "
    "symmetric -slope * |q - kv| there, the project's ALiBi (and the reference backend) slope * (kv - q).",
    "use ALiBi with a causal mask (right bound 0), a symmetric ALiBi score hook, or "
    "turbo_flex_attention_backend: reference.")
ALIBI_LENGTHS = rule(
    "B35.lengths", ("alibi_slopes", "turbo_flex_attention_score_mod"),
    "ALiBi with q_len={q_len} != kv_len={kv_len}: Primus-Turbo's kernels measure the distance bottom-right "
    "aligned, a hook (and the reference) top-left.",
    "use equal q and kv lengths, or turbo_flex_attention_backend: reference.")
ALIBI_LSE = rule(
    "B35.lse", ("alibi_slopes", "return_lse"),
    "return_lse with ALiBi on Primus-Turbo: the causal ALiBi kernel adds slope * kv (not slope * (kv - q)), so its "
    "lse is off by slope * q per row.",
    "call with return_lse=False, or use turbo_flex_attention_backend: reference.")
PACKED_CALL = rule(
    "B34.packed-call", ("packed_sequences", "cu_seqlens_q"),
    "a packed (thd) call reached a layer declared packed_sequences: false; its packed kernels were never checked "
    "for this layer.",
    "set packed_sequences: true (or leave it out) to train packed batches.")
_DENSE_CALL = ("convert each micro-batch with primus_ext.megatron.pack_eod_micro_batch (packed_seq_params with "
               "cu_seqlens), or set packed_sequences: false (or leave it out) for dense batches.")
DENSE_CALL = rule("B34.dense-call", ("packed_sequences",),
                  "a dense call reached a layer declared packed_sequences: true.", _DENSE_CALL)
EOD_DENSE_CALL = rule(
    "B25.dense-call", ("packed_sequences", "reset_attention_mask"),
    "a dense call reached a layer declared packed_sequences: true with reset_attention_mask: its documents come "
    "from EOD tokens as cu_seqlens, and a dense call would attend across them.", _DENSE_CALL)
_MASK_DOCUMENTS = ("let Megatron build its document mask (create_attention_mask_in_dataloader: true, the default), or "
                   "convert each micro-batch with primus_ext.megatron.pack_eod_micro_batch and set packed_sequences: "
                   "true.")
DOCUMENT_MASK_MISSING = rule(
    "B25.no-mask", ("reset_attention_mask", "create_attention_mask_in_dataloader"),
    "reset_attention_mask is true, but a dense call reached the layer with attention_mask=None: the documents are "
    "read from Megatron's [B, 1, S, S] mask, and without it the layer would attend across them.", _MASK_DOCUMENTS)
DOCUMENT_MASK_SHAPE = rule(
    "B25.mask-shape", ("attention_mask", "reset_attention_mask"),
    "with reset_attention_mask, attention_mask must be Megatron's document mask: bool [{batch} or 1, 1, {q_len}, "
    "{kv_len}] with q_len == kv_len; got dtype {dtype} and shape {shape}.", _MASK_DOCUMENTS)
DOCUMENT_MASK_VALUES = rule(
    "B25.mask-values", ("attention_mask", "reset_attention_mask"),
    "with reset_attention_mask, attention_mask is not block-causal (causal inside contiguous documents, as "
    "megatron-core's _get_ltor_masks_and_position_ids builds it); the varlen kernel would compute another mask.",
    _MASK_DOCUMENTS)
DOCUMENT_MASK_COUNT = rule(
    "B25.max-documents-mask", ("reset_attention_mask_max_documents",),
    "Megatron's document mask of {batch} rows holds more documents than reset_attention_mask_max_documents="
    "{max_documents} (or the bound is below the rows); their boundaries would be merged.",
    "raise reset_attention_mask_max_documents (at least the documents of any micro-batch), or set it to null.")
DROPOUT = rule("B34.dropout", ("dropout_p",), "dropout_p must be a probability in [0, 1), got {got!r}.",
               "pass 0.0 for no dropout.")
_WINDOWS = "use (-1, -1) for no window, (W, 0) for a causal sliding window."
WINDOW = rule("B34.window", ("window_size",), "window_size must be a pair (left, right) of ints, got {got!r}.",
              _WINDOWS)
WINDOW_BOUND = rule("B34.window-bound", ("window_size",),
                    "window_size={got!r}: each bound is -1 (unbounded) or >= 0, below 2**31 (the kernels' int).",
                    _WINDOWS)
CU_TYPE = rule("B34.cu-type", ("{name}",),
               "{name} must be a 1-D int32 tensor on the inputs' device, got {kind}.",
               "pass torch.tensor({name}, dtype=torch.int32, device=q.device).")
CU_SHAPE = rule("B34.cu-shape", ("{name}",),
                "{name} must be 1-D with at least two entries (0 and the token count), got shape {shape}.",
                "pass the cumulative document lengths as one 1-D int32 tensor starting at 0.")
CU_DTYPE = rule("B34.cu-dtype", ("{name}",), "{name} has dtype {dtype}; document boundaries are integers.",
                "pass int32 boundaries.")
CU_DEVICE = rule("B34.cu-device", ("{name}",), "{name} is on {device} but the inputs are on {inputs}.",
                 "move {name} to the inputs' device.")
MAX_SEQLEN_TRACED = rule(
    "B34.max-seqlen-traced", ("{name}",),
    "{name} is a tensor; a compiled graph passes max_seqlen to the kernel op as a Python int.",
    "pass an int (Megatron's PackedSeqParams holds one), or leave it None.")
MAX_SEQLEN_TENSOR = rule("B34.max-seqlen-tensor", ("{name}",),
                         "{name} must be a positive int, got a tensor of shape {shape} and dtype {dtype} on {device}.",
                         "pass an int (or a one-element integer tensor on the inputs' device), or leave it None.")
MAX_SEQLEN = rule("B34.max-seqlen", ("{name}",), "{name} must be a positive int below 2**31 (0 for a call of no token), got {got!r}.",
                  "pass the longest document's length, or leave it None.")
SHARED_BOUNDARIES = rule(
    "B34.shared-boundaries", ("cu_seqlens_q", "{kv_name}"),
    "one boundary tensor was given for q and kv, but q has {q_tokens} tokens and k {kv_tokens}; one set of "
    "boundaries cannot end at both.",
    "pass each side's own boundaries.")
DOCUMENT_COUNT = rule("B34.document-count", ("cu_seqlens_q", "{kv_name}"),
                      "cu_seqlens_q has {q_documents} documents and {kv_name} {kv_documents}; q and kv need the "
                      "same documents.", "pass one boundary vector per side with the same number of documents.")
EQUAL_MAX_TENSOR = rule(
    "B36.max-tensor", ("packed_equal_documents", "max_seqlen_{side}"),
    "packed_equal_documents is true, but max_seqlen_{side} is a tensor: the documents' one length cannot be checked "
    "without reading it on the host.",
    "pass max_seqlen_{side} as an int (the length of every document).")
EQUAL_LENGTHS = rule(
    "B36.unequal", ("packed_equal_documents", "max_seqlen_{side}", "cu_seqlens_{side}"),
    "packed_equal_documents is true, but {documents} documents of max_seqlen_{side}={longest} tokens make {total}, "
    "not the {tokens} tokens given: the documents are not all of one length (or max_seqlen is not it).",
    "pack documents of one length with max_seqlen_{side} equal to it, or set packed_equal_documents: false.")
BOUNDARIES = rule(
    "B34.boundaries", ("{name}", "{max_name}"),
    "{name} must start at 0, never decrease, end at the token count ({tokens}), and have no document longer than "
    "max_seqlen ({longest}) (B34).",
    "build the boundaries as the cumulative document lengths, and max_seqlen as the longest document (or leave it "
    "None).")

SCALE = rule("B34.scale", ("softmax_scale",), "softmax_scale must be a finite positive float or None, got {got}.",
             "pass a Python float (or None: 1/sqrt(head_dim), the plan's).")

# -- whose causal / window_size a call runs (`primus_ext.call.agreement`) ---------------------
CAUSAL_FLAG = rule("B34.causal", ("causal",), "causal must be a bool or None (the plan's), got {got}.",
                   "pass causal=True / False, or leave it out.")
DROP_IN_TYPE = rule(
    "B34.drop-in", ("drop_in",),
    "drop_in must be True, False or None (the plan's turbo_flex_attention_call_flags), got {got}.",
    "pass drop_in=True for calls that pass their own causal / window_size, or leave it out.")
HOOK_FLAGS = rule(
    "B11", ("turbo_flex_attention_mask_mod", "causal", "window_size"),
    "the layer's mask comes from the hook {hook}, but the call also asks for {asked} ({mask}); the two are not "
    "silently composed (B11).",
    "call with causal=False, window_size=(-1, -1), or leave both out, and put the whole mask in the hook "
    "(turbo_flex_attention_call_flags: drop_in does not change this).")
CALL_FLAGS = rule(
    "B34.call-flags", ("causal", "window_size", "turbo_flex_attention_call_flags"),
    "the call asks for {asked} ({mask}), but the layer was planned for causal={causal}, window_size={window} "
    "({planned}); a call does not replace the attention the plan approved (B34).",
    "leave causal and window_size out (None: the plan's) or pass the plan's; for a flash_attn_func-style caller "
    "that passes its own, set turbo_flex_attention_call_flags: drop_in (or TurboFlexAttention(plan, drop_in=True)), "
    "which checks each call's own flags by the layer's rules.")
TRACED_FLAGS = rule(
    "B34.traced-flags", ("causal", "window_size"),
    "under torch.compile {what}: the flags decide the mask and are checked while the call is traced, so they must "
    "be Python values there (B34).",
    "pass causal as a bool and window_size as a pair of ints (or leave them out: the plan's).")

# -- each turbo call's kernel route (`primus_ext.backends.call_route`) -------------------------
LAYOUT = rule(
    "B34.layout", ("qkv_format",), "{problem} (a call to flash_attn_func would fail there).",
    "pass q, k and v in one storage layout, e.g. bshd views of contiguous [S, B, H, D] tensors, as Megatron's "
    "modules do.")
ROUTE = rule("B33", ("turbo_arch",), "{reason}", "{alternative}")
"""The dispatch model's own refusal of one call (`Route.reason`: "this call: {problem}."); raised with
`refuse_naming`, as the settings it names are those of the checks that block the call."""

# -- Primus-Turbo's fixed kernels (`primus_ext.backends.turbo`) --------------------------------
DOCUMENTS_BIAS = rule(
    "B17.documents-bias", ("turbo_flex_attention_mask_mod", "bias"),
    "a {mask} mask runs on Primus-Turbo's varlen kernel, which takes no bias; the bias would be dropped (B17).",
    "remove the bias, or set turbo_flex_attention_backend: reference.")
DOCUMENT_ALIGNMENT = rule(
    "B34.document-alignment", ("cu_seqlens_q", "cu_seqlens_kv"),
    "cu_seqlens_q and cu_seqlens_kv differ, so documents have different q and kv lengths; Primus-Turbo's varlen "
    "kernel aligns the {mask} mask bottom-right inside each document, a mask_mod (and the reference backend) "
    "top-left.",
    "pass equal q and kv boundaries, use a full (non-causal, unwindowed) mask, or set "
    "turbo_flex_attention_backend: reference.")

# -- torch's FlexAttention (`primus_ext.backends.flex`) -----------------------------------------
FLEX_UNSUPPORTED = rule(
    "B34.flex", ("turbo_flex_attention_backend", "{setting}"),
    "{what} on the flex backend: torch's flex_attention has no dropout, takes no bias tensor and is not shown "
    "to have a deterministic backward, so it would be ignored.",
    "set turbo_flex_attention_backend: reference (exact torch math, any device), or {instead}.")
FLEX_DEVICE = rule(
    "B34.flex-device", ("turbo_flex_attention_backend",),
    "tensors on the {device} device on the flex backend: torch's FlexAttention runs on {devices} only.",
    "set turbo_flex_attention_backend: reference, which runs on any device (the meta device included).")
FLEX_TRACE = rule(
    "B34.flex-trace", ("turbo_flex_attention_backend", "turbo_flex_attention_mask_mod", "turbo_flex_attention_score_mod"),
    "torch's flex_attention could not trace the hook ({error}): FlexAttention compiles a hook into its kernel, and "
    "this one uses something torch cannot trace there.",
    "use turbo_flex_attention_backend: reference (it evaluates the hook as written), or rewrite the hook with "
    "tensor operations only.")
FLEX_CPU_GRAD = rule(
    "B34.flex-cpu-grad", ("turbo_flex_attention_backend",),
    "a call on the CPU that needs gradients, on the flex backend: torch's flex_attention has no CPU backward.",
    "set turbo_flex_attention_backend: reference (or auto, which picks it on the CPU), or run on a GPU.")
FLEX_LEARNED = rule(
    "B34.flex-learned", ("turbo_flex_attention_backend", "turbo_flex_attention_mask_mod",
                         "turbo_flex_attention_score_mod"),
    "a call on the flex backend whose hooks now capture {learned} tensor(s) that require grad (a table set to train "
    "after the layer was built): torch's flex_attention gradient for captured tensors is not shown here, so the "
    "table could silently not train (at build this is rule hook-learned).",
    "set turbo_flex_attention_backend: reference (it trains the table through autograd), or keep the table "
    "frozen (requires_grad=False).")
HOOK_RAISED = rule(
    "B34.hook-raised", ("turbo_flex_attention_mask_mod", "turbo_flex_attention_score_mod"),
    "the {kind} raised {error} when called with this call's indices (the largest [b, h, q_idx, kv_idx]: {top}): a "
    "hook that reads a captured table (per head, per token) must cover every index the call has.",
    "size what the hook reads for the model's heads and sequence length (seq_length), or guard the index "
    "(e.g. clamp it) inside the hook.")
HOOK_ERRORS = (IndexError, KeyError, TypeError, ValueError, ZeroDivisionError, AttributeError, NameError)
"""What a user's hook raises for an index it was not written for (not torch's out-of-memory or our errors)."""

LEARNED_COMPILE = rule(
    "B34.learned-compile", ("turbo_flex_attention_mask_mod", "turbo_flex_attention_score_mod"),
    "a compiled call whose hooks capture {learned} tensor(s) that require grad (a learned table): under "
    "torch.compile the attention is one opaque op that takes q, k and v, not the hook's tensors, so the table "
    "would silently get no gradient.",
    "run the layer eagerly (the reference backend trains the table through autograd), or freeze the table "
    "(requires_grad=False).")


__all__ = [
    "BUILD_REFUSALS", "CALL_RULES", "CompiledCallRefusal", "Refusal", "build_rule", "on_ranks", "refuse",
    "refuse_all", "refuse_compiled", "refuse_build", "refuse_naming", "refuse_option", "rule", "ATTN_PROBS", "BACKEND_LACKS", "HOOK_ASSUMPTION",
    "HOOK_CHANGED", "MASK_LENGTH", "UNEQUAL_LENGTHS", "UNPLANNED_SINK", "MISSING_SINK", "ALIBI_GRAD",
    "ALIBI_TWICE", "DENSE_RANK", "PACKED_RANK", "PACKED_EXTRAS", "ATTENTION_BIAS", "MASK_TYPE", "NO_PACKED_ENTRY",
    "BOUNDS_NOT_THD", "THD_WITHOUT_BOUNDS", "PADDED_TYPE", "PADDED", "MASK_WITH_THD", "WINDOW_ALIGNMENT",
    "BOTTOM_RIGHT", "TOP_LEFT", "HEADS", "QKV_TYPE", "QKV_DTYPE", "MIXED_DTYPES", "MIXED_DEVICES", "MIXED_RANKS",
    "QKV_SHAPES", "HEAD_DIM", "PLANNED_DIMS", "BIAS_TYPE", "BIAS_KERNEL", "BIAS_SHAPE", "SINK_TYPE", "SINK_SHAPE",
    "ALIBI_TYPE", "ALIBI_SHAPE", "ALIBI_DTYPE", "ALIBI_RIGHT", "ALIBI_LENGTHS", "ALIBI_LSE", "PACKED_CALL",
    "DENSE_CALL", "EOD_DENSE_CALL", "DOCUMENT_MASK_MISSING", "DOCUMENT_MASK_SHAPE", "DOCUMENT_MASK_VALUES",
    "DOCUMENT_MASK_COUNT", "DROPOUT", "WINDOW", "WINDOW_BOUND", "CU_TYPE", "CU_SHAPE", "CU_DTYPE", "CU_DEVICE",
    "MAX_SEQLEN_TRACED", "MAX_SEQLEN_TENSOR", "MAX_SEQLEN", "SHARED_BOUNDARIES", "DOCUMENT_COUNT",
    "EQUAL_MAX_TENSOR", "EQUAL_LENGTHS", "BOUNDARIES", "SCALE", "CAUSAL_FLAG", "DROP_IN_TYPE", "HOOK_FLAGS",
    "CALL_FLAGS", "TRACED_FLAGS", "LAYOUT", "ROUTE", "DOCUMENTS_BIAS", "DOCUMENT_ALIGNMENT", "FLEX_UNSUPPORTED",
    "FLEX_DEVICE", "FLEX_TRACE", "FLEX_CPU_GRAD", "FLEX_LEARNED", "HOOK_RAISED", "HOOK_ERRORS", "LEARNED_COMPILE",
    *_MEGATRON_CALLS, *_BUILD
]
