"""Differential fuzzing: every generated case is refused for a documented reason, or
matches the float64 oracle.  Never a third outcome.

For each case the test predicts, from the spec alone (not from primus_ext's rule
table), which build-time rules *must* refuse it and which call-time checks must, and
whether it is certain to run.  Then it runs the case:

* refused -> the exception is the project's type for that moment
  (`UnsupportedConfigError` while building, `UnsupportedInputError` at the call;
  the documented late sink refusal of a packed call is the one exception), it names
  at least one setting, its rule codes are documented in docs/refusals.md, and the
  predicted rules are among them; a case predicted to run must not be refused;
* runs -> a predicted refusal is a failure, and the output (and, for a subset, the
  gradients of q, k, v and the sink) must match `tests.fuzz.oracle`.

The ``flex`` backend (torch's FlexAttention) is run forward only here: torch's
``flex_attention`` has no CPU backward, so a ``flex`` case that checks gradients must be
refused at the call (B34.flex-cpu-grad), and the others run under ``torch.no_grad()``.

Hooks: what each generated hook provably is comes from `hook_specs`, worked out from
its definition.  A hook equal to a fixed-kernel mask (or to the identity / ALiBi with
float32 slopes) for every batch index, head and position must run on turbo and match;
any other must be refused there with B31 / B31-score; every hook matches on reference.
A module global a proof read may be changed between build and call: turbo must then
refuse the call, the reference evaluates the hook as it now reads.

Any other exception is a failure.  Counts go to the session tally printed at the end.
"""

from __future__ import annotations

import dataclasses

import contextlib
import importlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from hypothesis import given, settings as hyp_settings

from primus_ext.errors import PrimusExtError, UnsupportedConfigError, UnsupportedInputError
from primus_ext.testing.fake_turbo import fake_primus_turbo

from . import oracle, user_hooks
from .hook_specs import MaskSpec, ScoreSpec, mask_spec, score_spec
from .strategies import DTYPES, LIB, USER, Case, adapter_cases, bounds_of, megatron_cases

DOCS = Path(__file__).resolve().parents[2] / "docs" / "refusals.md"
_CALL_TABLE = DOCS.read_text().split("## Refused at call time")[1]
DOCUMENTED_CODES = frozenset(re.findall(r"^\| `([\w.-]+)` \|", DOCS.read_text(), flags=re.M)) | frozenset(
    re.findall(r"\b(B\d+(?:-[\w]+)?)\b", _CALL_TABLE.split("## Refused when a hook is resolved")[0]))
"""Codes of every table of docs/refusals.md (the build-time rule table, the call-time table, the build-time
refusals outside a layer's table), and the behaviour codes the call-time section cites."""
AWAITED = frozenset({"cp-heads"})
"""Rules predicted only when docs/refusals.md lists them (added with the CP direct path)."""
HOOK_PROBE = 8  # hooks are first called on a (2, 2, 8, 8) index grid when settings are resolved


def fuzz_settings() -> hyp_settings:
    """The profile chosen with ``--hypothesis-profile`` (``ci`` unless ``long`` was asked for)."""
    name = hyp_settings.get_current_profile_name()
    return hyp_settings.get_profile(name if name in ("ci", "long") else "ci")


FUZZ = fuzz_settings()


# ============================================================================ expectations
def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def config_window(case: Case) -> Optional[tuple[int, int]]:
    """``window_size`` of this 1-indexed layer after ``window_attn_skip_freq`` (Megatron's rule)."""
    window, freq, layer = case.layer["window_size"], case.layer["window_attn_skip_freq"], case.layer["layer_number"]
    if not window:
        return None
    if freq is not None and layer % freq == 0:
        return None
    return tuple(window)


def layer_window(case: Case) -> Optional[tuple[int, int]]:
    """The configured window of the layer: window_size, else the sink window on the layers B14 says."""
    cw = config_window(case)
    if cw is not None:
        return cw
    width = case.settings.get("sink_sliding_window", 0)
    if width > 0 and (not case.settings["sink_window_even_layers_only"] or case.layer["layer_number"] % 2 == 1):
        return (width, 0)
    return None


def layer_causal(case: Case) -> bool:
    return case.layer["attn_mask_type"] in ("causal", "causal_bottom_right")


def planned_sink(case: Case) -> bool:
    return bool(case.settings["use_sink_attention"]) or case.layer["softmax_type"] in ("learnable", "off-by-one")


def packed_fact(case: Case) -> Optional[bool]:
    """What the layer declares: `LayerFacts.packed` (adapter) or the ``packed_sequences`` key (Megatron)."""
    return case.layer.get("packed") if case.level == "adapter" else case.settings.get("packed_sequences")


def documents_from_mask(case: Case) -> bool:
    """Megatron's layer with reset_attention_mask on dense batches: its documents come in Megatron's mask."""
    return case.level == "megatron" and bool(case.settings["reset_attention_mask"]) and packed_fact(case) is not True


def megatron_documents(case: Case) -> Optional[torch.Tensor]:
    """Megatron's own document mask (``_get_ltor_masks_and_position_ids``, True = masked) of rows with
    EOD tokens at seeded positions, for a dense call of a `documents_from_mask` layer; else None."""
    c = case.call
    if not documents_from_mask(case) or c["thd"] or c["q_len"] != c["kv_len"]:
        return None
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids as megatron_ltor

    if c["batch"] == 0:
        return torch.zeros(0, 1, c["q_len"], c["kv_len"], dtype=torch.bool)
    gen = torch.Generator().manual_seed(case.seed + 1)
    rows = []
    for _ in range(c["batch"]):
        tokens = torch.randint(1, 9, (c["q_len"],), generator=gen)
        tokens[torch.rand(c["q_len"], generator=gen) < 0.2] = 0  # EOD = 0, about one token in five
        rows.append(megatron_ltor(tokens, 0, False, True, False, True)[0])
    return torch.stack(rows)


def reaches_right(allowed: torch.Tensor) -> bool:
    """A mask allowing some key right of the diagonal (kv > q), where CK's ALiBi is symmetric."""
    q_len, kv_len = allowed.shape[-2:]
    right = torch.arange(kv_len).view(1, kv_len) > torch.arange(q_len).view(q_len, 1)
    return bool((allowed & right).any())


