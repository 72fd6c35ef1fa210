"""`build_plan`: settings + layer facts -> an `AttentionPlan`, or every reason it can't be."""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional, Tuple

import torch

from ..attention.heads import head_range, mask_on_heads, score_on_heads
from ..attention.pattern import pattern_from_flash_args
from ..hooks.crosscheck import as_torch_calls, range_problem, torch_call_problem
from ..attention.library import is_library_mask
from ..hooks.proof import MaskProof, ScoreProof, prove_mask, prove_score
from ..backends import AttentionBackend, make_backend, select_backend, turbo_import_problem
from ..backends.base import HOOKS_PROVEN, BackendCapabilities
from ..backends.dispatch import DENSE, VARLEN, Selection, TurboBuild
from ..backends.flex_masks import learned_tables
from ..backends.direct import DirectEntries, choose_direct
from ..backends.turbo import kernel_build, kernel_selection, load_ops
from .. import refusals as R
from ..errors import Reason, UnsupportedConfigError
from ..settings import TurboAttentionSettings
from ..settings.hooks import resolve_hooks
from .facts import LayerFacts
from .plan import AttentionPlan
from .routes import arch_reasons, describe_routes, layer_routes, resolve_arch, route_reasons
from .rule_input import window_bounds
from .rules import ALIBI_FORMS, RuleInput, failing_reasons

log = logging.getLogger("primus_ext")


def layer_window(settings: TurboAttentionSettings, facts: LayerFacts) -> Optional[Tuple[int, int]]:
    """The configured sliding window of this layer, flash convention, or None.

    ``sink_window_even_layers_only`` windows the odd 1-indexed Megatron layers
    (1, 3, 5, ...), i.e. the even 0-indexed ones, as GPT-OSS does (B14).
    """
    if facts.window_size is not None:
        return window_bounds(facts.window_size)  # None: refused by rule window-shape
    width = settings.sink_sliding_window
    if width > 0 and (not settings.sink_window_even_layers_only or facts.layer_number % 2 == 1):
        return (width, 0)
    return None


def _declared_packing(settings: TurboAttentionSettings, facts: LayerFacts) -> LayerFacts:
    """``facts`` with ``packed`` from the ``packed_sequences`` setting: one key, read the same way by
    ``check``, the demo and the modules.  A model config that says otherwise is refused (rules packed-type,
    packed-sources, which read the config's own value)."""
    declared = settings.packed_sequences
    if facts.packed is not None and not isinstance(facts.packed, bool):
        return dataclasses.replace(facts, packed=None)
    if declared is None or facts.packed is not None:
        return facts
    return dataclasses.replace(facts, packed=declared)


def _backend_for(settings: TurboAttentionSettings, backend: Optional[AttentionBackend]):
    """``(name, why, problem, capabilities)`` of the backend this plan will use."""
    if backend is not None:
        return backend.name, "given by the caller", "", backend.capabilities()
    name, why, problem = select_backend(settings.turbo_flex_attention_backend)
    caps: Optional[BackendCapabilities] = None
    if not problem:
        caps = make_backend(name).capabilities()
    return name, why, problem, caps


HOOK_RULES = ("B31", "B31-score", "softcap", "B35")
"""Turbo's refusals of a hook it does not compute: with ``auto`` such a layer runs on flex or reference."""


