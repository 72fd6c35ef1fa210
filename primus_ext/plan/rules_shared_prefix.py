"""The refusals of shared-prefix rows (``packed_shared_prefix``, B37).

A shared-prefix row runs as two varlen calls merged through their log-sum-exps
(`primus_ext.backends.shared_prefix`): the packed call (every prompt, response and document causal)
and the cross call (each tree's responses against its whole prompt, non-causal).  The merge is exact
only where each query's softmax is the union of the two calls' key sets and nothing else: no window
(it would cut the prompt a response sees, by distances the gathered cross call does not have), no
mask or score hook (the calls run fixed masks), no dropout (each kernel would draw its own mask and
keep its own rng state for a backward given the merged output), no context parallelism (megatron-core
splits THD rows per segment), and kernels whose forward returns the LSE and whose backward takes it:
the kernel-level pairs, never the public entries.  A backend that computes the tree mask itself in one call
(`BackendCapabilities.tree_mask`: torch's FlexAttention) needs no merge, but the same settings.
"""

from __future__ import annotations

from typing import Tuple

from .rule_input import Rule, RuleInput


def _on(c: RuleInput) -> bool:
    return c.turbo_path and bool(c.settings.packed_shared_prefix)


def _windowed(c: RuleInput) -> bool:
    return c.window is not None and tuple(c.window) not in ((-1, -1), (-1, 0))


def _hooks(c: RuleInput) -> bool:
    s = c.settings
    return c.flex and bool(s.turbo_flex_attention_mask_mod or s.turbo_flex_attention_score_mod)


_ALTERNATIVE = "or pack each response after its own copy of the prompt (ordinary documents) and set packed_shared_prefix: false."

SHARED_PREFIX_RULES: Tuple[Rule, ...] = (
    Rule("B37-packed", ("packed_shared_prefix", "packed_sequences"),
         "packed_shared_prefix declares shared-prefix rows, which are packed (THD), but packed_sequences is false: "
         "the declaration would be ignored.",
         "set packed_sequences: true (or leave it out), or packed_shared_prefix: false.",
         lambda c: _on(c) and c.facts.packed is False),
    Rule("B37-causal", ("packed_shared_prefix", "attn_mask_type"),
         "packed_shared_prefix runs prompts and responses causal, but this layer is not causal "
         "(attn_mask_type={mask_type}).",
         "use a causal layer for shared-prefix rows, " + _ALTERNATIVE,
         lambda c: _on(c) and not c.facts.causal),
    Rule("B37-window", ("packed_shared_prefix", "window_size", "sink_sliding_window"),
         "packed_shared_prefix with the window {window} on layer {layer}: a response token sees its whole prompt in "
         "the cross call, whose gathered tokens keep no distance to the prompt, so a window cannot cut it there.",
         "remove the window on layers that get shared-prefix rows (sink_window_even_layers_only keeps it on "
         "alternate layers only), " + _ALTERNATIVE,
         lambda c: _on(c) and _windowed(c)),
    Rule("B37-hooks", ("packed_shared_prefix", "turbo_flex_attention_mask_mod", "turbo_flex_attention_score_mod"),
         "packed_shared_prefix runs two fixed-mask varlen calls, which take no mask_mod or score_mod hook; the hook "
         "would be dropped.",
         "remove the hooks on this layer, " + _ALTERNATIVE,
         lambda c: _on(c) and _hooks(c)),
    Rule("B37-dropout", ("packed_shared_prefix", "attention_dropout"),
         "packed_shared_prefix with attention_dropout={dropout}: each of the two calls would draw its own dropout "
         "mask and replay it in a backward given the merged output, which no kernel pair here is checked to do.",
         "set attention_dropout: 0.0 for shared-prefix training, " + _ALTERNATIVE,
         lambda c: _on(c) and c.facts.attention_dropout > 0),
    Rule("B37-cp", ("packed_shared_prefix", "context_parallel_size"),
         "packed_shared_prefix with context_parallel_size={cp}: megatron-core splits THD rows per segment across "
         "ranks, so a response and its prompt are not on one rank for the cross call.",
         "use context_parallel_size: 1 for shared-prefix rows, " + _ALTERNATIVE,
         lambda c: _on(c) and c.facts.context_parallel_size > 1),
    Rule("B37-equal", ("packed_shared_prefix", "packed_equal_documents"),
         "packed_shared_prefix with packed_equal_documents: a prompt, its responses and the cross call's segments "
         "are not of one length.",
         "set packed_equal_documents: false on shared-prefix layers.",
         lambda c: _on(c) and bool(c.settings.packed_equal_documents)),
    Rule("B37-fp8", ("packed_shared_prefix", "enable_turbo_attention_float8"),
         "packed_shared_prefix with enable_turbo_attention_float8: the fp8 entry is Primus-Turbo's own Triton "
         "attention, which has no kernel-level pair returning the LSE for the merge.",
         "set enable_turbo_attention_float8: false on shared-prefix layers, " + _ALTERNATIVE,
         lambda c: _on(c) and c.on_direct and bool(c.settings.enable_turbo_attention_float8)),
    Rule("B37-autotune", ("packed_shared_prefix", "use_turbo_autotune"),
         "packed_shared_prefix with use_turbo_autotune: the merge runs one kernel-level pair per call, chosen from the "
         "call's metadata, while autotune keeps whichever kernel backend it timed fastest; no pair can be bound.",
         "set use_turbo_autotune: false on shared-prefix layers (or pin a backend with PRIMUS_TURBO_ATTN_BACKEND), or "
         "turbo_flex_attention_backend: reference.",
         lambda c: _on(c) and (c.on_turbo or c.on_direct) and bool(c.settings.use_turbo_autotune)),
    Rule("B37-arch", ("packed_shared_prefix", "turbo_arch"),
         "packed_shared_prefix on Primus-Turbo's kernels with no known arch: the merge calls the kernel-level pair "
         "the dispatch model picks for each call on the arch, which is unknown here.",
         "set turbo_arch: gfx942 or gfx950 (on ROCm it is read from the device), or "
         "turbo_flex_attention_backend: reference.",
         lambda c: _on(c) and (c.on_turbo or c.on_direct) and c.arch is None),
)


__all__ = ["SHARED_PREFIX_RULES"]