def flash_right(causal: bool, window: tuple[int, int]) -> bool:
    """A flash-convention ``(causal, window_size)`` reaching right of the diagonal."""
    return not causal and window[1] != 0


def dense_mask_reaches_right(case: Case, mspec: Optional[MaskSpec]) -> bool:
    """The layer's dense calls reach right of the diagonal: its hook (on a 64-token grid, past
    every cut, chunk and window the fuzzer draws), else its causal flag and window."""
    if mspec is not None and case.mask_hook is not None:
        if mspec.provable is not True:
            return False  # refused on turbo by B31 (or not claimed either way): no ALiBi prediction
        module, name = hook_name(case.mask_hook)
        kwargs = case.settings.get("turbo_flex_attention_mask_mod_kwargs")
        if module == LIB:
            allowed = oracle.library_mask(name, kwargs or {}, 64, 64)
        else:
            allowed = oracle.hook_mask(hook_callable(case.mask_hook, kwargs), 1, case.layer["num_heads"], 64, 64)
        return reaches_right(allowed)
    return flash_right(layer_causal(case), layer_window(case) or (-1, -1))


def hook_name(spec: Optional[str]) -> tuple[str, str]:
    module, _, name = (spec or ":").partition(":")
    return module, name


def hook_probe_fails(case: Case) -> bool:
    """The user's documents hook indexes a tensor shorter than the 8x8 probe grid."""
    module, name = hook_name(case.mask_hook)
    return module == USER and name == "documents" and sum(
        case.settings["turbo_flex_attention_mask_mod_kwargs"]["lengths"]) < HOOK_PROBE


def case_mask_spec(case: Case) -> Optional[MaskSpec]:
    """What the flex layer's mask hook is, from its definition (None: no hook, or not flex)."""
    if not case.flex:
        return None
    return mask_spec(case.mask_hook, case.settings.get("turbo_flex_attention_mask_mod_kwargs"),
                     case.layer["num_heads"])


def case_score_spec(case: Case) -> Optional[ScoreSpec]:
    if not case.flex:
        return None
    return score_spec(case.score_hook, case.settings.get("turbo_flex_attention_score_mod_kwargs"),
                      case.layer["num_heads"])


@dataclass
class BuildExpectation:
    must: set = field(default_factory=set)
    """Rule codes that must be among the refusal's codes."""
    certain: bool = False
    """Nothing may refuse this configuration at build time."""
    routes: bool = False
    """The fake models an arch's kernel dispatch: B33 (no kernel of that arch takes a call of the layer, or one
    computes it wrongly) may refuse it on top of what is predicted (the dispatch model is not re-derived here)."""
    settings_refused: bool = False
    hook_refused: bool = False


HOOK_RULES = frozenset({"B31", "B31-score", "softcap", "B35"})
"""Primus-Turbo's refusals of a hook it does not compute."""


def resolved_backend(case: Case) -> str:
    """What ``auto`` resolves to in the fuzzer's world (no GPU): turbo where it imports, except a hook layer whose
    hooks Primus-Turbo does not compute (one of its hook rules would refuse it there), which runs on reference,
    or on flex where the fake presents a GPU arch to a layer planned for it (docs/mask_hooks.md, the three
    classes)."""
    backend = case.resolved_backend
    if not (case.flex and case.backend == "auto" and backend == "turbo" and (case.mask_hook or case.score_hook)):
        return backend
    on_turbo = expect_build(dataclasses.replace(case, backend="turbo"))
    if not on_turbo.must & (HOOK_RULES | {"torch-call", "torch-call-score"}):
        return backend
    # planned for a GPU (the fake presents an arch; an adapter-level layer is not built to run in this process,
    # as `check --arch` plans): torch's FlexAttention, unless the hook is dynamic or flex lacks what the layer needs
    specs = [spec for spec in (case_mask_spec(case), case_score_spec(case)) if spec is not None]
    if case.level == "adapter" and case.fake.get("arch") and all(spec.dynamic is False for spec in specs) and not (
            case.layer["attention_dropout"] > 0.0 or case.settings["deterministic_mode"]):
        return "flex"
    return "reference"


