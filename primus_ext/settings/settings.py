"""The YAML keys of the Turbo attention path, as one validated frozen dataclass.

Primus module configs are flat mappings that mix our keys with Megatron's own
(``num_layers``, ``seq_length``, ``window_size``...) and with other Primus-Turbo
switches (``use_turbo_gemm``...).  `TurboAttentionSettings` picks out our keys and
leaves every other key alone, *except* keys that look like a misspelling of ours:
a typo such as ``use_turbo_flex_atention`` would otherwise be dropped and the model
would silently run plain attention, so it is refused with a "did you mean" hint.

Validation happens on every construction path (``__init__``, `from_dict`,
`from_yaml`, `from_args`, `replace`) and collects *all* failures into a single
`UnsupportedConfigError`, so a user fixes a config in one round trip.

Hook conventions (decided here, relied on by `primus_ext.settings.hooks`):
``turbo_flex_attention_mask_mod_kwargs: null`` means the named attribute *is* the
mask_mod; a mapping (even ``{}``) means the attribute is a factory called with
those keyword arguments, e.g. ``"primus_ext.attention.masks:causal"`` with ``{}``.
Only factories marked ``@primus_ext.hook_factory`` may be called that way (B32).
"""

from __future__ import annotations

import copy
import difflib
import os
import re
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, Iterable, Mapping, Optional


from .. import refusals as R
from ..errors import Reason, short_repr

BACKEND_CHOICES: tuple[str, ...] = ("auto", "turbo", "reference", "flex")
"""``turbo_flex_attention_backend``: the one list of its choices."""
CALL_FLAG_CHOICES: tuple[str, ...] = ("plan", "drop_in")
OWNER_CHOICES: tuple[str, ...] = ("primus_ext", "primus")
"""``turbo_flex_attention_owner``: who owns ``use_turbo_flex_attention`` where Primus has its own path."""
"""``turbo_flex_attention_call_flags``: a call's causal / window_size must be the plan's, or (drop-in) are its own."""

# One ``module.path:attr.path`` made of Python identifiers; nothing else is accepted,
# because the string is only ever imported and walked, never evaluated.
_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*"
HOOK_PATTERN = re.compile(rf"^{_DOTTED}:{_DOTTED}$")

# Unknown keys starting with these are assumed to be misspellings of ours.  The broad
# ``use_turbo_`` prefix is shared with Primus's GEMM/MoE/norm switches, so it only counts
# when the key also mentions attention (``att``/``flex``/``sink``): a future Primus switch
# such as ``use_turbo_fp4_gemm`` must not stop a training run that loads our settings.
_OUR_PREFIXES: tuple[str, ...] = ("turbo_flex_attention", "sink_")
_SHARED_PREFIX = "use_turbo_"
_ATTENTION_WORDS: tuple[str, ...] = ("att", "flex", "sink")

# Keys of others that resemble ours: Primus-Turbo switches sharing the ``use_turbo_``
# prefix (GEMM, MoE, norm), Megatron attention fields, and Primus's own config keys the screen
# would take for ours (of every top-level key of Primus fd1eeab's 191 ``primus/configs`` YAMLs:
# ``modules/module_base.yaml:3`` ``sink_level``, in every module's args,
# ``modules/megatron/sft_trainer.yaml:73`` ``enable_packed_sequences``,
# ``models/megatron/deepseek_v4_base.yaml:49`` ``attn_sliding_window``).  They pass untouched.
FOREIGN_KEYS: frozenset[str] = frozenset(
    {
        "sink_level",
        "enable_packed_sequences",
        "attn_sliding_window",
        "attention_backend",
        "use_kitchen_attention",
        "kitchen_attention_backend",
        "use_turbo_gemm",
        "use_turbo_grouped_gemm",
        "use_turbo_fused_act_with_probs",
        "use_turbo_deepep",
        "use_turbo_mega_moe",
        "use_turbo_rms_norm",
        "use_turbo_norm_te_linear",
        "use_turbo_parallel_linear",
        "use_turbo_grouped_mlp",
    }
)

