"""Build-time refusals outside a layer's rule table: what settings, a hook, a YAML, ``check``, Primus, a
checkpoint or the self-test show before (or apart from) `primus_ext.plan.rules.RULES`.

Each is declared once here with its code, the settings it names, its wording and the alternative; a site
fills in the values (``raise refuse_build(RULE, got=...)``, or ``RULE.reason_for(...)`` where reasons are
collected and raised once by `refuse_all`).  docs/refusals.md lists every code (``tests/test_docs.py``).
"""

from __future__ import annotations

from .catalogue import Refusal, build_rule

# -- the Turbo attention keys (`primus_ext.settings.settings`) ---------------------------------------
SETTINGS_MAPPING = build_rule(
    "settings-mapping", (), "settings must be a mapping of keys to values, got {got}.",
    "write the keys as a flat YAML mapping (key: value per line).")
SETTING_VALUE = build_rule("setting-value", ("{key}",), "{key} must be {expected}, got {got}.", "{example}")
SETTING_KWARGS_NAMES = build_rule(
    "setting-kwargs-names", ("{key}",), "{key} keys must be Python identifiers (keyword-argument names); got {got}.",
    "use keyword-argument names such as prefix_length.")
SETTING_KWARGS_UNUSED = build_rule(
    "setting-kwargs-unused", ("{kw}", "{hook}"), "{kw} is set but {hook} is null, so the arguments would be ignored.",
    "name the factory in {hook}, or remove {kw}.")
SETTING_UNKNOWN = build_rule("setting-unknown", ("{key}",), "unknown Turbo attention key `{key}`{hint}.",
                             "{alternative}")

# -- hook strings resolved (`primus_ext.settings.hooks`; what a config may name, `hook_trust`) --------------
HOOK_UNRESOLVED = build_rule("B2", ("{setting}", "{kwargs_key}"), "{setting} = {spec}: {what}", "{alternative}")
HOOK_UNTRUSTED = build_rule("B32", ("{setting}", "{kwargs_key}"), "{setting} = {spec}: {what}", "{alternative}")

# -- YAML files and Primus experiments read (`primus_ext.settings.yaml_file`, `primus_config`) ----------------
YAML_FILE = build_rule("yaml-file", ("{path}",), "the file {what}.", "{alternative}")
PRIMUS_EXPERIMENT = build_rule("primus-experiment", ("{key}",), "{what}", "{alternative}")

# -- Megatron's model-shape keys as `check` reads them (`primus_ext.settings.model_keys`) --------------------
MODEL_KEY_MISSING = build_rule("model-key", ("{key}",), "{key} is not set; the plans need it (for example {key}: 8).",
                               "set {key} in the YAML.")
MODEL_KEY_MLA = build_rule(
    "model-key", ("multi_latent_attention", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"),
    "multi_latent_attention needs qk_head_dim, qk_pos_emb_head_dim and v_head_dim: its head dims come from them "
    "(for example qk_head_dim: 128, qk_pos_emb_head_dim: 64, v_head_dim: 128).",
    "set the three head dims, or multi_latent_attention: false.")
MODEL_KEY_HEAD_DIM = build_rule(
    "model-key", ("kv_channels", "hidden_size"),
    "kv_channels or hidden_size must be set: the head dim comes from one (for example kv_channels: 128).",
    "set kv_channels (the head dim) or hidden_size.")
MODEL_KEY_VALUE = build_rule("model-key", ("{key}",), "{why}; got {got}.", "write {key} as the message shows.")

# -- who owns use_turbo_flex_attention in a Primus (`primus_ext.settings.primus_owner`) ------------------------
OWNER_UNNAMED = build_rule(
    "primus-owner", ("use_turbo_flex_attention", "turbo_flex_attention_owner"),
    "this Primus has its own use_turbo_flex_attention path ({primus_flex}), and the key turns on either: with "
    "primus_ext's patch the layers are primus_ext's (its plan, hooks and refusals), without it Primus's own "
    "(Primus-Turbo's flex entries, Primus's rules). Which one would run depends on how the job is launched, not on "
    "the config.",
    "set turbo_flex_attention_owner: primus_ext (primus_ext's layers, launched through python -m primus_ext.primus) "
    "or turbo_flex_attention_owner: primus (Primus's own path; primus_ext stays out).")
OWNER_PRIMUS_WITHOUT_PATH = build_rule(
    "primus-owner", ("turbo_flex_attention_owner",),
    "turbo_flex_attention_owner is primus, and this Primus has no flex attention path of its own ({module} is not "
    "there): its attention would ignore use_turbo_flex_attention.",
    "set turbo_flex_attention_owner: primus_ext (or null) for primus_ext's layers, or use a Primus that has its own "
    "flex path.")

# -- the switches and keys of a Primus run (`primus_ext.settings.primus_config`, `primus_launch`) ----------------
PRIMUS_TURBO_OFF = build_rule(
    "primus-enable", ("enable_primus_turbo", "use_turbo_flex_attention"),
    "use_turbo_flex_attention is true but enable_primus_turbo is not: Primus then does not install its spec "
    "provider, and the layers would be built with TransformerEngine's attention, not primus_ext's.",
    "set enable_primus_turbo: true (Primus's switch) with use_turbo_attention: true.")
PATCHES_FILTERED = build_rule(
    "primus-enable", ("PRIMUS_PATCHES", "use_turbo_flex_attention"),
    "PRIMUS_PATCHES={value} ({where}) leaves out {missing}: Primus drops a filtered-out patch before any condition "
    "runs, so Primus's spec provider would not build primus_ext's attention, and the layers would be Primus's own "
    "(or TransformerEngine's).",
    "add {ours} and {provider} to PRIMUS_PATCHES, or unset it (in the shell and in the experiment's env: block).")
PRIMUS_FOREIGN_SPEC = build_rule(
    "primus-layers", ("spec", "use_turbo_flex_attention"),
    "spec={spec} names the layers' modules itself, so Primus's spec provider, which the patch makes build "
    "primus_ext's attention, builds none of them.",
    "remove spec, or name primus_ext's own: spec: [{specs}, gpt_layer_te_spec].")
PRIMUS_LOCAL_IMPL = build_rule(
    "primus-layers", ("transformer_impl", "use_turbo_flex_attention"),
    "transformer_impl is local: megatron-core builds its local layer spec (LocalSpecProvider), not through Primus's "
    "spec provider, so no layer would be primus_ext's.",
    "set transformer_impl: transformer_engine, or spec: [{specs}, gpt_layer_local_spec].")
PRIMUS_WINDOW = build_rule(
    "primus-window", ("sink_sliding_window", "use_sink_attention"),
    "sink_sliding_window={window} without use_sink_attention: Primus's attention applies that window only with "
    "sinks (none here), so the key would mean a window under primus_ext and none under Primus.",
    "set use_sink_attention: true for GPT-OSS sinks with the window, or remove sink_sliding_window (a window "
    "without sinks: a mask hook such as primus_ext.attention.masks:sliding_window).")

__all__ = sorted(name for name, value in dict(globals()).items() if isinstance(value, Refusal))