def _auto_for_hooks(settings: TurboAttentionSettings, facts: LayerFacts, chosen: tuple,
                    mask_proof: Optional[MaskProof], score_proof: Optional[ScoreProof], learned: int = 0) -> tuple:
    """``auto`` for one hook layer (docs/mask_hooks.md, the three classes): proven -> turbo where it imports;
    admitted -> flex on a GPU (a device, or ``turbo_arch`` naming one, as ``check --arch`` plans), reference
    elsewhere or where flex lacks what the layer needs; dynamic -> reference only."""
    proofs = [p for p in (mask_proof, score_proof) if p is not None]
    if not proofs:
        return chosen
    name, _, problem, caps = chosen
    reference = ("reference", "", "", make_backend("reference").capabilities())
    if any(p.outside is not None for p in proofs):
        return ("reference", "auto: a dynamic hook (outside the provable subset) runs on reference only",
                *reference[2:])
    if learned:
        return ("reference", "auto: the hooks capture tensors that require grad; autograd through the hook "
                "trains them on reference only", *reference[2:])
    if caps is not None and caps.hooks == HOOKS_PROVEN and not problem:
        ctx = RuleInput(settings=settings, facts=facts, backend=name, caps=caps, window=layer_window(settings, facts),
                        mask_proof=mask_proof, score_proof=score_proof)
        unproven = sorted({r.code for r in failing_reasons(ctx) if r.code in HOOK_RULES})
        if not unproven:
            return chosen
        what = f"a hook Primus-Turbo does not compute ({', '.join(unproven)})"
    else:
        what = "hooks, with primus_turbo not importable here"
    gpu = _gpu_target(settings, facts)
    if not gpu:
        return ("reference", f"auto: {what}; no GPU here, so exact torch math", *reference[2:])
    if facts.attention_dropout > 0.0 or settings.deterministic_mode:
        return ("reference", f"auto: {what}; flex has no dropout / deterministic backward", *reference[2:])
    return ("flex", f"auto: {what}; torch's FlexAttention on {gpu}", "", make_backend("flex").capabilities())


def _gpu_target(settings: TurboAttentionSettings, facts: LayerFacts) -> str:
    """Where a GPU is planned for ('' on none): the ROCm device or ``turbo_arch``'s, else a CUDA device; a
    layer built to run here has none without one in this process (``turbo_arch`` then names the cluster's
    arch, not this machine's: flex would refuse its first backward on the CPU, B34.flex-cpu-grad)."""
    if facts.runs_here and not torch.cuda.is_available():
        return ""
    arch, where = resolve_arch(settings.turbo_arch)
    if arch is not None:
        return where
    return "a CUDA device" if torch.cuda.is_available() else ""


def _direct_for(settings: TurboAttentionSettings, facts: LayerFacts) -> Tuple[Optional[DirectEntries], str]:
    """The direct-path entries of the installed Primus-Turbo, or why there are none."""
    problem = turbo_import_problem()
    if problem:
        return None, problem
    entries = choose_direct(load_ops(), fp8=settings.enable_turbo_attention_float8,
                            context_parallel=facts.context_parallel_size > 1)
    return entries, ""