def expect_build(case: Case) -> BuildExpectation:
    s, layer = case.settings, case.layer
    exp = BuildExpectation()
    if s.get("sink_sliding_window", 0) < 0:
        exp.settings_refused = True
        return exp
    flex = case.flex
    turbo_path = s["use_turbo_attention"] or flex or case.level == "megatron"
    backend = resolved_backend(case) if flex else "direct"
    fake = case.fake
    on_turbo = flex and backend == "turbo" and fake is not None
    on_flex = flex and backend == "flex"  # torch's FlexAttention (docs/refusals.md: flex-*)
    on_direct = turbo_path and not flex
    packed = packed_fact(case)
    may_dense, may_pack = packed is not True, packed is not False
    fp8, cp = s["enable_turbo_attention_float8"], layer["context_parallel_size"]
    mask_docs = documents_from_mask(case)
    sink = planned_sink(case)
    window = layer_window(case)
    mask_hook, score_hook = (case.mask_hook, case.score_hook) if flex else (None, None)
    mspec, sspec = case_mask_spec(case), case_score_spec(case)
    score = sspec.kind if sspec is not None else "identity"
    rules = {
        "B3": flex and not s["use_turbo_attention"],
        "backend": flex and backend == "turbo" and fake is None,
        "heads": layer["num_heads"] % layer["num_kv_heads"] != 0,
        "dropout": not 0.0 <= layer["attention_dropout"] < 1.0,
        "direct": on_direct and fake is None,
        "mask-type": turbo_path and layer["attn_mask_type"] not in ("causal", "no_mask", "causal_bottom_right"),
        # Context parallelism is Ulysses on both paths (B22): causal and windowed layers, sinks and hooks run;
        # the exchange cannot carry dropout, fp8, packed THD, or heads not divisible by CP.
        "cp-comm": turbo_path and cp > 1 and layer["cp_comm_type"] not in (None, "a2a", "p2p", "a2a+p2p",
                                                                            "all_gather"),
        "B9": on_direct and fp8 and window is not None and window != (-1, -1),
        # A module built here has no seeded RNG tracker (the adapter's facts assume Megatron's, which seeds it).
        "B30-rng": turbo_path and case.level == "megatron" and cp > 1 and layer["attention_dropout"] > 0.0,
        "B36": turbo_path and s.get("packed_equal_documents", False) and packed is False,
        "cp-fp8": on_direct and cp > 1 and fp8,
        "cp-packed": turbo_path and cp > 1 and packed is True,
        "B24-fp8": on_direct and fp8 and s["deterministic_mode"],
        # fp8 returns bf16 and its backward asserts head dims >= 32 and even (docs/fidelity.md); the adapter's
        # facts carry no dtype, a megatron-core layer's do.
        "fp8-dtype": on_direct and fp8 and case.level == "megatron" and not layer["params_bf16"],
        "fp8-head-dim": on_direct and fp8 and any(d < 32 or d % 2 for d in (layer["head_dim"], layer["head_dim_v"])),
        # megatron-core gives a causal layer's two-sided window three meanings (B8).
        "B8": layer_causal(case) and config_window(case) is not None and window != (-1, -1) and window[1] != 0,
        "cp-heads": turbo_path and cp > 1 and bool(layer["num_heads"] % cp or layer["num_kv_heads"] % cp),
        "B13-direct": on_direct and fake is not None and sink and may_dense and fp8,
        "B13-direct-packed": on_direct and fake is not None and sink and (packed is True or mask_docs) and not fp8
        and not fake["varlen_sink"],
        "B18": on_direct and fake is not None and packed is True and fp8,
        "B10": config_window(case) is not None and s.get("sink_sliding_window", 0) > 0,
        "B10-sink": bool(s.get("use_sink_attention")) and layer["softmax_type"] == "off-by-one",
        # megatron-core applies window_attn_skip_freq to window_size only; an adapter's facts carry no such key
        "skip-freq-window": case.level == "megatron" and not layer["window_size"]
        and layer["window_attn_skip_freq"] is not None,
        "B11": flex and mask_hook is not None and window is not None,
        "B17": flex and packed is True and (mask_hook is not None or score_hook is not None),
        "B23": flex and fp8,
        # reset_attention_mask: Megatron's layers read the documents from its dense mask (varlen), at CP 1 only
        "B25": turbo_path and s["reset_attention_mask"] and packed is not True and (
            case.level != "megatron" or cp > 1),
        "B25-layer": turbo_path and mask_docs and cp == 1 and (
            bool(mask_hook or score_hook) or not layer_causal(case) or (on_direct and fp8)
            or s.get("packed_equal_documents", False)),
        "B27": turbo_path and layer["position_embedding_type"] == "alibi",
        "softcap": on_turbo and score == "softcap",
        # CK's ALiBi is symmetric right of the diagonal; with a sink the Triton kernels run (B35).
        "B35": on_turbo and score == "alibi" and not (mspec is not None and mspec.provable is not True) and (
            (may_dense and dense_mask_reaches_right(case, mspec))
            or (may_pack and flash_right(layer_causal(case), window or (-1, -1)))),
        "B31-score": on_turbo and score == "other",
        # Builds without flex entries run on flash_attn_func (which takes a sink) and
        # flash_attn_varlen_func (which takes one only where the build has varlen sinks).
        "B13": False,
        "B13-packed": on_turbo and sink and not fake["varlen_sink"] and (
            packed is True or mask_docs or (mspec is not None and mspec.provable is True and mspec.kind == "documents")),
        "sink-shape": (on_turbo or (on_direct and fake is not None)) and sink
        and not (is_pow2(layer["head_dim"]) and layer["head_dim"] == layer["head_dim_v"]),
        # Every build's flash entries take `deterministic`, and they run every pattern (B7).
        "B24": False,
        "B24-packed": False,
        # torch's FlexAttention has no dropout and no backward shown deterministic; it traces every hook,
        # so one outside the provable subset is no safer there (docs/mask_hooks.md, the three classes).
        "flex-dropout": on_flex and layer["attention_dropout"] > 0.0,
        "flex-deterministic": on_flex and bool(s["deterministic_mode"]),
        "flex-dynamic": on_flex and any(spec is not None and spec.dynamic is True and not spec.raises
                                        for spec in (mspec, sspec)),
    }
    # A rule is expected once docs/refusals.md documents it (cp-heads arrived with
    # the context-parallel direct path; before that nothing refuses those cases at build).
    exp.must = {code for code, fails in rules.items() if fails and (code not in AWAITED or code in DOCUMENTED_CODES)}
    exp.hook_refused = flex and hook_probe_fails(case)
    # B31: on turbo a mask hook runs only when proven equal to a kernel mask for every
    # batch index, head of the layer and position; otherwise it is refused at build time.
    if on_turbo and not exp.hook_refused and mspec is not None and mspec.provable is False:
        exp.must.add("B31")
    # A hook that raises when called as torch calls it (vmap over 0-d indices) means nothing any backend
    # can compute: refused on every backend, reference included (rule torch-call).
    if flex and not exp.hook_refused:
        exp.must |= {code for code, spec in (("torch-call", mspec), ("torch-call-score", sspec))
                     if spec is not None and spec.raises}
    undecided = (on_turbo and mspec is not None and mspec.provable is None) or (
        on_flex and any(spec is not None and spec.dynamic is None for spec in (mspec, sspec)))
    if case.level == "megatron" and cp > 1 and not exp.must and not exp.hook_refused and not undecided:
        # The fuzzer's world has one process, so no context-parallel group of that size: a layer planned
        # for a split the process groups do not make is refused when it is built (B22).
        exp.must = {"B22"}
    if undecided and on_turbo and case.backend == "auto":
        # auto sends a hook Primus-Turbo does not compute to reference: with its provability not claimed,
        # neither is the backend, so no turbo rule can be claimed either (the numbers are still checked).
        exp.must = set()
    exp.certain = not exp.must and not exp.hook_refused and not undecided
    exp.routes = bool(fake and fake.get("arch")) and (on_turbo or on_direct)
    return exp


def call_window(case: Case) -> tuple[bool, tuple[int, int]]:
    """``(causal, window_size)`` the call asks for (adapter level; left out, they are the plan's);
    Megatron passes the layer's own."""
    hooked = case.flex and case.mask_hook is not None
    if case.level == "megatron" or case.call["causal"] in ("layer", "default"):
        if hooked:
            return False, (-1, -1)
        return layer_causal(case), layer_window(case) or (-1, -1)
    return bool(case.call["causal"]), tuple(case.call["window"])


