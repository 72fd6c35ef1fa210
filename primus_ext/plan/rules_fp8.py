"""The refusals of Primus-Turbo's fp8 attention (``enable_turbo_attention_float8``, the direct path).

``flash_attn_fp8_func`` runs Primus-Turbo's own fp8 Triton attention, not the dispatched kernels, with
limits of its own (attention_triton_impl.py at a6a16cd; docs/fidelity.md, facts `fp8-bf16-output`,
`fp8-head-dims`): it returns bf16 whatever the input dtype and its backward asserts a bf16 ``do``; its
backward asserts head dims of at least 32 and even; it takes only the full window and never passes
``deterministic`` on.
"""

from __future__ import annotations

from typing import Tuple

from .rule_input import Rule, RuleInput


def _fp8(c: RuleInput) -> bool:
    return c.on_direct and bool(c.settings.enable_turbo_attention_float8)


FP8_RULES: Tuple[Rule, ...] = (
    Rule("cp-fp8", ("enable_turbo_attention_float8", "context_parallel_size"),
         "enable_turbo_attention_float8 with context_parallel_size={cp}: Primus-Turbo's fp8 context-parallel entry "
         "(flash_attn_fp8_usp_func) joins the sequence shards in rank order, not in Megatron's load-balanced "
         "order, and the fp8 entry's quantisation depends on which heads and tokens one call holds, so Ulysses "
         "around it is not known to compute the CP 1 layer's numbers.",
         "set enable_turbo_attention_float8: false, or context_parallel_size: 1.",
         lambda c: (c.turbo_path and c.facts.context_parallel_size > 1) and c.on_direct and c.settings.enable_turbo_attention_float8),
    Rule("B9", ("enable_turbo_attention_float8", "window_size", "sink_sliding_window"),
         "the fp8 attention kernel only takes window_size=(-1, -1); the window {window} of layer "
         "{layer} would be dropped.",
         "set enable_turbo_attention_float8: false, or remove the window.",
         # window_size=(-1, -1) is the one window the fp8 kernel computes: nothing is dropped.
         lambda c: c.on_direct and c.settings.enable_turbo_attention_float8
         and c.window is not None and c.window != (-1, -1)),
    Rule("B24-fp8", ("deterministic_mode", "enable_turbo_attention_float8"),
         "deterministic_mode with enable_turbo_attention_float8: flash_attn_fp8_func (and its context-parallel "
         "twin) accept `deterministic` and never pass it to their kernel (Primus-Turbo "
         "primus_turbo/pytorch/ops/attention/flash_attn_interface.py l.505-565 and flash_attn_usp_interface.py "
         "l.823-884 at a6a16cd), so the backward would silently not be deterministic.",
         "set enable_turbo_attention_float8: false, or deterministic_mode: false.",
         lambda c: c.on_direct and c.settings.enable_turbo_attention_float8 and c.settings.deterministic_mode),
    Rule("fp8-dtype", ("enable_turbo_attention_float8", "params_dtype"),
         "enable_turbo_attention_float8 with a layer computing in {dtype}: Primus-Turbo's fp8 attention returns bf16 "
         "whatever the input dtype (attention_triton_impl.py l.89-95 at a6a16cd), so the layer would hand "
         "Megatron bf16 where it computes in {dtype}, and its backward asserts a bf16 gradient "
         "(flash_attn_interface.py l.415).",
         "train in bf16 (bf16: true) with fp8 attention, or set enable_turbo_attention_float8: false.",
         lambda c: _fp8(c) and c.facts.dtype not in (None, "bf16")),
    Rule("fp8-head-dim", ("enable_turbo_attention_float8", "kv_channels"),
         "enable_turbo_attention_float8 with head dims {head_dim} (q, k) and {head_dim_v} (v): the fp8 attention "
         "backward asserts head dims of at least 32 that are even (attention_triton_impl.py l.350-351 at a6a16cd).",
         "choose kv_channels even and at least 32, or set enable_turbo_attention_float8: false.",
         lambda c: _fp8(c) and any(d < 32 or d % 2 for d in (c.facts.head_dim, c.facts.v_dim))),
)


__all__ = ["FP8_RULES"]