def build_plan(
    settings: TurboAttentionSettings,
    facts: LayerFacts,
    *,
    backend: Optional[AttentionBackend] = None,
) -> AttentionPlan:
    """Decide one layer's attention; raise `UnsupportedConfigError` once with every reason.

    Hooks are imported and proven here, at model-build time, never at the first forward;
    a proof depends on no sequence length, so `primus-ext check` and the build agree.
    """
    flex = settings.use_turbo_flex_attention
    reasons: list[Reason] = []
    packed_given = facts.packed
    facts = _declared_packing(settings, facts)
    if facts.window_size is not None and not isinstance(facts.window_size, tuple):
        try:  # read once: an iterator is consumed by reading it, and the window is read more than once below
            facts = dataclasses.replace(facts, window_size=tuple(facts.window_size))
        except TypeError:
            pass  # not a sequence: refused by rule window-shape
    mask_mod = score_mod = None
    mask_proof = score_proof = None
    learned, learned_plain, ranges = 0, 0, ""
    torch_calls: dict[str, str] = {}
    direct: Optional[DirectEntries] = None
    if flex:
        name, why, problem, caps = _backend_for(settings, backend)
        try:
            mask_mod, score_mod = resolve_hooks(settings)
        except UnsupportedConfigError as exc:
            reasons.extend(exc.reasons)
        # Proven for this rank's heads, by their global index, which the hooks are then called with.
        if mask_mod is not None:
            mask_proof = prove_mask(mask_mod, num_heads=facts.num_heads, head_offset=facts.head_offset)
        if score_mod is not None:
            score_proof = prove_score(score_mod, num_heads=facts.num_heads, head_offset=facts.head_offset)
        tables = learned_tables(mask_mod, score_mod)
        learned = len(tables)
        learned_plain = sum(1 for t in tables if not isinstance(t, torch.nn.Parameter))
        ranges = _range_problems(settings, facts, {"mask_mod": mask_mod, "score_mod": score_mod})
        mask_mod = _torch_convention(mask_mod, mask_proof, "mask_mod", settings, torch_calls)
        score_mod = _torch_convention(score_mod, score_proof, "score_mod", settings, torch_calls)
        if backend is None and settings.turbo_flex_attention_backend == "auto":
            name, why, problem, caps = _auto_for_hooks(settings, facts, (name, why, problem, caps),
                                                       mask_proof, score_proof, learned)
    else:
        name, why, problem, caps = "turbo", "direct path", "", None
        if settings.use_turbo_attention or facts.turbo_module:
            direct, problem = _direct_for(settings, facts)
    window = layer_window(settings, facts)
    arch, _ = resolve_arch(settings.turbo_arch)
    ctx = RuleInput(
        settings=settings, facts=facts, backend=name, caps=caps, backend_problem=problem,
        window=window, mask_proof=mask_proof, score_proof=score_proof, direct=direct, learned=learned,
        learned_plain=learned_plain, hook_range=ranges, torch_call=torch_calls,
        packed_given=packed_given, arch=arch,
    )
    reasons.extend(failing_reasons(ctx))
    reasons.extend(arch_reasons(settings.turbo_arch))
    selection = kernel_selection(settings.use_turbo_autotune)
    build = kernel_build()
    routes = _kernel_routes(ctx, arch, mask_proof, score_proof, selection, build)
    reasons.extend(route_reasons(routes, facts.packed))
    if reasons:
        raise R.refuse_all(reasons, context=f"layer {facts.layer_number}" + (
            f", {head_range(facts.head_offset, facts.num_heads)} (this tensor-parallel rank's)"
            if facts.head_offset else ""))

    if mask_proof is not None:
        pattern = mask_proof.pattern
    else:
        pattern = pattern_from_flash_args(facts.causal, window or (-1, -1))
    plan = AttentionPlan(
        path="flex" if flex else "direct",
        backend=name,
        backend_reason=why,
        layer_number=facts.layer_number,
        causal=facts.causal,
        window=window or (-1, -1),
        pattern=pattern,
        num_heads=facts.num_heads,
        num_kv_heads=facts.kv_heads,
        head_dim=facts.head_dim,
        head_dim_v=facts.v_dim,
        sink=ctx.sink,
        dropout=facts.attention_dropout,
        deterministic=settings.deterministic_mode,
        scale=facts.softmax_scale,
        mask_hook=settings.turbo_flex_attention_mask_mod if flex else None,
        mask_recognised=_proven_text(mask_proof),
        score_hook=settings.turbo_flex_attention_score_mod if flex else None,
        score_recognised=score_proof.kind if score_proof else None,
        mask_class=_hook_class(mask_proof),
        score_class=_hook_class(score_proof),
        alibi_slopes=score_proof.alibi_slopes if score_proof and score_proof.kind in ALIBI_FORMS else None,
        dense_entry=caps.dense_entry if caps else (direct.dense if direct else None),
        packed_entry=caps.packed_entry if caps else (direct.packed if direct else None),
        packed=facts.packed,
        eod_documents=bool(settings.reset_attention_mask and facts.packed),
        mask_documents=_mask_documents(settings, facts),
        seq_length=facts.seq_length,
        mask_mod=mask_on_heads(mask_mod, facts.head_offset),
        score_mod=score_on_heads(score_mod, facts.head_offset),
        head_offset=facts.head_offset,
        hook_assumptions=(mask_proof.assumptions if mask_proof else ()) + (
            score_proof.assumptions if score_proof else ()),
        arch=arch,
        kernels=describe_routes(routes),
        selection=selection,
        turbo_build=build,
        storage=_storage(ctx, arch, routes),
        dtype=facts.dtype,
        equal_documents=settings.packed_equal_documents,
        shared_prefix=settings.packed_shared_prefix,
        bind_call=_call_binder(settings, facts, backend, name) if flex and mask_mod is None else None,
        call_flags=settings.turbo_flex_attention_call_flags,
        backend_given=backend is not None,
    )
    if flex:
        log.info("primus_ext %s", plan.describe())
    return plan