def flash_bounds(causal: bool, window: tuple[int, int]) -> tuple[int, int]:
    """The ``(left, right)`` bounds of a flash-convention call: ``causal`` caps the right one at 0."""
    return window[0], 0 if causal else window[1]


def drop_in(case: Case) -> bool:
    """Whether the adapter runs a call's own causal / window (the setting or the constructor argument)."""
    return case.call.get("drop_in") == "argument" or case.settings.get("turbo_flex_attention_call_flags") == "drop_in"


@dataclass
class CallExpectation:
    must: list = field(default_factory=list)
    """Why this call must be refused (empty: it must run, unless ``may`` is set)."""
    may: bool = False
    """A refusal is also acceptable (a hook whose provability the test does not claim)."""
    late_sink: bool = False
    routes: bool = False
    """B33 (the arch's kernel routes) may refuse the call, as at build."""


def on_flex_backend(case: Case) -> bool:
    """The layer runs on the ``flex`` backend (torch's flex_attention; only when asked for: ``auto`` has no GPU
    here)."""
    return case.flex and resolved_backend(case) == "flex"


ROUTE_CODES = frozenset({"B33"})


def expect_call(case: Case) -> CallExpectation:
    exp = _expect_call(case)
    exp.routes = bool(case.fake and case.fake.get("arch"))
    if no_queries(case):
        # nothing to compute: the empty result comes before any backend runs, so what only a backend refuses
        # when it computes (torch's flex without a CPU backward, a bias flex does not take, a late sink) may not
        kept = [why for why in exp.must if not why.startswith(("gradients on the CPU on flex", "a bias tensor on flex"))]
        exp.may = exp.may or len(kept) != len(exp.must)
        exp.must = kept
    return exp


def _expect_call(case: Case) -> CallExpectation:
    exp = CallExpectation()
    c = case.call
    hooked = case.flex and case.mask_hook is not None
    scored = case.flex and case.score_hook is not None
    mod, name = hook_name(case.mask_hook)
    mspec, sspec = case_mask_spec(case), case_score_spec(case)
    turbo = case.flex and resolved_backend(case) == "turbo"
    # A proven hook runs as its kernel mask on turbo; one whose proof read a module global
    # is refused there once that global changed (the reference evaluates it as it is now).
    proven = turbo and mspec is not None and mspec.provable is True
    mutated = (c.get("mutate") or {}).get("target")
    if mutated and turbo and ((proven and mspec.reads == mutated) or (
            sspec is not None and sspec.reads == mutated and sspec.kind in ("identity", "alibi", "alibi-symmetric"))):
        exp.must.append(f"{mutated}, read by a proof, changed after the build")
    if turbo and mspec is not None and mspec.provable is None:
        exp.may = True  # not claimed either way: refused at build, or runs as proven
    flex_backend = on_flex_backend(case)
    if flex_backend and case.grad:
        # every gradient case has q, k, v (or Megatron's sink parameter) requiring grad with grad enabled
        exp.must.append("gradients on the CPU on flex: torch's flex_attention has no CPU backward (B34.flex-cpu-grad)")
    if flex_backend and not c["thd"] and mspec is not None and mspec.untraceable:
        # torch traces the hook with Dynamo, whose automatic dynamic shapes make the captured int symbolic once
        # the same code ran with another value: then math.isqrt cannot be traced (B34.flex-trace), before not
        exp.may = True
    if not c["thd"] and hooked and mod == LIB and name == "packed_documents" and c["q_len"] == c["kv_len"] \
            and case.settings["turbo_flex_attention_mask_mod_kwargs"]["cu_seqlens"][-1] != c["q_len"]:
        exp.must.append("document mask of another length")
    if case.level == "adapter":
        causal, window = call_window(case)
        if c["return_attn_probs"]:
            exp.must.append("return_attn_probs")
        if c["sink"] == "unplanned" and not planned_sink(case):
            exp.must.append("sink without a planned sink")
        if c["sink"] == "none" and planned_sink(case):
            exp.must.append("a planned sink missing at the call")
        if c["thd"] and (hooked or scored or c["bias"]):
            exp.must.append("hook or bias on a packed call")
        if flex_backend and c["bias"]:
            exp.must.append("a bias tensor on flex (B34.flex)")
        if c["thd"] and turbo and (causal or window != (-1, -1)) and c["docs_q"] != c["docs_kv"]:
            exp.must.append("packed q and kv documents of different lengths on turbo")
        if not c["thd"] and hooked and (causal or window != (-1, -1)):
            exp.must.append("hook plus call causal/window")
        planned = (layer_causal(case), layer_window(case) or (-1, -1))
        if not hooked and not drop_in(case) and flash_bounds(causal, window) != flash_bounds(*planned):
            exp.must.append("a call's causal / window other than the plan's, outside drop-in mode (B34)")
        alibi_hook = sspec is not None and sspec.kind in ("alibi", "alibi-symmetric")
        if c["alibi"] and alibi_hook:
            exp.must.append("explicit alibi plus ALiBi hook")
        # On turbo the kernels' ALiBi is symmetric right of the diagonal, bottom-right aligned, and CK's plain
        # causal lse is offset: ALiBi (slope * (kv - q)) needs a mask with right bound 0, any ALiBi equal
        # lengths and no return_lse (B35); explicit slopes mean slope * (kv - q) too.
        symmetric = sspec is not None and sspec.kind == "alibi-symmetric" and not c["alibi"]
        call_right = (dense_mask_reaches_right(case, mspec) if hooked and not c["thd"]
                      else flash_right(causal, window))
        sink_passed = c["sink"] == "unplanned" or (c["sink"] == "planned" and planned_sink(case))
        if turbo and (c["alibi"] or alibi_hook) and ((call_right and not symmetric) or c["return_lse"] or (
                not c["thd"] and c["q_len"] != c["kv_len"])):
            exp.must.append("ALiBi on turbo right of the diagonal, with unequal lengths, or with return_lse (B35)")
        full = not causal and window == (-1, -1)
        if not c["thd"] and turbo and not hooked and c["q_len"] != c["kv_len"] and not full:
            exp.must.append("q_len != kv_len on turbo")
        if not c["thd"] and proven and c["q_len"] != c["kv_len"] and mspec.kind != "full":
            exp.must.append("a proven non-full hook with q_len != kv_len on turbo")
        if not c["thd"] and proven and c["bias"] and mspec.kind == "documents":
            exp.must.append("bias with a document mask on turbo (varlen kernel)")
        # packing unknown at build (packed None): a sink on a build whose varlen entry lacks it is refused at
        # the first packed call, as docs/refusals.md says
        if c["thd"] and turbo and sink_passed and case.fake is not None and not case.fake["varlen_sink"]:
            exp.late_sink = True
        return exp
    # Megatron's core attention
    fake = case.fake
    fp8, cp = case.settings["enable_turbo_attention_float8"], case.layer["context_parallel_size"]
    has_packed_entry = (not fp8) if not case.flex else True
    if c["attention_bias"]:
        exp.must.append("attention_bias")
    if documents_from_mask(case) and not c["thd"] and c["q_len"] != c["kv_len"]:
        exp.must.append("reset_attention_mask on a dense call of unequal q and kv lengths (B25.mask-shape)")
    if c["packed_params"] == "sbhd_bounds":
        exp.must.append("cu_seqlens with qkv_format sbhd")
    if c["packed_params"] in ("empty", "thd") and not has_packed_entry:
        exp.must.append("packed params without a packed entry")
    declared = case.settings.get("packed_sequences")
    if declared is not None and declared != (c["packed_params"] == "thd"):
        exp.must.append("a call of the other kind than packed_sequences declares")
    if c["thd"]:
        if c["padded"] == "different":
            exp.must.append("padded boundaries differ")
        if case.settings.get("packed_equal_documents") and len(set(c["docs_q"])) > 1 and c["packed_params"] == "thd":
            exp.must.append("packed_equal_documents with documents of several lengths (B36)")
        if hooked or scored:
            exp.must.append("hook on a packed call")
        # the direct path and the turbo backend pack on flash_attn_varlen_func (B7)
        if fake is not None and planned_sink(case) and not fake["varlen_sink"] and (not case.flex or turbo):
            exp.late_sink = True
    return exp