_SUGGEST_CUTOFF = 0.8


def _meta(doc: str, type_text: str, spec: str) -> dict[str, str]:
    return {"doc": doc, "type": type_text, "spec": spec}


@dataclass(frozen=True)
class TurboAttentionSettings:
    """Every Turbo-attention YAML key, validated; field names are the YAML keys."""

    use_turbo_attention: bool = field(default=False, metadata=_meta(
        "Route Megatron core attention to Primus-Turbo kernels (the flex path needs it, B3).",
        "bool", "B1, B3"))
    use_turbo_flex_attention: bool = field(default=False, metadata=_meta(
        "Run attention through the FlexAttention-style path (masks as mask_mods); off = unchanged.",
        "bool", "B1, B3"))
    turbo_flex_attention_mask_mod: Optional[str] = field(default=None, metadata=_meta(
        "Hook 'package.module:attr' giving mask_mod(b, h, q_idx, kv_idx) -> bool tensor.",
        "str | null", "B2, B11, B17"))
    turbo_flex_attention_mask_mod_kwargs: Optional[dict] = field(default=None, metadata=_meta(
        "If a mapping (even {}), the mask_mod hook is a @hook_factory called with these kwargs.",
        "mapping | null", "B2, B32"))
    turbo_flex_attention_score_mod: Optional[str] = field(default=None, metadata=_meta(
        "Hook 'package.module:attr' giving score_mod(score, b, h, q_idx, kv_idx) -> float tensor.",
        "str | null", "B2, B17"))
    turbo_flex_attention_score_mod_kwargs: Optional[dict] = field(default=None, metadata=_meta(
        "If a mapping (even {}), the score_mod hook is a @hook_factory called with these kwargs.",
        "mapping | null", "B2, B32"))
    turbo_flex_attention_backend: str = field(default="auto", metadata=_meta(
        "Flex backend: turbo (Primus-Turbo), reference (exact torch math), flex (torch's FlexAttention, for "
        "admitted hooks on a GPU), auto (turbo if it imports; per hook layer: flex on a GPU for admitted hooks, "
        "reference for dynamic ones).",
        "auto | turbo | reference | flex", "B7, B8"))
    turbo_flex_attention_call_flags: str = field(default="plan", metadata=_meta(
        "Whose causal / window_size a flex call runs: plan (the layer's; a call passing others is refused) or "
        "drop_in (a flash_attn_func-style call's own, checked by the layer's rules once per distinct value).",
        "plan | drop_in", "B11, B34"))
    turbo_flex_attention_owner: Optional[str] = field(default=None, metadata=_meta(
        "Under a Primus that has its own use_turbo_flex_attention path: whose flex attention the key turns on, "
        "primus_ext (its layers, through its patch) or primus (Primus's own; primus_ext stays out); null there "
        "is refused as ambiguous. Elsewhere null or primus_ext (primus is refused: no Primus path to give it to).",
        "primus_ext | primus | null", "B1"))
    turbo_arch: str = field(default="auto", metadata=_meta(
        "GPU arch the plan checks Primus-Turbo's kernel dispatch for: gfx942 (MI300), gfx950 (MI355), "
        "or auto (the device's gcnArchName on ROCm; no arch check elsewhere).",
        "auto | gfx942 | gfx950", "B33"))
    turbo_selftest: str = field(default="auto", metadata=_meta(
        "At model build, run each distinct Turbo route once against the reference backend on the "
        "device and refuse the build on disagreement: true, false, or auto (on when a GPU is present).",
        "auto | true | false", "B33"))
    use_sink_attention: bool = field(default=False, metadata=_meta(
        "GPT-OSS style learned sinks: one fp32 logit per query head joins the softmax.",
        "bool", "B12, B13, B15"))
    sink_sliding_window: int = field(default=0, metadata=_meta(
        "0 = no window; W > 0 = causal sliding window (W, 0): the token plus W to its left.",
        "int >= 0", "B10, B11, B14"))
    sink_window_even_layers_only: bool = field(default=True, metadata=_meta(
        "Apply sink_sliding_window only on 1-indexed odd layers (0-indexed even), as GPT-OSS.",
        "bool", "B14"))
    enable_turbo_attention_float8: bool = field(default=False, metadata=_meta(
        "Primus-Turbo fp8 attention (direct path only; refused on the flex path).",
        "bool", "B9, B23"))
    use_turbo_autotune: bool = field(default=False, metadata=_meta(
        "Primus's switch: Primus-Turbo times its kernel backends and keeps the fastest "
        "(PRIMUS_TURBO_AUTO_TUNE=1); the plan then holds for every attention backend autotune may keep.",
        "bool", "B33"))
    deterministic_mode: bool = field(default=False, metadata=_meta(
        "Deterministic kernels; refused when the selected entry has no 'deterministic' parameter.",
        "bool", "B24"))
    reset_attention_mask: bool = field(default=False, metadata=_meta(
        "Megatron's document boundaries after each EOD: dense batches' documents are read from Megatron's "
        "mask on the device, packed_sequences: true batches come converted (pack_eod_micro_batch); both run "
        "on the varlen kernel.",
        "bool", "B25"))
    reset_attention_mask_max_documents: Optional[int] = field(default=None, metadata=_meta(
        "The most documents one dense micro-batch holds (all rows); fixes how many boundaries the varlen "
        "kernel gets from Megatron's mask (null: one per token, always enough). More are refused.",
        "int | null", "B25"))
    packed_sequences: Optional[bool] = field(default=None, metadata=_meta(
        "How batches reach attention: true = packed THD only (cu_seqlens), false = dense only, null = "
        "either; the plan checks those calls' kernels, and a call of the other kind is refused.",
        "bool | null", "B25, B33, B34"))
    packed_equal_documents: bool = field(default=False, metadata=_meta(
        "Every packed document has the same length, max_seqlen (checked per call, without a host read of "
        "the boundaries); lets FlyDSL take packed calls on gfx950, its varlen sink included.",
        "bool", "B36"))
    packed_shared_prefix: bool = field(default=False, metadata=_meta(
        "Packed rows are RL shared-prefix rows (pack_shared_prefix: a prompt once, its responses after it): "
        "each runs as two varlen calls (documents causal, responses against their prompt) merged through "
        "their log-sum-exps; a row of plain documents runs as before.",
        "bool", "B37"))

    def __post_init__(self) -> None:
        values = {name: getattr(self, name) for name in SETTING_KEYS}
        reasons = _problems(values)
        if reasons:
            raise R.refuse_all(reasons, context="Turbo attention settings")
        for name in _KWARGS_KEYS:  # private copies: later edits of the caller's dict do not leak in
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, copy.deepcopy(dict(value)))

    def __hash__(self) -> int:
        # The kwargs are dicts (unhashable); hash a frozen rendering so settings can key caches.
        # One memo for every field: a sub-object shared by many references is frozen once.
        memo: dict[int, Any] = {}
        return hash(tuple((name, _freeze(getattr(self, name), memo)) for name in SETTING_KEYS))

    # ----------------------------------------------------------------- constructors
    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any]) -> "TurboAttentionSettings":
        """Build from a flat mapping; foreign keys are ignored, look-alikes of ours and ours nested under another
        key refused."""
        if not isinstance(mapping, Mapping):
            raise R.refuse_build(R.SETTINGS_MAPPING, got=type(mapping).__name__)
        ours = {k: v for k, v in mapping.items() if k in _KEY_SET}
        others = [k for k in mapping if k not in _KEY_SET and isinstance(k, str)]
        nested = [R.YAML_NESTED.reason_for(outer=k, inner=", ".join(x for x in mapping[k] if x in _KEY_SET))
                  for k in others if isinstance(mapping[k], Mapping) and any(x in _KEY_SET for x in mapping[k])]
        return cls._build(ours, lookalike_reasons(others) + nested)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> "TurboAttentionSettings":
        """Load a flat YAML mapping; an empty file means all defaults (`load_yaml_mapping` refuses
        non-UTF-8 files, repeated keys and non-mappings)."""
        from .yaml_file import load_yaml_mapping

        return cls.from_dict(load_yaml_mapping(path))

    @classmethod
    def from_args(cls, namespace: Any) -> "TurboAttentionSettings":
        """Read our keys from an argparse.Namespace (or any object) with getattr.

        Missing attributes take their default.  When the object exposes its attributes
        through ``vars()`` (Namespace, SimpleNamespace), look-alike keys are refused too.
        """
        ours = {k: getattr(namespace, k) for k in SETTING_KEYS if hasattr(namespace, k)}
        try:
            others = [k for k in vars(namespace) if k not in _KEY_SET]
        except TypeError:
            others = []
        return cls._build(ours, lookalike_reasons(others))

    @classmethod
    def _build(cls, ours: Mapping[str, Any], extra: list[Reason]) -> "TurboAttentionSettings":
        values = {**_DEFAULTS, **ours}
        reasons = extra + _problems(values)
        if reasons:
            raise R.refuse_all(reasons, context="Turbo attention settings")
        return cls(**values)

    # ---------------------------------------------------------------------- helpers
    def to_dict(self) -> dict[str, Any]:
        """Plain ``{key: value}`` in declaration order (kwargs deep-copied), YAML-dumpable."""
        return {name: copy.deepcopy(getattr(self, name)) for name in SETTING_KEYS}

    def replace(self, **changes: Any) -> "TurboAttentionSettings":
        """A validated copy with ``changes`` applied; every unknown key is refused."""
        unknown = [k for k in changes if k not in _KEY_SET]
        reasons = [_unknown_reason(k, _suggest(k)) for k in unknown]
        known = {k: v for k, v in changes.items() if k in _KEY_SET}
        return self._build({**self.to_dict(), **known}, reasons)