def _kernel_routes(ctx: RuleInput, arch: Optional[str], mask_proof: Optional[MaskProof],
                   score_proof: Optional[ScoreProof], selection: Selection, build: TurboBuild) -> tuple:
    """The kernel backends this layer's Turbo calls reach on ``arch`` (B33); () off Turbo."""
    direct = ctx.direct
    plain_direct = ctx.on_direct and direct is not None and (
        not ctx.settings.enable_turbo_attention_float8)
    if not (ctx.on_turbo or plain_direct):
        return ()
    return layer_routes(
        ctx.facts, arch, dense_pattern=mask_proof.pattern if (ctx.flex and mask_proof) else None,
        window=ctx.window, sink=ctx.sink, deterministic=ctx.settings.deterministic_mode,
        alibi=bool(score_proof and score_proof.kind in ALIBI_FORMS), selection=selection, build=build,
        equal_documents=ctx.settings.packed_equal_documents,
        mask_documents=_mask_documents(ctx.settings, ctx.facts), shared_prefix=ctx.settings.packed_shared_prefix)


def _mask_documents(settings: TurboAttentionSettings, facts: LayerFacts) -> bool:
    """Dense calls whose documents come in Megatron's mask (`AttentionPlan.mask_documents`)."""
    return bool(settings.reset_attention_mask) and facts.packed is not True and facts.megatron_mask


def _storage(ctx: RuleInput, arch: Optional[str], routes: tuple) -> str:
    """`AttentionPlan.storage`, decided once per layer so a compiled region sees a constant.

    On gfx942 AITER's v3 backward mishandles the strided bshd view of sbhd memory and corrupts
    gradients, so Turbo kernels get contiguous bshd there (docs/fidelity.md, fact `gfx942-strided`).
    On gfx950 FlyDSL (and HipKittens) assert contiguous sbhd q, k and v, while megatron-core's
    value (and key without RoPE) is a split view of the fused QKV (megatron-core 0.16.1
    transformer/attention.py l.1458-1461; docs/fidelity.md, fact `flydsl-contiguous`): one
    copy per tensor that is not contiguous already.  FlyDSL's varlen kernel reads q, k and v at fixed
    strides whatever their own (docs/fidelity.md, fact `flydsl-varlen-strides`), and its gate reads each
    call's boundaries (any equal-document batch, one document included): wherever a varlen route may
    reach it, packed q, k and v are made contiguous (``contiguous-thd``; a dense call whose documents
    are flattened onto the varlen kernel gets contiguous sbhd, whose flattening is contiguous).  AITER
    takes the zero-copy strided views.  fp8 attention asserts contiguous inputs on every arch.
    """
    if not (ctx.on_turbo or ctx.on_direct):
        return "as-given"
    if arch == "gfx942" or (ctx.on_direct and ctx.settings.enable_turbo_attention_float8):
        # the fp8 Triton attention asserts contiguous inputs (attention_triton_impl.py l.74-78 at a6a16cd)
        return "contiguous-bshd"
    if any(found.backend in ("FlyDSL", "HipKittens") and (found.features.entry == DENSE or kind.startswith("dense"))
           for kind, found in routes):
        return "contiguous-sbhd"
    if any(found.features.entry == VARLEN and found.backend == "FlyDSL" for _, found in routes):
        return "contiguous-thd"
    return "as-given"