# ============================================================================ inputs
def exact_values(gen: torch.Generator, shape, step: float, limit: int) -> torch.Tensor:
    """Multiples of ``step`` in ``[-limit*step, limit*step]``: exact in every dtype used here."""
    return torch.randint(-limit, limit + 1, shape, generator=gen).to(torch.float64) * step


def make_qkv(case: Case, gen: torch.Generator):
    c, layer, dtype = case.call, case.layer, case.dtype
    hq, hkv, d, dv = layer["num_heads"], layer["num_kv_heads"], layer["head_dim"], layer["head_dim_v"]
    if c["thd"]:
        shapes = [(c["q_len"], hq, d), (c["kv_len"], hkv, d), (c["kv_len"], hkv, dv)]
    else:
        shapes = [(c["batch"], c["q_len"], hq, d), (c["batch"], c["kv_len"], hkv, d),
                  (c["batch"], c["kv_len"], hkv, dv)]
    if c.get("gain") is None:
        return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]
    # Large scores: q and k exact multiples of 1/4 and a power-of-two gain, so every score
    # (with the power-of-two scale the case sets) is exact in float32 and in bfloat16 inputs.
    q = exact_values(gen, shapes[0], 0.25, 8) * c["gain"]
    k = exact_values(gen, shapes[1], 0.25, 8)
    v = torch.randn(shapes[2], generator=gen, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v)]


def hook_callable(spec: str, kwargs: Optional[dict]):
    module, name = hook_name(spec)
    fn = getattr(importlib.import_module(module), name)
    return fn(**kwargs) if kwargs is not None else fn


def expected_mask(case: Case) -> torch.Tensor:
    """The mask the spec says this call computes, broadcastable to ``[B, H, Sq, Skv]`` (dense)
    or ``[Tq, Tkv]`` (packed)."""
    c = case.call
    if c["thd"]:
        causal, window = call_window(case)
        align = "top_left" if case.flex else "bottom_right"
        return oracle.packed_mask(bounds_of(c["docs_q"]), bounds_of(c["docs_kv"]), causal=causal, window=window,
                                  align=align)
    if case.flex and case.mask_hook is not None:
        module, name = hook_name(case.mask_hook)
        kwargs = case.settings.get("turbo_flex_attention_mask_mod_kwargs")
        if module == LIB:
            return oracle.library_mask(name, kwargs or {}, c["q_len"], c["kv_len"])
        return oracle.hook_mask(hook_callable(case.mask_hook, kwargs), c["batch"], case.layer["num_heads"],
                                c["q_len"], c["kv_len"])
    causal, window = call_window(case)
    align = "top_left" if case.flex else "bottom_right"
    return oracle.flash_mask(c["q_len"], c["kv_len"], causal=causal, window=window, align=align)


def score_fn(case: Case):
    if not case.flex or case.score_hook is None:
        return None
    return hook_callable(case.score_hook, case.settings.get("turbo_flex_attention_score_mod_kwargs"))


@contextlib.contextmanager
def mutated_globals(case: Case):
    """Yields a function that applies the case's mutation of a `user_hooks` global (after the
    build); whatever happens, the global is given back its original object and values."""
    m = case.call.get("mutate")
    if not m:
        yield lambda: None
        return
    target = m["target"]
    if target in user_hooks.STATE:  # class and object attributes, the environment, default arguments
        undo: list = []
        try:
            yield lambda: undo.append(user_hooks.change_state(target, m["value"]))
        finally:
            for restore in undo:
                restore()
        return
    original = getattr(user_hooks, target)
    saved = original.clone() if isinstance(original, torch.Tensor) else list(original) \
        if isinstance(original, list) else None

    def apply() -> None:
        if target == "WINDOW":
            setattr(user_hooks, target, m["value"] if m["value"] != original else original + 1)
        elif target == "BAND":
            setattr(user_hooks, target, tuple(m["value"]))  # a new object, whatever its value
        elif target == "ALIBI_LIST":
            original[m["index"]] = m["value"] if m["value"] != original[m["index"]] else m["value"] + 1.0
        else:  # tensors, changed in place (to another value: a write of the same value changes nothing)
            original[m["index"]] = m["value"] if m["value"] != float(original[m["index"]]) else m["value"] + 1

    try:
        yield apply
    finally:
        if target in ("WINDOW", "BAND"):
            setattr(user_hooks, target, original)
        elif isinstance(original, list):
            original[:] = saved
        else:
            with torch.no_grad():
                original.copy_(saved)