SETTING_KEYS: tuple[str, ...] = tuple(f.name for f in fields(TurboAttentionSettings))
_KEY_SET = frozenset(SETTING_KEYS)
_KWARGS_KEYS = ("turbo_flex_attention_mask_mod_kwargs", "turbo_flex_attention_score_mod_kwargs")
_DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in fields(TurboAttentionSettings) if f.default is not MISSING
}


def describe_keys() -> list[tuple[str, str, Any, str]]:
    """``(key, type text, default, one-line doc)`` per key, for the CLI and the docs."""
    return [(f.name, f.metadata["type"], f.default, f.metadata["doc"])
            for f in fields(TurboAttentionSettings)]


def spec_refs(key: str) -> str:
    """Behaviour-spec items (``"B1, B3"``) a key relates to."""
    return {f.name: f.metadata["spec"] for f in fields(TurboAttentionSettings)}[key]


# -------------------------------------------------------------------- validation
def type_name(value: Any) -> str:
    # short_repr: bounded, as the value may be an arbitrarily large YAML tree
    if isinstance(value, str):
        return f"the string {short_repr(value)}"
    if value is None:
        return "null"
    return f"{type(value).__name__} {short_repr(value)}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


ARCH_CHOICES = ("auto", "gfx942", "gfx950")
_BOOL = (lambda v: isinstance(v, bool), "true or false", "write '{key}: true' or '{key}: false' (a YAML boolean, unquoted).")


