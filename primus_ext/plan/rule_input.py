"""What the refusal table reads of one layer (`RuleInput`), and one refusal of it (`Rule`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Tuple

from ..attention.pattern import pattern_from_flash_args
from ..backends.base import HOOKS_PROVEN, HOOKS_TRACED, TURBO_DISPATCH, BackendCapabilities
from ..backends.direct import DirectEntries
from ..errors import Reason, short_repr
from ..hooks.proof import MaskProof, ScoreProof
from ..settings import TurboAttentionSettings
from .facts import LayerFacts


@dataclass(frozen=True)
class RuleInput:
    """What the rules look at for one layer."""

    settings: TurboAttentionSettings
    facts: LayerFacts
    backend: str
    caps: Optional[BackendCapabilities]
    backend_problem: str = ""
    window: Optional[Tuple[int, int]] = None
    mask_proof: Optional[MaskProof] = None
    score_proof: Optional[ScoreProof] = None
    direct: Optional[DirectEntries] = None
    learned: int = 0
    """Tensors the hooks capture that require grad (`primus_ext.backends.flex_masks.learned_tensors`)."""
    learned_plain: int = 0
    """Those of them that are no ``torch.nn.Parameter`` (a Megatron layer can register only parameters)."""
    hook_range: str = ""
    """What the hooks raise at the layer's heads (`primus_ext.hooks.crosscheck.range_problem`)."""
    torch_call: Mapping[str, str] = field(default_factory=dict)
    """Per hook kind, what tells torch's way of calling it apart from ours
    (`primus_ext.hooks.crosscheck.torch_call_problem`)."""
    packed_given: object = None
    """``packed`` as the model config gave it, before the ``packed_sequences`` setting is merged in."""
    arch: Optional[str] = None
    """The arch the layer is planned for (`primus_ext.plan.routes.resolve_arch`), None where unknown."""

    @property
    def flex(self) -> bool:
        return self.settings.use_turbo_flex_attention

    @property
    def turbo_path(self) -> bool:
        """Any Primus-Turbo attention path (flex or direct) is in use."""
        s = self.settings
        return s.use_turbo_attention or s.use_turbo_flex_attention or self.facts.turbo_module

    @property
    def on_direct(self) -> bool:
        """The direct (flex off) Turbo path is in use."""
        return self.turbo_path and not self.flex

    @property
    def fixed_kernels(self) -> bool:
        """The flex path runs on fixed kernels: a hook runs only where proven (its backend declares
        `HOOKS_PROVEN`)."""
        return self.flex and self.caps is not None and self.caps.hooks == HOOKS_PROVEN

    @property
    def on_turbo(self) -> bool:
        """The flex path runs on kernels routed by Primus-Turbo's dispatch model (its facts per arch apply)."""
        return self.fixed_kernels and self.caps.dispatch == TURBO_DISPATCH  # type: ignore[union-attr]

    @property
    def traced_hooks(self) -> bool:
        """The flex path's backend traces hooks into its kernel (torch's FlexAttention)."""
        return self.flex and self.caps is not None and self.caps.hooks == HOOKS_TRACED

    def lacks(self, capability: str) -> bool:
        """The flex path's backend declares it does not have ``capability`` (a `BackendCapabilities` flag)."""
        return self.flex and self.caps is not None and not getattr(self.caps, capability)

    @property
    def sink(self) -> bool:
        return self.settings.use_sink_attention or self.facts.softmax_type in ("learnable", "off-by-one")

    @property
    def may_pack(self) -> bool:
        return self.facts.packed is not False

    @property
    def may_dense(self) -> bool:
        return self.facts.packed is not True

    def fields(self) -> dict[str, object]:
        caps = self.caps
        return {
            "layer": self.facts.layer_number,
            "mask": self.settings.turbo_flex_attention_mask_mod,
            "mask_why": self.mask_proof.reason if self.mask_proof else "",
            "score": self.settings.turbo_flex_attention_score_mod,
            "score_why": self.score_proof.reason if self.score_proof else "",
            "problem": self.backend_problem,
            "dense_entry": caps.dense_entry if caps else None,
            "packed_entry": caps.packed_entry if caps else None,
            "window": self.window,
            "cp": self.facts.context_parallel_size,
            "tp": self.facts.tensor_model_parallel_size,
            "head_dim": self.facts.head_dim,
            "head_dim_v": self.facts.head_dim_v if self.facts.head_dim_v is not None else self.facts.head_dim,
            "heads": self.facts.num_heads,
            "kv_heads": self.facts.num_kv_heads if self.facts.num_kv_heads is not None else self.facts.num_heads,
            "seq_length": self.facts.seq_length,
            "dropout": self.facts.attention_dropout,
            "mask_type": self.facts.attn_mask_type,
            "cp_comm": self.facts.cp_comm_type,
            "alibi_masks": "; ".join(alibi_right_masks(self)),
            "documents_problem": documents_problem(self),
            "documents_fix": documents_fix(self),
            "direct_dense": self.direct.dense if self.direct else None,
            "direct_packed": self.direct.packed if self.direct else None,
            "dynamic": "; ".join(dynamic_hooks(self)),
            "learned": self.learned,
            "learned_plain": self.learned_plain,
            "hook_range": self.hook_range,
            "torch_call_mask": self.torch_call.get("mask_mod", ""),
            "torch_call_score": self.torch_call.get("score_mod", ""),
            "window_given": short_repr(self.facts.window_size),
            "skip_freq": short_repr(self.facts.skip_freq_unused),
            "window_unused": self.facts.window_unused,
            "skip_freq_window": (f": the window here is sink_sliding_window {self.settings.sink_sliding_window}, whose "
                                 "layers follow sink_window_even_layers_only" if self.settings.sink_sliding_window else ""),
            "packed_given": short_repr(self.packed_given),
            "packed_type": type(self.packed_given).__name__,
            "packed_declared": self.settings.packed_sequences,
            "arch": self.arch,
            "backend": self.backend,
            "dtype": self.facts.dtype,
        }