# ============================================================================ outcomes
class Mismatch(AssertionError):
    """The case ran and disagrees with the oracle, or the refusal contract was broken."""


@dataclass
class Ran:
    out: torch.Tensor
    lse: Optional[torch.Tensor]
    grads: dict
    want_out: torch.Tensor
    want_lse: Optional[torch.Tensor]
    want_grads: dict


def check_refusal(case: Case, err: PrimusExtError, when: str, build: BuildExpectation,
                  call: Optional[CallExpectation], tally) -> None:
    def fail(why: str) -> None:
        tally.record(case, "mismatched", why)
        raise Mismatch(f"{why}\n  refusal: {err}\n  case: {case}")

    late = when == "call" and isinstance(err, UnsupportedConfigError) and call is not None and call.late_sink
    wanted = UnsupportedConfigError if when == "build" else UnsupportedInputError
    if not isinstance(err, wanted) and not late:
        fail(f"refused at {when} time with {type(err).__name__}, expected {wanted.__name__}")
    if not err.settings:
        fail("the refusal names no setting")
    undocumented = [code for code in err.codes if code not in DOCUMENTED_CODES]
    if undocumented:
        fail(f"refused by undocumented rule codes {undocumented}")
    by_routes = set(err.codes) <= ROUTE_CODES
    if when == "build":
        if build.settings_refused or build.hook_refused:
            pass
        elif not build.must <= set(err.codes) and not (
                # the module refuses the missing CP group (B22) after the plan, which B33 refused first
                build.routes and "B33" in err.codes and build.must - set(err.codes) <= {"B22"}):
            fail(f"expected rules {sorted(build.must - set(err.codes))} among the refusal's codes {err.codes}")
        elif build.certain and not (build.routes and by_routes):
            fail(f"refused at build time although nothing should refuse it (codes {err.codes})")
    else:
        assert call is not None
        if build.must or build.settings_refused or build.hook_refused:
            fail(f"built, then refused at call time, although rules {sorted(build.must)} refuse it at build time")
        if not call.must and not call.may and not call.late_sink and not (call.routes and by_routes):
            fail("refused at call time although the call should run")
    key = ",".join(err.codes) if err.codes else "call:" + ",".join(err.settings) if when == "call" else \
        "build:" + ",".join(err.settings)
    tally.record(case, "refused", key)


def check_ran(case: Case, ran: Ran, build: BuildExpectation, call: CallExpectation, tally) -> None:
    problems = []
    if build.settings_refused or build.hook_refused or build.must:
        problems.append(f"built although it must be refused (rules {sorted(build.must)})")
    if call.must:
        problems.append(f"ran although the call must be refused ({call.must})")
    why = oracle.mismatch(ran.out, ran.want_out, oracle.OUTPUT_TOL[case.dtype])
    if why:
        problems.append(f"output: {why}")
    if ran.lse is not None and ran.want_lse is not None:
        why = oracle.mismatch(ran.lse, ran.want_lse, oracle.OUTPUT_TOL[torch.float32])
        if why:
            problems.append(f"lse: {why}")
    for name, got in ran.grads.items():
        want = ran.want_grads[name]
        dtype = got.dtype if got is not None else case.dtype
        if name == "sink" and dtype == torch.float64:
            dtype = torch.float32  # the kernels take the sink as float32 (B12): its gradient is float32 too
        if name == "sink" and case.dtype == torch.bfloat16:
            # Still fp32, but a sum over rows of dO * out, with out read as the kernel stored it,
            # in bf16 (as a flash kernel saves it): its accuracy is the inputs'.
            dtype = torch.bfloat16
        tol = oracle.GRAD_TOL[dtype]
        if case.call.get("gain") is not None:
            # Large scores: a gradient sums terms as large as the scaled q (dk = scale * dS^T q),
            # so its rounding error scales with gain * scale and with the tensor's largest entry,
            # not with each entry, which may cancel to zero (one visible key: dS = 0 exactly).
            scale = case.call.get("scale") if case.level == "adapter" else None
            scale = scale if scale is not None else case.layer["softmax_scale"]
            largest = float(want.detach().abs().max()) if want.numel() else 0.0
            factor = max(1.0, largest, case.call["gain"] * float(scale))
            tol = oracle.Tolerance(tol.atol * factor, tol.rtol)
        why = oracle.mismatch(got, want, tol) if got is not None else "no gradient"
        if why:
            problems.append(f"grad {name}: {why}")
    if problems:
        tally.record(case, "mismatched", problems[0])
        raise Mismatch("\n  ".join(["the case ran but:"] + problems + [f"case: {case}"]))
    tally.record(case, "matched", "")


def turbo_installed(case: Case):
    return fake_primus_turbo(**case.fake) if case.fake is not None else contextlib.nullcontext()


def grad_mode(case: Case):
    """A ``flex`` case that checks no gradients runs forward only, under ``torch.no_grad()`` (Megatron's
    learned sink is a parameter: with grad enabled the call would need its gradient, refused on the CPU)."""
    return torch.no_grad() if on_flex_backend(case) and not case.grad else contextlib.nullcontext()


def undecided_auto(case: Case) -> bool:
    """``auto`` on a hook whose spec allows either outcome on turbo (``MaskSpec(None)``: the prover may
    decline it): where it runs is the prover's to say, and each backend's expectations hold there."""
    spec = case_mask_spec(case)
    return case.flex and case.backend == "auto" and spec is not None and spec.provable is None


def run_case(case: Case, tally) -> None:
    build = expect_build(case)
    call = expect_call(case)
    runner = run_adapter if case.level == "adapter" else run_megatron
    stage = ["build"]
    with mutated_globals(case) as mutate:
        try:
            with turbo_installed(case), grad_mode(case):
                ran = runner(case, stage, mutate)
        except PrimusExtError as err:
            if len(stage) > 1 and undecided_auto(case):
                call = expect_call(dataclasses.replace(case, backend=stage[1]))
            check_refusal(case, err, stage[0], build, call, tally)
            return
        except Mismatch:
            raise
        except Exception as exc:
            tally.record(case, "foreign", f"{type(exc).__name__} at {stage[0]}")
            raise
        if len(stage) > 1 and undecided_auto(case):
            call = expect_call(dataclasses.replace(case, backend=stage[1]))
        check_ran(case, ran, build, call, tally)