def _call_binder(settings: TurboAttentionSettings, facts: LayerFacts, backend: Optional[AttentionBackend],
                 chosen: str) -> Callable[[bool, Tuple[int, int]], None]:
    """`AttentionPlan.bind_call`: a call's own causal / window planned like the layer's, on the layer's backend
    (``chosen``: ``auto`` is not chosen again for a call, which runs where the layer runs), memoised."""
    verdicts: dict[Tuple[bool, Tuple[int, int]], tuple] = {}
    # the call's window is the only window
    # a backend the caller gave is passed on as it is (its name need not be a setting's value)
    unwindowed = settings.replace(sink_sliding_window=0, **(
        {} if backend is not None else {"turbo_flex_attention_backend": chosen}))

    def bind(causal: bool, window: Tuple[int, int]) -> None:
        key = (causal, window)
        reasons = verdicts.get(key)
        if reasons is None:
            if causal and window != (-1, -1):
                window = (window[0], 0)  # flash_attn_func's own meaning: causal caps the right bound (B8)
            call_facts = dataclasses.replace(facts, causal=causal,
                                             window_size=None if window == (-1, -1) else window)
            try:
                build_plan(unwindowed, call_facts, backend=backend)
                reasons = ()
            except UnsupportedConfigError as exc:
                reasons = exc.reasons
            if len(verdicts) < 64:
                verdicts[key] = reasons
        if reasons:
            raise R.refuse_all(reasons, context=f"layer {facts.layer_number}, a call with causal={causal}, "
                               f"window_size={window} (the plan's rules, B34)", at_call=True)

    return bind


def _torch_convention(hook: Optional[Callable], proof: Optional[MaskProof | ScoreProof], kind: str,
                      settings: TurboAttentionSettings, problems: dict[str, str]) -> Optional[Callable]:
    """A user hook is called as torch calls it, under ``torch.vmap`` with 0-d indices, wherever primus_ext
    evaluates it: a hook that tells the calls apart (a type check; a narrow table meeting a 0-d tensor, which
    promotes differently on broadcast grids) computes what torch's FlexAttention would, and is refused
    (rules torch-call and torch-call-score, from what this adds to ``problems``)."""
    if hook is None or proof is None or is_library_mask(hook):
        return hook
    problem = torch_call_problem(hook, kind)
    if problem:
        problems[kind] = f"the {kind} {getattr(settings, f'turbo_flex_attention_{kind}')} {problem}"
        return hook
    return as_torch_calls(hook, kind)


def _range_problems(settings: TurboAttentionSettings, facts: LayerFacts, hooks: dict[str, Optional[Callable]]) -> str:
    """Each hook's `range_problem` over the layer's heads, for rule hook-range ('' if none)."""
    found = [f"the {kind} {getattr(settings, f'turbo_flex_attention_{kind}')} {problem}"
             for kind, hook in hooks.items() if hook is not None and not is_library_mask(hook)
             for problem in [range_problem(hook, kind, facts.head_offset, facts.num_heads)]
             if problem]
    return "; ".join(found)


def _hook_class(proof: Optional[MaskProof | ScoreProof]) -> Optional[str]:
    """What `check` shows of a hook: proven, admitted, or dynamic with the construct and its line."""
    if proof is None:
        return None
    return f"dynamic: {proof.outside.describe()}" if proof.outside is not None else proof.hook_class


def _proven_text(proof: Optional[MaskProof]) -> Optional[str]:
    if proof is None:
        return None
    return proof.pattern.describe() if proof.pattern is not None else "custom (evaluated exactly)"


__all__ = ["build_plan", "layer_window"]
