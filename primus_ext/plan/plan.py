"""`AttentionPlan`: what one layer's attention computes and how it runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Tuple

from ..attention.heads import head_range
from ..hooks.trace import Assumption
from ..attention.pattern import MaskMod, Pattern, ScoreMod
from ..backends.dispatch import BUILD_A6A16CD, DEFAULT_ORDER, Selection, TurboBuild


STORAGE = ("as-given", "contiguous-bshd", "contiguous-sbhd", "contiguous-thd")


@dataclass(frozen=True)
class AttentionPlan:
    """A frozen, hashable description of one layer's attention.

    ``pattern`` is the dense mask the layer computes, proven for every length (``None``:
    a hook that is not proven, which the reference and flex backends run, by evaluating it).  Packed (thd) calls use ``causal``/``window``
    inside each document.  The hook callables are carried along but do not take
    part in equality or hashing; their recognition results do.
    """

    path: str
    backend: str
    backend_reason: str
    layer_number: int
    causal: bool
    window: Tuple[int, int]
    pattern: Optional[Pattern]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    sink: bool = False
    dropout: float = 0.0
    deterministic: bool = False
    scale: Optional[float] = None
    mask_hook: Optional[str] = None
    mask_recognised: Optional[str] = None
    score_hook: Optional[str] = None
    score_recognised: Optional[str] = None
    mask_class: Optional[str] = None
    """The mask hook's class (docs/mask_hooks.md): ``proven``, ``admitted``, or ``dynamic: <construct>
    (<file>:<line> in <function>)``; `score_class` the same for the score hook."""
    score_class: Optional[str] = None
    alibi_slopes: Optional[Tuple[float, ...]] = None
    dense_entry: Optional[str] = None
    packed_entry: Optional[str] = None
    packed: Optional[bool] = None
    """From `LayerFacts.packed`: only thd batches (True), only dense (False), either (None)."""
    eod_documents: bool = False
    """``reset_attention_mask`` with packed batches: documents come from EOD tokens, converted to THD."""
    mask_documents: bool = False
    """``reset_attention_mask`` on dense batches: each dense call's documents are read from Megatron's
    ``[B, 1, S, S]`` mask on the device and run on the packed (varlen) entry
    (`primus_ext.megatron.document_mask`)."""
    seq_length: Optional[int] = None
    """The model's sequence length where the settings give it (`LayerFacts.seq_length`): a hook reading a
    captured per-token tensor is written for it (the self-test runs hook routes at it)."""
    mask_mod: Optional[MaskMod] = field(default=None, compare=False, repr=False)
    score_mod: Optional[ScoreMod] = field(default=None, compare=False, repr=False)
    arch: Optional[str] = None
    """The GPU arch the kernel routes were checked for (None: unknown here, not checked)."""
    kernels: Tuple[str, ...] = ()
    """Which Primus-Turbo kernel backend each kind of call reaches on ``arch`` (B33)."""
    selection: Selection = DEFAULT_ORDER
    """How Primus-Turbo picks the kernel backend of each call (a pin, autotune, the default order),
    as the installed build reported it when the layer was built; ``kernels`` hold for it."""
    turbo_build: TurboBuild = BUILD_A6A16CD
    """The Primus-Turbo build whose dispatch ``kernels`` were checked against (`primus_ext.backends.turbo_build`:
    read from the installed one's signatures; a6a16cd where none is installed)."""
    equal_documents: bool = False
    """``packed_equal_documents``: every packed call's documents have one length, ``max_seqlen``
    (checked per call, B36); packed calls are routed so."""
    shared_prefix: bool = False
    """``packed_shared_prefix``: packed rows may be shared-prefix rows (`primus_ext.call.shared_prefix`), run as
    the packed call merged with the cross call of their trees through the LSE (B37)."""
    dtype: Optional[str] = None
    """What the layer computes in (`LayerFacts.dtype`: ``bf16``, ``fp16``, ``fp32``); None if not known."""
    storage: str = "as-given"
    """How the Megatron modules store q/k/v before a Turbo kernel (`STORAGE`): as Megatron gives them (bshd views
    of sbhd memory, key and value split views), ``contiguous-bshd`` (gfx942), ``contiguous-sbhd``
    (gfx950, when FlyDSL or HipKittens can take the layer's dense calls; packed ones contiguous too) or
    ``contiguous-thd`` (gfx950, dense calls as given, packed q/k/v contiguous where FlyDSL's varlen
    kernel, which reads fixed strides, can take them); `primus_ext.backends.layout.kernel_views`,
    ``thd_views``."""
    hook_assumptions: Tuple[Assumption, ...] = field(default=(), compare=False, repr=False)
    """Values a hook proof relied on (a module global, a captured tensor): re-checked before
    each call that runs the proven pattern instead of the hook."""
    head_offset: int = 0
    """The model's (global) index of this plan's first head, tp_rank * H_tp (+ cp_rank * H_tp / CP in a
    context-parallel rank's plan): ``mask_mod`` / ``score_mod`` already add it to the local head index,
    ``pattern`` and ``alibi_slopes`` were proven for these heads (`primus_ext.attention.heads`)."""
    bind_call: Optional[Callable[[bool, Tuple[int, int]], None]] = field(default=None, compare=False, repr=False)
    """Checks a call whose own ``(causal, window_size)`` differ from the plan's against the same
    rules, once per distinct value; raises `UnsupportedInputError` with their reasons."""
    call_flags: str = "plan"
    backend_given: bool = False
    """The plan was built for a backend object its caller gave (``build_plan(..., backend=)``), which the calls
    must run on too: ``backend`` is that object's name, not necessarily one of the settings'."""
    """``turbo_flex_attention_call_flags``: ``plan``, a call's causal / window_size must be the plan's
    (refused otherwise, B34); ``drop_in``, a call's own are run, checked by ``bind_call`` (B11 for hooks)."""

    @property
    def flex(self) -> bool:
        return self.path == "flex"

    @property
    def gqa(self) -> bool:
        return self.num_heads != self.num_kv_heads

    @property
    def pattern_text(self) -> str:
        if self.pattern is not None:
            return self.pattern.describe()
        return "custom mask (the hook itself, on reference or flex)"

    def describe(self) -> str:
        """One line a person reads: path, backend, entry, mask, sink, heads, numerics."""
        parts = [f"layer {self.layer_number}: {self.path}"]
        if self.flex:
            parts.append(f"backend={self.backend} ({self.backend_reason})")
            dense = self.dense_entry if self.packed is not True else None  # '-': no such batches
            if self.mask_documents:
                dense = f"{self.packed_entry} (documents from attention_mask)"
            packed = self.packed_entry if self.packed is not False else None
            parts.append(f"dense={dense or '-'} packed={packed or '-'}")
        parts.append(f"mask={self.pattern_text}")
        if self.mask_hook:
            parts.append(f"mask_mod={self.mask_hook} -> {self.mask_recognised}")
        if self.score_hook:
            parts.append(f"score_mod={self.score_hook} -> {self.score_recognised}")
        if self.shared_prefix:
            parts.append("shared-prefix rows (packed + cross, merged by LSE)")
        parts.append("sink" if self.sink else "no sink")
        heads = f"heads={self.num_heads}"
        if self.gqa:
            heads += f"/{self.num_kv_heads} (GQA)"
        if self.head_offset:
            heads += f" ({head_range(self.head_offset, self.num_heads)} of the model)"
        parts.append(heads)
        parts.append(f"dropout={self.dropout:g}")
        if self.kernels:
            parts.append(f"kernels on {self.arch} (Primus-Turbo {self.turbo_build.name}): " + ", ".join(self.kernels))
        if self.deterministic:
            parts.append("deterministic")
        if self.flex and self.call_flags == "drop_in":
            parts.append("drop-in calls")
        return " | ".join(parts)


__all__ = ["AttentionPlan", "STORAGE"]