# ============================================================================ crossings
def under_compile(case: Case, fn):
    """``fn`` as the case calls it: eager, or under ``torch.compile(fullgraph=True)`` with the case's backend
    (compiled afresh: each case's layer is another object, and Dynamo's cache would fall back to eager)."""
    if case.compiled is None:
        return fn
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=case.compiled)


def no_queries(case: Case) -> bool:
    """A call with nothing to compute (batch 0, sequence 0, no token): the reference's empty result."""
    c = case.call
    return c["batch"] == 0 or c["q_len"] == 0


def empty_oracle(refs: dict, out_shape: tuple, lse_shape: tuple):
    """The result of a call without queries, in the autograd graph of its inputs (gradients zeros)."""
    anchor = sum(t.sum() for t in refs.values()) * 0
    return refs["q"].new_zeros(out_shape) + anchor, refs["q"].new_zeros(lse_shape, dtype=torch.float32)


# ============================================================================ the adapter
def run_adapter(case: Case, stage: list, mutate) -> Ran:
    from primus_ext.call.adapter import TurboFlexAttention
    from primus_ext.plan import LayerFacts, build_plan
    from primus_ext.settings import TurboAttentionSettings

    layer, c = case.layer, case.call
    settings = TurboAttentionSettings.from_dict(case.settings)
    facts = LayerFacts(
        num_heads=layer["num_heads"], num_kv_heads=layer["num_kv_heads"], head_dim=layer["head_dim"],
        head_dim_v=layer["head_dim_v"], layer_number=layer["layer_number"], causal=layer_causal(case),
        window_size=config_window(case), softmax_scale=layer["softmax_scale"],
        attention_dropout=layer["attention_dropout"], seq_length=layer["seq_length"],
        context_parallel_size=layer["context_parallel_size"], cp_comm_type=layer["cp_comm_type"],
        position_embedding_type=layer["position_embedding_type"], softmax_type=layer["softmax_type"],
        attn_mask_type=layer["attn_mask_type"], packed=layer["packed"],
    )
    adapter = TurboFlexAttention(build_plan(settings, facts), drop_in=True if c.get("drop_in") == "argument" else None)
    stage[0] = "call"
    stage.append(adapter.plan.backend)  # where an undecided ``auto`` went (`undecided_auto`)
    mutate()

    gen = torch.Generator().manual_seed(case.seed)
    q, k, v = make_qkv(case, gen)
    hq = layer["num_heads"]
    sink = None
    if c["sink"] == "unplanned" or (c["sink"] == "planned" and planned_sink(case)):
        sink_dtype = case.dtype if c["sink_dtype"] == "same" else DTYPES[c["sink_dtype"]]
        sink = exact_values(gen, (hq,), 0.25, 8).to(sink_dtype)
    alibi = torch.tensor([user_hooks.SLOPES[h % len(user_hooks.SLOPES)] for h in range(hq)],
                         dtype=torch.float32) if c["alibi"] else None
    bias = exact_values(gen, (c["q_len"], c["kv_len"]), 0.125, 8).to(case.dtype) if c["bias"] else None
    leaves = {"q": q, "k": k, "v": v}
    if sink is not None:
        leaves["sink"] = sink
    if case.grad:
        for t in leaves.values():
            t.requires_grad_(True)
    causal, window = call_window(case)
    kwargs: dict[str, Any] = dict(dropout_p=0.0, softmax_scale=c["scale"], causal=causal, window_size=window,
                                  bias=bias, alibi_slopes=alibi, return_lse=c["return_lse"],
                                  return_attn_probs=c["return_attn_probs"], sink=sink)
    if c["causal"] == "default":  # left out: the plan's
        del kwargs["causal"], kwargs["window_size"]
    if c["thd"]:
        cu_q = torch.tensor(bounds_of(c["docs_q"]), dtype=torch.int32)
        cu_kv = cu_q if c["docs_kv"] is c["docs_q"] else torch.tensor(bounds_of(c["docs_kv"]), dtype=torch.int32)
        exact = c["max_seqlen"] == "exact"
        kwargs.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_kv,
                      max_seqlen_q=max(c["docs_q"]) if exact else None,
                      max_seqlen_k=max(c["docs_kv"]) if exact else None)
    result = under_compile(case, adapter.varlen if c["thd"] else adapter)(q, k, v, **kwargs)
    out, lse = result if c["return_lse"] else (result, None)

    scale = c["scale"] if c["scale"] is not None else layer["softmax_scale"]
    refs = {name: t.detach().to(torch.float64).requires_grad_(case.grad) for name, t in leaves.items()}
    extra = dict(scale=scale, sink=refs.get("sink"), score_fn=score_fn(case), alibi=alibi, bias=bias)
    if no_queries(case):
        lse_shape = (hq, 0) if c["thd"] else (c["batch"], hq, c["q_len"])
        want, want_lse = empty_oracle(refs, (*q.shape[:-1], v.shape[-1]), lse_shape)
    elif c["thd"]:
        want, want_lse = oracle.packed_attention(refs["q"], refs["k"], refs["v"], expected_mask(case), **extra)
    else:
        want, want_lse = oracle.attention(refs["q"], refs["k"], refs["v"], expected_mask(case), **extra)
    grads, want_grads = backward_both(case, out, want, leaves, refs, gen)
    check_lse = lse is not None and sink is None
    return Ran(out, lse if check_lse else None, grads, want, want_lse if check_lse else None, want_grads)


def backward_both(case: Case, out, want, leaves: dict, refs: dict, gen: torch.Generator):
    """Gradients of q, k, v (and the sink) for one random upstream gradient, both sides."""
    if not case.grad:
        return {}, {}
    grad_out = torch.randn(want.shape, generator=gen, dtype=torch.float64).to(out.dtype)
    out.backward(grad_out)
    want.backward(grad_out.to(torch.float64))
    return ({name: t.grad for name, t in leaves.items()}, {name: refs[name].grad for name in leaves})