@dataclass(frozen=True)
class Rule:
    """One refusal: ``fails(input)`` is True when the configuration cannot run exactly."""

    code: str
    settings: Tuple[str, ...]
    reason: str
    alternative: str
    fails: Callable[[RuleInput], bool]

    def render(self, ctx: RuleInput) -> Reason:
        fields = ctx.fields()
        return Reason(self.settings, self.reason.format(**fields), self.alternative.format(**fields), self.code)


def window_bounds(window: object) -> Optional[Tuple[int, int]]:
    """A model config's ``window_size`` as a tuple, read once (an iterator is consumed by reading); None when it is
    not two ints, each -1 (unbounded) or >= 0."""
    try:
        bounds = tuple(window)  # type: ignore[call-overload]
    except TypeError:
        return None
    if len(bounds) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) and x >= -1 for x in bounds):
        return None
    return bounds  # type: ignore[return-value]


def packing_conflict(c: "RuleInput") -> str:
    """How the model config's ``packed`` disagrees with the ``packed_sequences`` setting: 'type', 'sources' or ''."""
    given, declared = c.packed_given, c.settings.packed_sequences
    if given is not None and not isinstance(given, bool):  # a TransformerConfig attribute, unchecked
        return "type"
    if given is not None and declared is not None and given is not declared:
        return "sources"
    return ""


def documents_problem(c: "RuleInput") -> str:
    """Why this layer cannot run Megatron's document mask on the varlen kernel, or ''."""
    if c.flex and (c.settings.turbo_flex_attention_mask_mod or c.settings.turbo_flex_attention_score_mod):
        return "this layer has a mask_mod / score_mod hook, which the varlen kernel does not take"
    if not c.facts.causal:
        return (f"this layer is not causal (attn_mask_type={c.facts.attn_mask_type}), while Megatron's document "
                "mask is")
    if c.settings.packed_equal_documents:
        return ("packed_equal_documents declares documents of one length, which the documents of Megatron's mask "
                "(and the empty tail of its fixed-size boundaries) are not")
    packed = c.caps.packed_entry if c.flex and c.caps is not None else (
        c.direct.packed if not c.flex and c.direct is not None else "")
    if packed is None:
        return "the installed Primus-Turbo has no packed (varlen) entry for this layer"
    return ""


def documents_fix(c: "RuleInput") -> str:
    """What lets this layer keep Megatron's documents, for the problem `documents_problem` names."""
    if c.flex and (c.settings.turbo_flex_attention_mask_mod or c.settings.turbo_flex_attention_score_mod):
        return ("remove the hooks on this layer (document masking is built in), or set reset_attention_mask: false "
                "to train the hooks without documents.")
    if not c.facts.causal:
        return "make the layer causal (attn_mask_type causal), or set reset_attention_mask: false."
    if c.settings.packed_equal_documents:
        return "set packed_equal_documents: false, or reset_attention_mask: false."
    return ("run the layer where a packed (varlen) entry exists (enable_turbo_attention_float8: false: fp8 has "
            "none), or set reset_attention_mask: false.")


def alibi_right_masks(c: "RuleInput") -> list[str]:
    """The masks of this layer's calls that reach right of the diagonal (where CK's ALiBi is symmetric)."""
    inside = pattern_from_flash_args(c.facts.causal, c.window or (-1, -1))
    proof = c.mask_proof
    dense = proof.pattern if proof is not None and proof.pattern is not None else inside
    found = []
    if c.may_dense and dense.right != 0:
        found.append(f"dense: {dense.describe()}")
    if c.may_pack and inside.right != 0:
        found.append(f"packed: {inside.describe()}")
    return found


def dynamic_hooks(c: "RuleInput") -> list[str]:
    """The hooks outside the provable subset, with the construct and its line."""
    found = []
    for kind, proof, key in (("mask_mod", c.mask_proof, "turbo_flex_attention_mask_mod"),
                             ("score_mod", c.score_proof, "turbo_flex_attention_score_mod")):
        if proof is not None and proof.outside is not None:
            found.append(f"the {kind} {getattr(c.settings, key)} uses {proof.outside.describe()}")
    return found


__all__ = ["Rule", "RuleInput", "alibi_right_masks", "documents_fix", "documents_problem", "dynamic_hooks",
           "packing_conflict", "window_bounds"]
