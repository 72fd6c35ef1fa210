"""The refusal table: every configuration the project will not run, as data.

Each `Rule` names the settings it reads (as the user typed them), why the
combination cannot run exactly, and what to do instead.  `failing_reasons`
evaluates the whole table and returns every failure, so the user sees all of
them in one error instead of fixing one per run.  Codes cite docs/behaviours.md.
"""

from __future__ import annotations

from typing import Tuple

from ..backends.context_parallel import CP_COMM_TYPES
from ..errors import Reason
from ..backends.dispatch import ARCHES
from ..hooks.proof import ALIBI, SYMMETRIC
from .rule_input import (Rule, RuleInput, alibi_right_masks, documents_problem, dynamic_hooks, packing_conflict)
from .rules_fp8 import FP8_RULES
from .rules_shared_prefix import SHARED_PREFIX_RULES


def _documents_hook(c: "RuleInput") -> bool:
    """A mask hook proven to be documents: its dense calls run on the packed (varlen) entry."""
    proof = c.mask_proof
    return c.flex and proof is not None and proof.pattern is not None and proof.pattern.documents


def _dense_documents(c: "RuleInput") -> bool:
    """``reset_attention_mask`` on dense batches of Megatron's core attention: documents read from its
    mask and run on the packed (varlen) entry (B25)."""
    return bool(c.settings.reset_attention_mask) and c.facts.packed is not True and c.facts.megatron_mask


def _score_kind(ctx: RuleInput) -> str:
    return ctx.score_proof.kind if ctx.score_proof else "identity"


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


ALIBI_FORMS = (ALIBI, SYMMETRIC)  # both run as alibi_slopes on fixed kernels
SUPPORTED_MASK_TYPES = ("causal", "no_mask", "causal_bottom_right")
SUPPORTED_CP_COMM = CP_COMM_TYPES


def _cp(c: "RuleInput") -> bool:
    """Context parallel on a Turbo path: Ulysses (`primus_ext.backends.context_parallel`) on either path."""
    return c.turbo_path and c.facts.context_parallel_size > 1


