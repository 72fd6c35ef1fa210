"""Call-time refusals of what Megatron hands a layer: its mask, context parallelism, the ranks' agreement,
dropout's RNG, the Ulysses exchange and EOD packing."""

from __future__ import annotations

import torch

from .catalogue import build_rule, rule

# -- what Megatron hands core attention (`primus_ext.megatron.call_contract`) ------------------
_MASK_ALTERNATIVE = ("pass attention_mask=None (Megatron: --no-create-attention-mask-in-dataloader); the layer "
                     "applies its configured causal / window / document mask itself. For document masks, pack "
                     "batches as THD (packed_seq_params with cu_seqlens).")
QKV_FORMAT = rule("B34.qkv-format", ("packed_seq_params",),
                  "qkv_format={fmt!r} is not one of Megatron's {formats}.",
                  "use 'sbhd' (Megatron's default), 'bshd' or 'thd' (packed, with cu_seqlens).")
MASK_OBJECT = rule("B34.mask-object", ("attention_mask",), "attention_mask must be a tensor or None, got {kind}.",
                   _MASK_ALTERNATIVE)
MASK_ON_LAYER = rule(
    "B34.mask-on-layer", ("attention_mask",),
    "an attention_mask tensor reached a layer whose attention is {what}; the layer cannot apply a mask tensor, and "
    "it would be ignored.", _MASK_ALTERNATIVE)
MASK_SHAPE = rule(
    "B34.mask-shape", ("attention_mask",),
    "attention_mask of dtype {dtype} and shape {shape} is not Megatron's causal mask (bool [B or 1, 1, {q_len}, "
    "{kv_len}]); it would be ignored.", _MASK_ALTERNATIVE)
MASK_VALUES = rule(
    "B34.mask-values", ("attention_mask", "reset_attention_mask"),
    "attention_mask is not Megatron's causal mask (a document mask from reset_attention_mask, or another mask); the "
    "layer would ignore it (B25, B34).", _MASK_ALTERNATIVE)

# -- context parallelism of a Megatron layer (`primus_ext.megatron.context_parallel`) ----------
_CP_MASK_ALTERNATIVE = ("pass attention_mask=None (Megatron: --no-create-attention-mask-in-dataloader), or the "
                        "causal mask split by get_batch_on_this_cp_rank; the layer applies its own causal / window "
                        "mask.")
CP_PACKED = rule(
    "cp-packed", ("packed_seq_params", "context_parallel_size"),
    "a packed (thd) call at context_parallel_size={cp}: megatron-core splits THD batches per document (each padded "
    "and cut into 2 * CP chunks, cu_seqlens_*_padded), which this layer's Ulysses exchange does not put back in "
    "order; the documents would be attended in the wrong order.",
    "train unpacked (sbhd) with context parallelism, or packed at context_parallel_size: 1.")
CP_MASK_ON_LAYER = rule(
    "B34.cp-mask-on-layer", ("attention_mask",),
    "an attention_mask tensor reached a layer whose attention is {what}; the layer cannot apply a mask tensor, and "
    "it would be ignored.", _CP_MASK_ALTERNATIVE)
CP_MASK_SHAPE = rule(
    "B34.cp-mask-shape", ("attention_mask", "context_parallel_size"),
    "attention_mask of dtype {dtype} and shape {shape} is not this context-parallel rank's rows of Megatron's "
    "causal mask (bool [B or 1, 1, {q_len}, {kv_len}]); it would be ignored.", _CP_MASK_ALTERNATIVE)
CP_MASK_VALUES = rule(
    "B34.cp-mask-values", ("attention_mask", "reset_attention_mask"),
    "attention_mask is not this context-parallel rank's rows of Megatron's causal mask (a document mask from "
    "reset_attention_mask, or another mask); the layer would ignore it (B25, B34).", _CP_MASK_ALTERNATIVE)

# -- what the ranks of one layer agree on (`primus_ext.megatron.rank_agreement`) ---------------
RANK_REFUSED = rule(
    "B34.rank", ("tensor_model_parallel_size", "context_parallel_size"),
    "rank {rank} of this layer's tensor-and-context-parallel group refused this call ({code}): its inputs "
    "(attention mask, boundaries) are not what the layer takes. Every rank of the group refuses the call together, "
    "before its first collective, so none waits alone in an exchange.",
    "read rank {rank}'s error, which names its setting or argument and the alternative; give every rank of the group "
    "inputs the layer takes (Megatron's own get_batch and get_batch_on_this_cp_rank do).")

DROPOUT_TRACKER_GONE = rule(
    "B30.rng", ("attention_dropout", "tensor_model_parallel_size", "context_parallel_size"),
    "a training call with attention_dropout={dropout} on a layer of a tensor-and-context-parallel group of "
    "{ranks} ranks, but megatron-core's model-parallel RNG tracker, seeded when the layer was built, has no "
    "model-parallel state now (reset since): the ranks' default generators would draw the same positions.",
    "seed the tracker again before training (tensor_parallel.model_parallel_cuda_manual_seed(seed)), or set "
    "attention_dropout: 0.0.")

DROPOUT_COMPILED = rule(
    "B30.compiled", ("attention_dropout", "tensor_model_parallel_size", "context_parallel_size"),
    "a training call with attention_dropout={dropout} under torch.compile on a layer of a tensor-and-context-"
    "parallel group of {ranks} ranks: it must draw from megatron-core's model-parallel RNG tracker, whose fork "
    "(a host-side swap of generator states) a compiled graph cannot hold; on the default generator the ranks "
    "would draw the same positions.",
    "run this layer eagerly in training (compile it for evaluation, where dropout is 0), or set "
    "attention_dropout: 0.0.")