def _one_of(choices: tuple[str, ...], example: str, *, null: bool = False) -> tuple[Callable[[Any], bool], str, str]:
    return ((lambda v: (null and v is None) or (isinstance(v, str) and v in choices)),
            f"{'null, ' if null else ''}one of {', '.join(choices)}", example)


def _hook_string(value: Any) -> bool:
    return value is None or (isinstance(value, str) and bool(HOOK_PATTERN.match(value)))


_HOOK = (_hook_string, "null or a 'package.module:attr' string",
         "for example {key}: \"primus_ext.attention.masks:prefix_lm\".")
_KWARGS = (lambda v: v is None or isinstance(v, Mapping), "null or a mapping of keyword arguments",
           "for example {key}: {{prefix_length: 64}}.")
_READERS: dict[str, tuple[Callable[[Any], bool], str, str]] = {
    "turbo_flex_attention_mask_mod": _HOOK,
    "turbo_flex_attention_mask_mod_kwargs": _KWARGS,
    "turbo_flex_attention_score_mod": _HOOK,
    "turbo_flex_attention_score_mod_kwargs": _KWARGS,
    "turbo_flex_attention_backend": _one_of(BACKEND_CHOICES, "write '{key}: auto' unless you need a specific backend."),
    "turbo_flex_attention_call_flags": _one_of(
        CALL_FLAG_CHOICES, "write '{key}: plan' (calls run the layer's causal / window), or '{key}: drop_in' for "
        "calls that pass their own."),
    "turbo_flex_attention_owner": _one_of(
        OWNER_CHOICES, "write '{key}: primus_ext' (primus_ext's layers) or '{key}: primus' (Primus's own flex path), "
        "or leave it null outside a Primus that has one.", null=True),
    "turbo_arch": _one_of(ARCH_CHOICES, "write '{key}: gfx942' for MI300, 'gfx950' for MI355, or auto."),
    "turbo_selftest": (lambda v: v in ("auto", "true", "false", True, False), "auto, true or false",
                       "write '{key}: auto' (on when a GPU is present)."),
    "sink_sliding_window": (lambda v: _is_int(v) and 0 <= v <= 2 ** 31 - 1, "an integer >= 0 and below 2**31",
                            "write '{key}: 0' for no window, or a width W such as 128 (a causal window of W keys to "
                            "the left of each token)."),
    "packed_sequences": (lambda v: v is None or isinstance(v, bool), "true, false or null",
                         "write '{key}: true' (packed THD batches only), 'false' (dense only) or leave it out."),
    "reset_attention_mask_max_documents": (lambda v: v is None or (_is_int(v) and v >= 1),
                                           "null or a positive integer",
                                           "write '{key}: null' (one boundary per token), or a bound such as 64."),
}
"""Each key's typed reader: what it accepts, what the message says it must be, and a right value
(rule setting-value); a key not listed is a boolean."""