RULES: Tuple[Rule, ...] = (
    Rule("B3", ("use_turbo_flex_attention", "use_turbo_attention"),
         "use_turbo_flex_attention needs the Turbo attention module, but use_turbo_attention is false.",
         "set use_turbo_attention: true as well.",
         lambda c: c.flex and not c.settings.use_turbo_attention),
    Rule("owner", ("turbo_flex_attention_owner", "use_turbo_flex_attention"),
         "turbo_flex_attention_owner is primus: use_turbo_flex_attention belongs to Primus's own flex path, and this "
         "layer is primus_ext's (built by its spec, module or patch), which would run its own instead.",
         "set turbo_flex_attention_owner: primus_ext for primus_ext's layers, or build the layers with Primus's "
         "own attention (no primus_ext spec or module) for Primus's flex path.",
         lambda c: c.flex and c.settings.turbo_flex_attention_owner == "primus"),
    Rule("backend", ("turbo_flex_attention_backend",),
         "turbo_flex_attention_backend asks for Primus-Turbo, but it cannot be used: {problem}",
         "install Primus-Turbo (ROCm), or set turbo_flex_attention_backend: reference "
         "(exact torch math, any device) or auto.",
         lambda c: c.flex and c.caps is None),
    Rule("layer-shape", ("num_attention_heads", "num_query_groups", "kv_channels", "seq_length"),
         "the layer has {heads} query heads, {kv_heads} key/value heads, head dims {head_dim} (q, k) and "
         "{head_dim_v} (v) and seq_length {seq_length}: each must be at least 1 (seq_length may be unset).",
         "build the layer from the model's own heads and kv_channels.",
         lambda c: min(c.facts.num_heads, c.facts.head_dim, c.facts.v_dim) < 1 or any(
             given is not None and given < 1 for given in (c.facts.num_kv_heads, c.facts.head_dim_v)) or (
             c.facts.seq_length is not None and c.facts.seq_length < 1)),
    Rule("window-shape", ("window_size",),
         "window_size={window_given}: a window is two ints, each -1 (unbounded) or >= 0.",
         "use (-1, -1) for none, (W, 0) for a causal sliding window.",
         lambda c: c.facts.window_size is not None and c.window is None),
    Rule("packed-type", ("packed_sequences",),
         "packed_sequences must be true, false or null, got {packed_type} {packed_given} in the model config.",
         "set packed_sequences: true (packed THD batches only), false (dense only), or leave it out.",
         lambda c: packing_conflict(c) == "type"),
    Rule("packed-sources", ("packed_sequences",),
         "packed_sequences is {packed_declared} in the Turbo settings but {packed_given} in the model config; two "
         "sources for one fact.",
         "set it in one place (the Turbo attention settings).",
         lambda c: packing_conflict(c) == "sources"),
    Rule("window-bound", ("window_size", "sink_sliding_window"),
         "the layer's window {window} has a bound past 2**31 - 1: the kernels take bounds as int32, and no sequence "
         "is that long.", "use -1 for an unbounded side of the window.",
         lambda c: c.window is not None and any(bound > 2 ** 31 - 1 or bound < -1 for bound in c.window)),
    Rule("heads", ("num_attention_heads", "num_query_groups"),
         "query heads ({heads}) are not a multiple of key/value heads ({kv_heads}).",
         "choose num_query_groups dividing num_attention_heads.",
         lambda c: c.facts.kv_heads > 0 and c.facts.num_heads % c.facts.kv_heads != 0),
    Rule("dropout", ("attention_dropout",),
         "attention_dropout={dropout} is outside [0, 1).", "use a probability in [0, 1).",
         lambda c: not 0.0 <= c.facts.attention_dropout < 1.0),
    Rule("direct", ("use_turbo_attention",),
         "the direct Turbo path needs Primus-Turbo, which cannot be used here: {problem}",
         "install Primus-Turbo (ROCm), or set use_turbo_flex_attention: true with "
         "turbo_flex_attention_backend: reference (exact torch math on any device).",
         lambda c: c.on_direct and c.direct is None),
    Rule("mask-type", ("attn_mask_type",),
         "attn_mask_type={mask_type} needs a dense attention_mask tensor (padding or arbitrary), "
         "which no Turbo entry takes; it would be ignored.",
         "use a causal or no_mask layer, with THD packing for variable-length documents.",
         lambda c: c.turbo_path and c.facts.attn_mask_type not in SUPPORTED_MASK_TYPES),
    # Context parallelism runs as Ulysses on both paths: an all-to-all from this rank's load-balanced
    # sequence part to the whole sequence in order with 1/CP of the heads, the layer's own attention,
    # and back (primus_ext/backends/context_parallel.py).  Causal, windows, sinks, hooks and ALiBi are
    # the same as at CP 1; what follows is what that exchange cannot carry exactly.
    Rule("cp-comm", ("cp_comm_type", "context_parallel_size"),
         "cp_comm_type={cp_comm} is not one of megatron-core's context-parallel types (p2p, all_gather, a2a, "
         "a2a+p2p), every one of which runs here as Ulysses.",
         "set cp_comm_type to a2a (what runs), or p2p, all_gather or a2a+p2p.",
         lambda c: _cp(c) and c.facts.cp_comm_type not in SUPPORTED_CP_COMM),
    # Dropout draws from megatron-core's model-parallel RNG tracker (`primus_ext.megatron.dropout_rng`),
    # with a generator of its own per context-parallel rank; without the tracker every rank draws alike.
    Rule("B30-rng", ("attention_dropout", "tensor_model_parallel_size", "context_parallel_size"),
         "attention_dropout={dropout} with tensor_model_parallel_size={tp} and context_parallel_size={cp}, but "
         "megatron-core's model-parallel RNG tracker is not seeded in this process: every rank's generator is "
         "seeded alike, so the heads of different ranks would drop the same positions.",
         "seed it before building the model, as Megatron's initialisation does "
         "(tensor_parallel.model_parallel_cuda_manual_seed(seed)), or set attention_dropout: 0.0.",
         lambda c: c.turbo_path and c.facts.attention_dropout > 0.0 and not c.facts.rng_tracker
         and c.facts.tensor_model_parallel_size * c.facts.context_parallel_size > 1),
    Rule("cp-heads", ("num_attention_heads", "num_query_groups", "context_parallel_size"),
         "context parallelism splits attention heads across the context-parallel group (Ulysses "
         "all-to-all), but the query heads ({heads}) and key/value heads ({kv_heads}) of this rank "
         "are not both multiples of context_parallel_size={cp}.",
         "choose num_attention_heads and num_query_groups divisible by tensor_model_parallel_size * "
         "context_parallel_size, or set context_parallel_size: 1.",
         lambda c: _cp(c) and (c.facts.num_heads % c.facts.context_parallel_size != 0
                               or c.facts.kv_heads % c.facts.context_parallel_size != 0)),
    Rule("cp-packed", ("packed_sequences", "context_parallel_size"),
         "packed (thd) batches with context_parallel_size={cp}: megatron-core splits THD batches per document "
         "(each one padded and cut into 2 * CP chunks, cu_seqlens_*_padded), which the Ulysses exchange here does "
         "not put back in order; the documents would be attended in the wrong order.",
         "train unpacked (sbhd) with context parallelism, or packed at context_parallel_size: 1.",
         lambda c: _cp(c) and c.facts.packed is True),
    Rule("B13-direct", ("use_sink_attention",),
         "a learned sink is configured but the direct entry {direct_dense} has no `sink` "
         "parameter (the fp8 entry lacks it); the sink would be dropped.",
         "set enable_turbo_attention_float8: false, or use_sink_attention: false.",
         lambda c: c.on_direct and c.sink and c.direct is not None and c.may_dense and not c.direct.sink_dense),
    Rule("B13-direct-packed", ("use_sink_attention",),
         "a learned sink is configured but the packed entry {direct_packed} of this Primus-Turbo "
         "build has no `sink` parameter; packed batches would drop it.",
         "upgrade Primus-Turbo, or train unpacked.",
         lambda c: c.on_direct and c.sink and c.direct is not None and (c.facts.packed is True or _dense_documents(c))
         and c.direct.packed is not None and not c.direct.sink_packed),
    Rule("B18", ("enable_turbo_attention_float8", "packed_sequences"),
         "packed (thd) batches on the direct path go to flash_attn_varlen_func, which has no fp8 "
         "twin (selected entry: {direct_dense}).",
         "set enable_turbo_attention_float8: false, or train unpacked.",
         lambda c: c.on_direct and c.direct is not None and c.facts.packed is True and c.direct.packed is None),
    # megatron-core's unfused attention applies such a window instead of the causal mask, its
    # fused path ignores the window, TransformerEngine caps it to right bound 0: no one meaning.
    Rule("B8", ("window_size", "attn_mask_type"),
         "window_size={window} on a causal layer (attn_mask_type={mask_type}): a causal layer's window needs "
         "right bound 0, and megatron-core itself gives this one three meanings (its unfused attention applies "
         "the two-sided window instead of the causal mask, its fused path ignores the window, "
         "TransformerEngine caps the right bound to 0); it would not be run as written.",
         "use window_size: [W, 0] for a causal sliding window, or attn_mask_type no_mask for a two-sided band.",
         lambda c: c.facts.causal and c.facts.window_size is not None and c.window is not None
         and c.window != (-1, -1) and c.window[1] != 0),
    Rule("B10", ("window_size", "sink_sliding_window"),
         "both window_size and sink_sliding_window set a sliding window; they are two sources "
         "for one quantity with different per-layer rules.",
         "keep one: window_size (with window_attn_skip_freq) or sink_sliding_window "
         "(with sink_window_even_layers_only).",
         lambda c: c.facts.window_size is not None and c.settings.sink_sliding_window > 0),
    Rule("skip-freq-window", ("window_attn_skip_freq", "window_size", "sink_sliding_window"),
         "window_attn_skip_freq={skip_freq} picks the layers that get window_size, but window_size is not set "
         "(megatron-core applies the key to window_size only){skip_freq_window}; the key would be ignored.",
         "give the window as window_size: [W, 0] with window_attn_skip_freq, or remove window_attn_skip_freq "
         "(sink_sliding_window's layers follow sink_window_even_layers_only).",
         lambda c: c.facts.skip_freq_unused is not None),
    Rule("window-unused", ("window_size", "window_attn_skip_freq"),
         "window_attn_skip_freq gives window_size={window_unused} to none of the model's layers "
         "(megatron-core windows layer n where n % freq != 0, or where the list has 1), so every layer is full "
         "attention and window_size would be ignored.",
         "give window_attn_skip_freq a value that windows the layers meant (N > 1: every N-th layer full "
         "attention; a list with 1 for each windowed layer), or remove window_size.",
         lambda c: c.facts.window_unused is not None),
    # megatron-core's off-by-one softmax registers its sink as a fixed zero buffer, Primus's
    # use_sink_attention a learned one: the layer would train with the buffer, not the learned sink.
    Rule("B10-sink", ("use_sink_attention", "softmax_type"),
         "use_sink_attention asks for a learned per-head sink while softmax_type: off-by-one "
         "makes it a fixed zero (megatron-core registers it as a buffer, never trained); they are "
         "two sources for one sink.",
         "keep one: use_sink_attention: true with softmax_type vanilla or learnable (a learned sink), "
         "or softmax_type: off-by-one with use_sink_attention: false (a fixed zero sink).",
         lambda c: c.settings.use_sink_attention and c.facts.softmax_type == "off-by-one"),
    Rule("B11", ("turbo_flex_attention_mask_mod", "sink_sliding_window", "window_size"),
         "a mask hook ({mask}) and a configured window {window} both decide the mask of layer "
         "{layer}; they are not silently composed or overridden.",
         "express the window inside the hook (e.g. primus_ext.attention.masks:sliding_window "
         "or and_masks) and remove the window setting, or remove the hook.",
         lambda c: c.flex and bool(c.settings.turbo_flex_attention_mask_mod) and c.window is not None),
    Rule("B17", ("turbo_flex_attention_mask_mod", "turbo_flex_attention_score_mod"),
         "packed (thd) batches run on the document kernel, which takes no mask_mod or score_mod; "
         "the hook would be dropped.",
         "remove the hooks for packed training (document masking is built in), "
         "or train unpacked (bshd/sbhd).",
         lambda c: c.flex and c.facts.packed is True and bool(
             c.settings.turbo_flex_attention_mask_mod or c.settings.turbo_flex_attention_score_mod)),
    Rule("B23", ("use_turbo_flex_attention", "enable_turbo_attention_float8"),
         "the flex path has no fp8 kernel.",
         "set enable_turbo_attention_float8: false, or use_turbo_flex_attention: false for "
         "the direct fp8 path.",
         lambda c: c.flex and c.settings.enable_turbo_attention_float8),
    Rule("B36", ("packed_equal_documents", "packed_sequences"),
         "packed_equal_documents declares the lengths of packed documents, but packed_sequences is false: "
         "this layer gets no packed batches, so the declaration would be ignored.",
         "set packed_sequences: true (or leave it out), or packed_equal_documents: false.",
         lambda c: c.settings.packed_equal_documents and c.facts.packed is False),
    Rule("B25", ("reset_attention_mask", "packed_sequences"),
         "reset_attention_mask=True carries document boundaries in Megatron's dense attention_mask, which only "
         "primus_ext's Megatron modules read (into varlen boundaries), and not under context parallelism "
         "(context_parallel_size={cp}); the boundaries would be ignored.",
         "use PrimusTurboAttention / PrimusTurboLocalAttention at context_parallel_size: 1, or convert each "
         "micro-batch to packed THD with primus_ext.megatron.pack_eod_micro_batch (documents from EOD, run on the "
         "varlen kernel) and set packed_sequences: true, or set reset_attention_mask: false.",
         lambda c: c.turbo_path and c.settings.reset_attention_mask and c.facts.packed is not True and (
             not c.facts.megatron_mask or c.facts.context_parallel_size > 1)),
    Rule("B25-layer", ("reset_attention_mask", "turbo_flex_attention_mask_mod", "turbo_flex_attention_score_mod",
                       "packed_equal_documents"),
         "reset_attention_mask on dense batches runs each call on the packed (varlen) kernel, causal inside each "
         "document, but {documents_problem}.",
         "{documents_fix}",
         lambda c: c.turbo_path and _dense_documents(c) and c.facts.context_parallel_size == 1
         and bool(documents_problem(c))),
    Rule("B26", ("return_attn_probs",),
         "attention probabilities are never materialised by the Turbo kernels.",
         "do not request attention probabilities.",
         lambda c: c.turbo_path and c.facts.return_attn_probs),
    Rule("B27", ("position_embedding_type", "attention_bias"),
         "ALiBi (position_embedding_type=alibi / an attention_bias tensor) reaches core attention "
         "as a dense bias that the Turbo kernels cannot take; it would be ignored.",
         "give ALiBi as turbo_flex_attention_score_mod (an ALiBi score_mod is recognised and "
         "run with alibi_slopes), or use another position embedding.",
         lambda c: c.turbo_path and (c.facts.position_embedding_type == "alibi" or c.facts.has_attention_bias)),
    Rule("B31", ("turbo_flex_attention_mask_mod", "turbo_flex_attention_backend"),
         "the mask hook {mask} is not proven equal to a mask Primus-Turbo's fixed kernels compute "
         "(full, causal, a sliding window, chunks or documents at constant positions) for every "
         "batch, head and position: it {mask_why}.",
         "set turbo_flex_attention_backend: reference, which evaluates the hook itself at every "
         "call (or auto, which picks torch's FlexAttention for it on a GPU); or write the mask with "
         "primus_ext.attention.masks (documents: pack them as THD with packed_seq_params and no hook).",
         lambda c: c.fixed_kernels and c.mask_proof is not None and c.mask_proof.pattern is None),
    Rule("torch-call", ("turbo_flex_attention_mask_mod",),
         "{torch_call_mask}; torch's FlexAttention calls a hook that way (under torch.vmap, with 0-d indices), so no "
         "backend can compute what it means (B31).",
         "write the hook with tensor operations on the index arguments only (docs/mask_hooks.md, the provable "
         "subset).",
         lambda c: bool(c.torch_call.get("mask_mod"))),
    Rule("torch-call-score", ("turbo_flex_attention_score_mod",),
         "{torch_call_score}; torch's FlexAttention calls a hook that way (under torch.vmap, with 0-d indices), so "
         "no backend can compute what it means (B31).",
         "write the hook with tensor operations on the score and index arguments only (docs/mask_hooks.md, the "
         "provable subset).",
         lambda c: bool(c.torch_call.get("score_mod"))),
    Rule("softcap", ("turbo_flex_attention_score_mod", "turbo_flex_attention_backend"),
         "the score hook {score} is a logit softcap ({score_why}); no Primus-Turbo dense or varlen backward "
         "supports softcap.",
         "set turbo_flex_attention_backend: reference, or remove the softcap.",
         lambda c: (c.fixed_kernels or c.lacks("softcap")) and _score_kind(c) == "softcap"),
    Rule("B31-score", ("turbo_flex_attention_score_mod", "turbo_flex_attention_backend"),
         "the score hook {score} is not proven to be the identity or ALiBi (the only score_mods "
         "Primus-Turbo runs) for every head, position and score: it {score_why}.",
         "set turbo_flex_attention_backend: reference, which evaluates the hook itself at every "
         "call, or use an ALiBi score_mod (score + slope[h] * (kv_idx - q_idx)).",
         lambda c: c.fixed_kernels and _score_kind(c) == "other"),
    Rule("B35", ("turbo_flex_attention_score_mod", "turbo_flex_attention_backend"),
         "the ALiBi score hook {score} on a mask reaching right of the diagonal ({alibi_masks}): Primus-Turbo's "
         "ALiBi kernels (AITER's CK fmha, and its Triton kernels with a sink) add the symmetric -slope * |q - kv| "
         "there, while the hook adds slope * (kv - q), so every key right of the diagonal would get another bias.",
         "write the hook in the symmetric form, score - slope * |q_idx - kv_idx|, if that is what is meant (it runs "
         "on turbo for every mask); set turbo_flex_attention_backend: reference; or use this ALiBi only on causal "
         "layers (windows with right bound 0).",
         lambda c: c.on_turbo and _score_kind(c) == "alibi" and bool(alibi_right_masks(c))),
    Rule("alibi-entry", ("turbo_flex_attention_score_mod", "turbo_flex_attention_backend"),
         "the ALiBi score hook {score} runs on fixed kernels as alibi_slopes, and the {backend} backend declares "
         "that its kernels take none: the bias would be dropped.",
         "use a backend whose kernels take alibi_slopes, or set turbo_flex_attention_backend: reference.",
         lambda c: c.fixed_kernels and c.lacks("alibi") and c.score_proof is not None
         and c.score_proof.kind in ALIBI_FORMS),
    Rule("B13", ("use_sink_attention",),
         "a learned sink is configured but the installed dense entry ({dense_entry}) has no "
         "`sink` parameter; the sink would be dropped.",
         "upgrade Primus-Turbo, set turbo_flex_attention_backend: reference, or "
         "use_sink_attention: false.",
         lambda c: c.fixed_kernels and c.sink and c.may_dense and not c.caps.sink_dense),  # type: ignore[union-attr]
    Rule("B13-packed", ("use_sink_attention",),
         "a learned sink is configured but the packed entry ({packed_entry}) has no `sink` "
         "parameter; packed batches would drop it.",
         "upgrade Primus-Turbo, set turbo_flex_attention_backend: reference, or train unpacked.",
         lambda c: c.fixed_kernels and c.sink and not c.caps.sink_packed  # type: ignore[union-attr]
         and (c.facts.packed is True or _documents_hook(c) or _dense_documents(c))),
    Rule("sink-shape", ("use_sink_attention", "kv_channels"),
         "Primus-Turbo's sink kernel wants equal q/k and v head dims and a power-of-two head dim "
         "(got {head_dim} and {head_dim_v}).",
         "choose kv_channels as a power of two (under multi_latent_attention: qk_head_dim + qk_pos_emb_head_dim "
         "equal to v_head_dim, a power of two), or use_turbo_flex_attention: true with "
         "turbo_flex_attention_backend: reference.",
         # The direct flash_attn_func / flash_attn_varlen_func sink path has the same limits.
         lambda c: (c.on_turbo or (c.on_direct and c.direct is not None)) and c.sink
         and not (_pow2(c.facts.head_dim) and c.facts.head_dim == c.facts.v_dim)),
    Rule("B24", ("deterministic_mode",),
         "deterministic_mode is on but the selected dense entry ({dense_entry}) has no "
         "`deterministic` parameter.",
         "use a Primus-Turbo build whose flex entries take `deterministic`, set "
         "turbo_flex_attention_backend: reference, or deterministic_mode: false.",
         lambda c: c.fixed_kernels and c.settings.deterministic_mode and c.may_dense
         and c.caps.dense_entry is not None and not c.caps.deterministic_dense),  # type: ignore[union-attr]
    # torch's FlexAttention (`primus_ext.backends.flex`): what it does not compute is refused.
    Rule("flex-dynamic", ("turbo_flex_attention_backend", "turbo_flex_attention_mask_mod",
                          "turbo_flex_attention_score_mod"),
         "turbo_flex_attention_backend: flex with a dynamic hook ({dynamic}): a hook outside the provable subset "
         "may compute something else traced than called, and torch's FlexAttention traces it into its kernel, so "
         "it is no safer there than on a fixed kernel.",
         "set turbo_flex_attention_backend: reference (evaluates the hook as torch calls it) or auto (which does), "
         "or rewrite the hook inside the provable subset (docs/mask_hooks.md).",
         lambda c: c.traced_hooks and bool(dynamic_hooks(c))),
    Rule("hook-range", ("turbo_flex_attention_mask_mod", "turbo_flex_attention_score_mod", "num_attention_heads"),
         "{hook_range} of layer {layer}: what the hook reads per head does not cover the layer's heads, so every "
         "call would fail or read past its table.",
         "size the hook's tables for the model's heads (num_attention_heads), or clamp the index inside the hook.",
         lambda c: c.flex and bool(c.hook_range)),
    Rule("hook-learned", ("turbo_flex_attention_backend", "turbo_flex_attention_mask_mod",
                          "turbo_flex_attention_score_mod"),
         "the hooks capture {learned} tensor(s) that require grad (a learned table) on the {backend} backend: their "
         "gradient comes only from autograd through the hook as called; Primus-Turbo runs a proven hook as a fixed "
         "kernel, and torch's flex_attention gradient for captured tensors is not shown here, so the table would "
         "silently not train.",
         "set turbo_flex_attention_backend: reference (or auto, which picks it; eager only: under torch.compile the "
         "call is refused, B34.learned-compile), or freeze the table (requires_grad=False).",
         lambda c: c.lacks("learned_tables") and c.learned > 0),
    # In a Megatron model a learned table trains only as a parameter of the model: primus_ext registers
    # the hooks' torch.nn.Parameter tables on the layer (`primus_ext.megatron.hook_tables`).
    Rule("hook-learned-param", ("turbo_flex_attention_mask_mod", "turbo_flex_attention_score_mod"),
         "the hooks capture {learned_plain} tensor(s) that require grad but are no torch.nn.Parameter: in a Megatron "
         "model only parameters reach the optimizer and the checkpoints, so the table would get a gradient, never "
         "change, and be lost on save.",
         "make the table a torch.nn.Parameter (primus_ext registers it on every layer whose hook reads it, so "
         "Megatron's optimizer trains it and its checkpoints keep it), or freeze it (requires_grad=False).",
         lambda c: c.flex and c.facts.megatron_mask and c.learned_plain > 0),
    Rule("flex-dropout", ("attention_dropout", "turbo_flex_attention_backend"),
         "attention_dropout={dropout} on the flex backend: torch's flex_attention has no dropout; it would be "
         "ignored.",
         "set attention_dropout: 0.0, or turbo_flex_attention_backend: reference (exact dropout) or auto.",
         lambda c: c.lacks("dropout") and c.facts.attention_dropout > 0.0),
    Rule("flex-deterministic", ("deterministic_mode", "turbo_flex_attention_backend"),
         "deterministic_mode on the flex backend: torch's flex_attention backward is not shown to be "
         "deterministic (its kernels accumulate gradients across blocks).",
         "set turbo_flex_attention_backend: reference (deterministic torch math) or auto, or "
         "deterministic_mode: false.",
         lambda c: c.lacks("deterministic_backward") and c.settings.deterministic_mode),
    Rule("B24-packed", ("deterministic_mode",),
         "deterministic_mode is on but the packed entry ({packed_entry}) has no `deterministic` "
         "parameter.",
         "use a Primus-Turbo build whose flex entries take `deterministic`, set "
         "turbo_flex_attention_backend: reference, or deterministic_mode: false.",
         lambda c: c.fixed_kernels and c.settings.deterministic_mode and c.may_pack
         and c.caps.packed_entry is not None and not c.caps.deterministic_packed),  # type: ignore[union-attr]
    Rule("arch-unmodelled", ("turbo_arch",),
         "the device is {arch}; Primus-Turbo's kernel dispatch is modelled for " + " and ".join(ARCHES)
         + " only, so no route can be checked (B33).",
         "run on gfx942 (MI300) or gfx950 (MI355).",
         lambda c: c.arch is not None and c.arch not in ARCHES and (c.on_turbo or c.on_direct)),
)


RULES = RULES + FP8_RULES + SHARED_PREFIX_RULES


def failing_reasons(ctx: RuleInput, rules: Tuple[Rule, ...] = RULES) -> list[Reason]:
    """Every rule of the table that fails for ``ctx``, rendered with the user's setting names."""
    return [rule.render(ctx) for rule in rules if rule.fails(ctx)]


__all__ = ["RULES", "Rule", "RuleInput", "failing_reasons"]