# ============================================================================ Megatron
def run_megatron(case: Case, stage: list, mutate) -> Ran:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from primus_ext.megatron import PrimusTurboLocalAttention
    from primus_ext.settings import TurboAttentionSettings
    from tests.megatron import gpt

    layer, c = case.layer, case.call
    hq, hkv, d = layer["num_heads"], layer["num_kv_heads"], layer["head_dim"]
    cfg = gpt.config(num_layers=4, hidden_size=hq * d, num_attention_heads=hq, num_query_groups=hkv, kv_channels=d,
                     window_size=layer["window_size"], window_attn_skip_freq=layer["window_attn_skip_freq"],
                     softmax_type=layer["softmax_type"], context_parallel_size=layer["context_parallel_size"],
                     attention_dropout=layer["attention_dropout"], softmax_scale=layer["softmax_scale"],
                     params_dtype=torch.bfloat16 if layer["params_bf16"] else torch.float32)
    cfg.position_embedding_type = layer["position_embedding_type"]
    mask_type = AttnMaskType[layer["attn_mask_type"]]
    settings = TurboAttentionSettings.from_dict(case.settings)
    module = PrimusTurboLocalAttention(config=cfg, layer_number=layer["layer_number"], attn_mask_type=mask_type,
                                       attention_type="self", cp_comm_type=layer["cp_comm_type"], settings=settings)
    stage[0] = "call"
    stage.append(module.core.plan.backend)  # where an undecided ``auto`` went (`undecided_auto`)
    mutate()

    gen = torch.Generator().manual_seed(case.seed)
    q, k, v = make_qkv(case, gen)  # bshd / thd
    sink_param = getattr(module, "softmax_offset", None)
    if isinstance(sink_param, torch.nn.Parameter):
        with torch.no_grad():
            sink_param.copy_(exact_values(gen, (hq,), 0.25, 8))
    training = case.grad and layer["attention_dropout"] == 0.0
    module.train(training)
    if c["thd"]:
        inputs = [t.unsqueeze(1) if c["four_dim_thd"] else t for t in (q, k, v)]
    else:
        inputs = [t.transpose(0, 1).contiguous() for t in (q, k, v)]  # Megatron's sbhd
    leaves = dict(zip("qkv", inputs))
    if training:
        for t in leaves.values():
            t.requires_grad_(True)
    params = None
    cu = torch.tensor(bounds_of(c["docs_q"]), dtype=torch.int32) if c["thd"] else None
    if c["packed_params"] == "thd":
        longest = max(c["docs_q"])
        padded = {"none": None, "same": cu.clone(), "kv_clone": None,
                  "different": cu + torch.arange(cu.numel(), dtype=torch.int32)}[c["padded"]]
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu,
                                 cu_seqlens_kv=cu.clone() if c["padded"] == "kv_clone" else cu,
                                 cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
                                 max_seqlen_q=longest, max_seqlen_kv=longest)
    elif c["packed_params"] == "empty":
        params = PackedSeqParams()
    elif c["packed_params"] == "sbhd_bounds":
        bounds = torch.tensor([0, c["q_len"]], dtype=torch.int32)
        params = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds)
    bias = torch.zeros(1, hq, c["q_len"], c["kv_len"]) if c["attention_bias"] else None
    documents = megatron_documents(case)
    out = under_compile(case, module)(leaves["q"], leaves["k"], leaves["v"], documents, attn_mask_type=mask_type,
                                      attention_bias=bias, packed_seq_params=params)

    sink = sink_param  # a learned parameter, the fixed zeros of off-by-one, or None
    refs = {name: t.detach().to(torch.float64).requires_grad_(training) for name, t in zip("qkv", (q, k, v))}
    ref_sink = None
    if sink is not None:
        ref_sink = sink.detach().to(torch.float64).requires_grad_(training and isinstance(sink, torch.nn.Parameter))
    extra = dict(scale=layer["softmax_scale"], sink=ref_sink, score_fn=score_fn(case))
    if no_queries(case):
        width = hq * layer["head_dim_v"]
        shape = ((c["q_len"], 1, width) if c["four_dim_thd"] else (c["q_len"], width)) if c["thd"] else (
            c["q_len"], c["batch"], width)
        want_out, _ = empty_oracle({**refs, **({"sink": ref_sink} if ref_sink is not None else {})}, shape, (0,))
    elif c["thd"]:
        want, _ = oracle.packed_attention(refs["q"], refs["k"], refs["v"], _megatron_mask(case, documents), **extra)
        want_out = want.reshape(want.shape[0], -1)
        if c["four_dim_thd"]:
            want_out = want_out.unsqueeze(1)
    else:
        want, _ = oracle.attention(refs["q"], refs["k"], refs["v"], _megatron_mask(case, documents), **extra)
        want_out = want.transpose(0, 1).reshape(c["q_len"], c["batch"], -1)
    grads, want_grads = {}, {}
    if training:
        grad_out = torch.randn(want_out.shape, generator=gen, dtype=torch.float64)
        out.backward(grad_out.to(out.dtype))
        want_out.backward(grad_out.to(out.dtype).to(torch.float64))
        for name in "qkv":
            got = leaves[name].grad
            if not c["thd"]:
                got = got.transpose(0, 1)
            elif c["four_dim_thd"]:
                got = got.squeeze(1)
            grads[name], want_grads[name] = got, refs[name].grad
        if ref_sink is not None and ref_sink.requires_grad:
            grads["sink"], want_grads["sink"] = sink.grad, ref_sink.grad
    return Ran(out, None, grads, want_out, None, want_grads)


def _megatron_mask(case: Case, documents: Optional[torch.Tensor]) -> torch.Tensor:
    mask = expected_mask(case)
    return mask & ~documents if documents is not None else mask  # attention stays inside Megatron's documents


# ============================================================================ the tests
@FUZZ
@given(case=adapter_cases())
def test_adapter_cases_are_refused_or_match_the_oracle(case: Case, fuzz_tally):
    run_case(case, fuzz_tally)


@FUZZ
@given(case=megatron_cases())
def test_megatron_cases_are_refused_or_match_the_oracle(case: Case, fuzz_tally):
    run_case(case, fuzz_tally)