def _key_problem(key: str, value: Any) -> Optional[Reason]:
    accepts, expected, example = _READERS.get(key, _BOOL)
    if not accepts(value):
        return R.SETTING_VALUE.reason_for(key=key, expected=expected, got=type_name(value),
                                          example=example.format(key=key))
    if key.endswith("_kwargs") and value is not None:
        bad = [k for k in value if not isinstance(k, str) or not k.isidentifier()]
        if bad:
            return R.SETTING_KWARGS_NAMES.reason_for(key=key, got=short_repr(bad))
    return None


def _problems(values: Mapping[str, Any]) -> list[Reason]:
    """Per-key type checks, then the structural rules between our own keys.

    Semantic rules (B3 and the rest of the spec) belong to the plan builder, which needs
    layer facts too and reports every failing rule in one error; settings only refuse
    what is malformed, and a hook with ``use_turbo_flex_attention: false``: the direct path runs
    no hook (B1), so the layers would compute another attention than the hook describes.
    """
    reasons: list[Reason] = []
    ok: dict[str, Any] = {}
    for key in SETTING_KEYS:
        reason = _key_problem(key, values[key])
        if reason is None:
            ok[key] = values[key]
        else:
            reasons.append(reason)

    for hook in ("turbo_flex_attention_mask_mod", "turbo_flex_attention_score_mod"):
        kw = f"{hook}_kwargs"
        if ok.get(hook, "set") is None and ok.get(kw) is not None:
            reasons.append(R.SETTING_KWARGS_UNUSED.reason_for(kw=kw, hook=hook))
        if ok.get(hook) and ok.get("use_turbo_flex_attention") is False:
            reasons.append(R.SETTING_HOOK_UNUSED.reason_for(hook=hook))
    return reasons