# -- the Ulysses exchange (`primus_ext.backends.context_parallel`) ------------------------------
CP_LENGTH = rule(
    "B22", ("context_parallel_size",),
    "the {what} has {tokens} tokens on this context-parallel rank; megatron-core's get_batch_on_this_cp_rank gives "
    "each of the {cp} ranks two equal chunks, so this is not a part of a sequence split that way and its token "
    "order is unknown.",
    "give each rank its part of the sequence with get_batch_on_this_cp_rank (seq_length divisible by "
    "2 * context_parallel_size = {chunks}).")

# -- EOD documents as packed micro-batches (`primus_ext.megatron.eod_packing`) -----------------
EOD_TOKENS = rule("B25.tokens", ("tokens",), "tokens must be an integer [B, S] tensor, got {got}.",
                  "pass the micro-batch's token ids as Megatron's get_batch returns them.")
EOD_MAX_DOCUMENTS = rule(
    "B25.max-documents", ("max_documents",),
    "max_documents must be an int >= the micro-batch size ({batch}), got {got!r}.",
    "bound it by the most documents a micro-batch can hold.")
EOD_TOO_MANY = rule(
    "B25.too-many-documents", ("max_documents",),
    "a micro-batch holds more documents than max_documents={max_documents}; they would be merged (B25).",
    "raise max_documents (e.g. to seq_length // 2 times the micro-batch size) or use longer documents.")


# -- shared-prefix rows (`primus_ext.backends.shared_prefix`, `primus_ext.megatron.shared_prefix`) ----------
PREFIX_LAYOUT = rule(
    "shared-prefix.layout", ("groups",),
    "a shared-prefix row is a sequence of documents (a token count) and trees (a prompt and its responses, "
    "(prompt, [response, ...]) as token counts >= 0); got {got}.",
    "describe each row as e.g. [512, (2048, [512, 512])]: a document of 512 tokens, then a prompt of 2048 "
    "with two responses of 512.")
PREFIX_TOKENS = rule(
    "shared-prefix.tokens", ("q", "k", "v"),
    "q, k and v hold {got} tokens, but the shared-prefix layout describes {total}.",
    "pass the packed row the layout was made for (pack_shared_prefix gives both).")
PREFIX_CHANGED = rule(
    "shared-prefix.changed", ("packed_seq_params",),
    "the shared-prefix layout's tensors were changed in place between the row's forward and its backward: the "
    "backward would compute the gradients of another tree.",
    "make a new layout (SharedPrefixLayout.of or pack_shared_prefix) for a new row instead of refilling one that "
    "a forward still needs.")
PREFIX_CALL = rule(
    "shared-prefix.call", ("packed_shared_prefix",),
    "a shared-prefix row runs as two varlen calls merged through their log-sum-exps, which needs {what}.",
    "set packed_shared_prefix: true on the layer's settings (its plan then refuses at build what cannot be "
    "merged, B37), or pack each response after its own copy of the prompt (ordinary documents).")

PREFIX_POSITIONS = rule(
    "shared-prefix.positions", ("packed_seq_params",),
    "a shared-prefix row reached layer {layer} of a model that was not prepared for shared-prefix rows: megatron-core "
    "numbers RoPE positions from 0 in every THD segment, so each response would be rotated as if it started a "
    "sequence, not as if it followed its prompt.",
    "call primus_ext.megatron.prepare_shared_prefix(model) once after building the GPT model (it gives every token "
    "its position in the duplicated layout).")
PREFIX_BOUNDS = rule(
    "shared-prefix.boundaries", ("{which}",),
    "a shared-prefix row's packed_seq_params carry {which} other than its layout's segments: the packed call and "
    "the cross call would attend by two different descriptions of the row.",
    "pass the SharedPrefixSeqParams pack_shared_prefix made, unchanged (its cu_seqlens are its layout's segments).")
PREFIX_MODEL = build_rule(
    "shared-prefix.model", ("position_embedding_type", "apply_rope_fusion"),
    "prepare_shared_prefix cannot give a shared-prefix row its positions in this model: {what}.",
    "use position_embedding_type rope (unfused: apply_rope_fusion: false), learned_absolute or none for "
    "shared-prefix training, or pack each response after its own copy of the prompt (ordinary documents).")
PREFIX_POSITION_IDS = rule(
    "shared-prefix.position-ids", ("position_ids",),
    "a shared-prefix row was given position_ids other than its own (pack_shared_prefix's): the responses would "
    "be numbered as those say, not as the duplicated layout numbers them.",
    "pass the batch's position_ids (SharedPrefixBatch.position_ids) or none, which prepare_shared_prefix fills in.")


__all__ = ["QKV_FORMAT", "MASK_OBJECT", "MASK_ON_LAYER", "MASK_SHAPE", "MASK_VALUES", "CP_PACKED", "CP_MASK_ON_LAYER", "CP_MASK_SHAPE", "CP_MASK_VALUES", "RANK_REFUSED", "DROPOUT_TRACKER_GONE", "DROPOUT_COMPILED", "CP_LENGTH", "EOD_TOKENS", "EOD_MAX_DOCUMENTS", "EOD_TOO_MANY", "PREFIX_LAYOUT", "PREFIX_TOKENS", "PREFIX_CALL", "PREFIX_POSITIONS", "PREFIX_BOUNDS", "PREFIX_CHANGED", "PREFIX_MODEL", "PREFIX_POSITION_IDS"]