# -------------------------------------------------------------- look-alike keys
def _suggest(key: str) -> Optional[str]:
    return max(SETTING_KEYS, key=lambda ours: _similarity(key, ours)) if key else None


def _unknown_reason(key: str, suggestion: Optional[str]) -> Reason:
    if suggestion:
        return R.SETTING_UNKNOWN.reason_for(key=key, hint=f"; did you mean `{suggestion}`?",
                                            alternative=f"rename it to `{suggestion}`, or remove it.")
    return R.SETTING_UNKNOWN.reason_for(key=key, hint=".", alternative="remove the key.")


def _similarity(a: str, b: str) -> float:
    # difflib's ratio is not symmetric; taking the lower side keeps Megatron's
    # ``use_kitchen_attention`` (0.82 one way, 0.77 the other) from passing for ours.
    return min(difflib.SequenceMatcher(None, a, b).ratio(), difflib.SequenceMatcher(None, b, a).ratio())


def _close_to(key: str, candidates: Iterable[str]) -> bool:
    return any(_similarity(key, c) >= _SUGGEST_CUTOFF for c in candidates)


def looks_like_ours(key: str) -> bool:
    """True for a key that is not ours but probably meant to be (typo or our prefix)."""
    if key in _KEY_SET or key in FOREIGN_KEYS:
        return False
    if _close_to(key, SETTING_KEYS):
        return True
    if _close_to(key, FOREIGN_KEYS):  # a typo of another Primus switch is Primus's business
        return False
    if key.startswith(_SHARED_PREFIX):
        return any(word in key for word in _ATTENTION_WORDS)
    return key.startswith(_OUR_PREFIXES)


def lookalike_reasons(keys: list[str]) -> list[Reason]:
    """One "did you mean" reason per key in ``keys`` that looks like one of ours."""
    return [_unknown_reason(k, _suggest(k)) for k in keys if looks_like_ours(k)]


def _freeze(value: Any, memo: Optional[dict[int, Any]] = None) -> Any:
    """A hashable stand-in for ``value``, equal for equal values, for `TurboAttentionSettings.__hash__`.

    A container stands in as the hash of its items' stand-ins, not as nested tuples:
    tuples do not cache their hash, so a sub-object shared by many references would be
    hashed again for each.  ``memo`` (``id -> stand-in``) freezes each distinct container
    once, so the cost is linear in the number of distinct objects, shared or not.
    """
    if not isinstance(value, (Mapping, list, tuple, set, frozenset)):
        return value
    memo = {} if memo is None else memo
    if id(value) in memo:
        return memo[id(value)]
    memo[id(value)] = "<recursive>"  # the stand-in of a container reached again from inside itself
    if isinstance(value, Mapping):  # order-free, as dict equality is
        frozen = hash(("mapping", frozenset((k, _freeze(v, memo)) for k, v in value.items())))
    elif isinstance(value, (set, frozenset)):
        frozen = hash(("set", frozenset(value)))
    else:
        frozen = hash(("sequence", tuple(_freeze(v, memo) for v in value)))
    memo[id(value)] = frozen
    return frozen


__all__ = [
    "BACKEND_CHOICES",
    "CALL_FLAG_CHOICES",
    "FOREIGN_KEYS",
    "HOOK_PATTERN",
    "SETTING_KEYS",
    "TurboAttentionSettings",
    "describe_keys",
    "lookalike_reasons",
    "looks_like_ours",
    "spec_refs",
]
