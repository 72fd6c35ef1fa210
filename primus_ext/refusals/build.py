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
SETTING_HOOK_UNUSED = build_rule(
    "setting-hook-unused", ("{hook}", "use_turbo_flex_attention"),
    "{hook} is set but use_turbo_flex_attention is false: the direct path (and Megatron's own attention) runs no "
    "hook, so the layers would not compute the attention the hook describes.",
    "set use_turbo_flex_attention: true (with use_turbo_attention: true) to run the hook, or set {hook}: null for "
    "a run without it.")
SETTING_UNKNOWN = build_rule("setting-unknown", ("{key}",), "unknown Turbo attention key `{key}`{hint}",
                             "{alternative}")

# -- hook strings resolved (`primus_ext.settings.hooks`; what a config may name, `hook_trust`) --------------
HOOK_UNRESOLVED = build_rule("B2", ("{setting}", "{kwargs_key}"), "{setting} = {spec}: {what}", "{alternative}")
HOOK_UNTRUSTED = build_rule("B32", ("{setting}", "{kwargs_key}"), "{setting} = {spec}: {what}", "{alternative}")

# -- YAML files and Primus experiments read (`primus_ext.settings.yaml_file`, `primus_config`) ----------------
YAML_FILE = build_rule("yaml-file", ("{path}",), "the file {what}.", "{alternative}")
YAML_NESTED = build_rule(
    "yaml-nested", ("{outer}",),
    "{outer}: holds {inner}, keys read only at the top level of a Megatron YAML (a Primus experiment's overrides "
    "live under modules.<module>.overrides); nested there they would be ignored.",
    "write them at the top level of the file, or check the Primus experiment the block belongs to "
    "(primus-ext check exp.yaml --primus-root PATH).")
PRIMUS_EXPERIMENT = build_rule("primus-experiment", ("{key}",), "{what}", "{alternative}")

PRIMUS_IGNORED_TOP = build_rule(
    "primus-ignored", ("{key}",),
    "{key}: {value} is at the top level of the experiment, where Primus reads only {top}; this run's layers get "
    "{key}: {merged} ({source}).",
    "move it under modules.{module}.overrides, which Primus applies last.")
PRIMUS_IGNORED_PRESET = build_rule(
    "primus-ignored", ("modules.{module}.{key}",),
    "modules.{module}.{key}: {value} is written beside config: / model:, where Primus keeps it only if the module "
    "preset lacks the key, and the presets set it; this run's layers get {key}: {merged} ({source}).",
    "move it under modules.{module}.overrides, which Primus applies over the presets.")
PRIMUS_IGNORED_MODEL = build_rule(
    "primus-ignored", ("{key}",),
    "{key}: {value} in the model file {file} is dropped: Primus adds a model file's key only where the module file "
    "lacks it, and the module file sets it; this run's layers get {key}: {merged} ({source}).",
    "set it under modules.{module}.overrides, which Primus applies over both files.")

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
MODEL_KEY_LOOKALIKE = build_rule(
    "model-key", ("{key}",), "{key} is not a key megatron-core or primus_ext reads, and looks like {suggestion}; as "
    "written it is ignored and {suggestion} keeps {value}.", "rename it to {suggestion}, or remove it.")
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
# -- the Primus patch's condition (`primus_ext.primus.patch`) ------------------------------------------------
PRIMUS_NO_TURBO = build_rule(
    "primus-enable", ("use_turbo_flex_attention",),
    "primus_turbo is not importable in this environment: Primus's {patch} then does not install its spec provider, "
    "and the layers would be TransformerEngine's, not primus_ext's.",
    "run in Primus's ROCm container, where Primus-Turbo is installed (docs/primus.md).")
PRIMUS_MEGATRON_VERSION = build_rule(
    "primus-enable", ("use_turbo_flex_attention",),
    "Primus reports megatron-core {version}, and its {patch} applies only below 0.17: its spec provider would not "
    "be installed, and the layers would not be primus_ext's.",
    "use the Megatron-LM that Primus bundles (megatron-core 0.16), or Megatron's own spec argument with "
    "primus_ext.primus.specs (no patch).")
PRIMUS_PROVIDER = build_rule(
    "primus-provider", ("use_turbo_flex_attention",),
    "Primus's spec provider ({provider}) was not found ({error}); the patch could not make it build primus_ext's "
    "attention, and Primus would train with its own.",
    "use a Primus version with that spec provider (docs/primus.md), or Megatron's own spec argument with "
    "primus_ext.primus.specs (no patch).")

# -- primus_ext's specs for Megatron's spec argument (`primus_ext.primus.specs`) -----------------------------
SPEC_FOREIGN_MODEL = build_rule(
    "primus-spec", ("{key}", "spec"),
    "spec: [primus_ext.primus.specs, {name}] with {key}={value}: {what}; primus_ext's spec is a dense GPT layer, so "
    "the model would not be the one the config describes.", "{alternative}")
SPEC_NO_ARGS = build_rule(
    "primus-spec", ("spec",),
    "primus_ext.primus.specs.{name} is built from Megatron-LM's parsed arguments (megatron.training.get_args()), "
    "and none are set in this process.",
    "use it as Megatron's spec: argument, where the builder asks for it after parsing; in code, build a layer spec "
    "with primus_ext.megatron.get_gpt_layer_primus_turbo_local_spec(settings, **kwargs).")
SPEC_LOST_KEYS = build_rule(
    "primus-spec", ("{*lost}", "spec"),
    "megatron-core's {function} takes no {lost_text}, which this run sets: the layers would be built without them.",
    "remove spec: and use the patch (python -m primus_ext.primus), whose provider builds with Megatron's own spec "
    "functions.")
SPEC_NO_TE = build_rule(
    "primus-spec", ("spec",),
    "primus_ext.primus.specs.{name} needs TransformerEngine, which does not import here ({error}).",
    "use spec: [primus_ext.primus.specs, gpt_layer_local_spec], or run where TransformerEngine is installed "
    "(Primus's containers).")

# -- the launcher's check of the built model (`primus_ext.primus.layer_check`) -------------------------------
FOREIGN_LAYERS = build_rule(
    "primus-layers", ("use_turbo_flex_attention",),
    "use_turbo_flex_attention is true, but {count} of the model's {total} attention layers were built with another "
    "core attention ({kinds}): {shown}. Something between the patch and the model (a patch filter, a later patch, a "
    "spec, another spec provider) built them another way, and training would run an attention the config did not "
    "ask for.",
    "launch through python -m primus_ext.primus with PRIMUS_PATCHES unset (shell and the experiment's env: block), "
    "no spec: key other than primus_ext.primus.specs, and check the run with primus-ext check (docs/primus.md); or "
    "set use_turbo_flex_attention: false to train with Primus's own attention.")
UNKNOWN_FLAG = build_rule(
    "primus-layers", ("use_turbo_flex_attention", "--config"),
    "the model's attention layers are not primus_ext's, and nothing tells whether this run asks for them: "
    "primus_ext's patch condition did not run, no Megatron args are set, and the command line has no --config "
    "experiment to read use_turbo_flex_attention from.",
    "launch Primus's own command line (primus/cli/main.py train pretrain --config exp.yaml) through python -m "
    "primus_ext.primus, or launch without it where primus_ext's layers are not wanted.")

TURBO_OFF = build_rule(
    "turbo-off", ("{key}", "use_turbo_attention"),
    "{key}: {value} is set, but use_turbo_attention and use_turbo_flex_attention are false: Megatron's own core "
    "attention runs, which has no {what}, so the key would be ignored.",
    "set use_turbo_attention: true (the direct Turbo path) to use it, or remove {key}.")

# -- Megatron's modules and their checkpoints (`primus_ext.megatron`) ------------------------------------------
TP_RANK = build_rule(
    "tp-rank", ("tensor_model_parallel_size",),
    "this rank is tensor-parallel rank {rank}, but tensor_model_parallel_size={size}: the layer's heads and the head "
    "index its hooks see would be another rank's.",
    "initialise megatron-core's parallel state with the config's tensor_model_parallel_size.")
CP_GROUP = build_rule(
    "B22", ("context_parallel_size",), "{why}",
    "initialise megatron-core's parallel state with the config's context_parallel_size "
    "(parallel_state.initialize_model_parallel(..., context_parallel_size=N)), or pass a pg_collection whose cp "
    "group has that many ranks.")
HIDDEN_NOT_DIVISIBLE = build_rule(
    "hidden-heads", ("hidden_size", "num_attention_heads", "kv_channels"),
    "hidden_size {hidden} is not a multiple of num_attention_heads {heads}, and kv_channels is not set: Megatron-LM "
    "refuses it (megatron-core would round the head dim down to {rounded}).",
    "set kv_channels to the head dim, or a hidden_size that the heads divide.")
PIPELINE_LAYERS = build_rule(
    "pipeline-layers", ("num_layers", "pipeline_model_parallel_size"),
    "num_layers {layers} is not a multiple of pipeline_model_parallel_size {stages}: megatron-core refuses to "
    "build the stages' layers (get_num_layers_to_build).",
    "set num_layers to a multiple of pipeline_model_parallel_size, or give Megatron an uneven split "
    "(num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage).")
PARAMS_DTYPE = build_rule(
    "params-dtype", ("params_dtype", "bf16", "fp16"),
    "params_dtype: {given} is not what Megatron-LM trains in: its argument check sets params_dtype from bf16 / fp16 "
    "({derived} here), whatever the YAML says.",
    "choose the dtype with bf16 / fp16 (bf16: true for bf16, fp16: true for fp16, both false for fp32) and leave "
    "params_dtype out.")
MEGATRON_CONFIG = build_rule(
    "megatron-config", ("{*named}",), "megatron-core's TransformerConfig refuses these model keys: {error}",
    "change the keys named so that megatron-core's condition above holds (docs/yaml_reference.md says what each "
    "key takes).")
GQA_OFF = build_rule(
    "gqa-off", ("num_query_groups", "group_query_attention"),
    "num_query_groups: {groups} is not applied: group_query_attention is false, and Megatron-LM then passes no "
    "num_query_groups, so each of the {heads} query heads gets its own key-value head.",
    "set group_query_attention: true to train with {groups} key-value groups, or remove num_query_groups.")
BOTH_PRECISIONS = build_rule(
    "megatron-config", ("bf16", "fp16"), "bf16 and fp16 are both true: Megatron-LM asserts one precision.",
    "keep one: bf16: true (and fp16: false) for bf16 training, fp16: true (and bf16: false) for fp16.")
CHECKPOINT_TP_SPLIT = build_rule(
    "primus-checkpoint-tp", ("tensor_model_parallel_size", "num_attention_heads"),
    "{heads} sink entries cannot be split into {tp_size} tensor-parallel slices (rank {tp_rank}).",
    "choose a tensor_model_parallel_size that divides num_attention_heads.")
CHECKPOINT_TP = build_rule("primus-checkpoint-tp", ("{setting}",), "{what}", "{alternative}")
CHECKPOINT_FORMAT = build_rule("primus-checkpoint-format", ("{setting}",), "{what}", "{alternative}")
CHECKPOINT_SINKS = build_rule("primus-checkpoint-sinks", ("{setting}",), "{what}", "{alternative}")

# -- the installed Primus-Turbo's entries, read by signature (`primus_ext.backends.capabilities`) ---------------
SINK_ENTRY = build_rule(
    "sink-entry", ("use_sink_attention",),
    "a learned sink is configured but the {where} kernel entry `{entry}` of the installed Primus-Turbo has no `sink` "
    "parameter.", "upgrade Primus-Turbo to a build whose entry takes `sink`, or set use_sink_attention: false.")
DETERMINISTIC_ENTRY = build_rule(
    "deterministic-entry", ("deterministic_mode",),
    "deterministic_mode is on but the {where} kernel entry `{entry}` has no `deterministic` parameter, so "
    "determinism cannot be requested from it.",
    "use a Primus-Turbo build whose flex entries take `deterministic`, set turbo_flex_attention_backend: reference, "
    "or set deterministic_mode: false.")

# -- which kernel takes a layer's calls on the target arch (`primus_ext.backends.dispatch`, `primus_ext.plan.routes`)
ROUTE_BLOCKED = build_rule("B33", ("{*names}",), "{what}: {problem}.", "{ways}")
ARCH_NOT_DEVICE = build_rule(
    "B33", ("turbo_arch",),
    "turbo_arch: {setting}, but this device is {device}; the plan would check {setting}'s kernel dispatch while "
    "{device}'s kernels run.", "set turbo_arch: auto (or {device}) on this machine.")
SELFTEST_FAILED = build_rule(
    "B33", ("turbo_selftest",),
    "the self-test of route [{route}] (kernels: {kernels}) failed: {error} (forward {forward}, backward {backward}).",
    "report it with the route; set turbo_flex_attention_backend: reference meanwhile, or turbo_selftest: false to "
    "train anyway.")


# -- a layer built for a backend object its caller gave (`primus_ext.call.adapter`) ---------------------------
BACKEND_NOT_GIVEN = build_rule(
    "backend-given", ("backend",),
    "the plan was built for the {backend} backend object its caller passed to build_plan(..., backend=), and this "
    "call site was given none: another backend of that name would not be the one the plan checked.",
    "pass the same object: TurboFlexAttention(plan, backend=<the object given to build_plan>).")

# -- the command line (`primus_ext.cli`) ---------------------------------------------------------------------
CLI_OPTION = build_rule("cli-option", ("{option}",), "{what}.", "{alternative}")
MODEL_KEYS_UNREAD = build_rule("model-key", ("{path}",), "cannot read the model keys of {path}: {error}",
                               "write the model keys as a Megatron YAML gives them (primus-ext check names each).")
DEMO_KEY = build_rule("demo-key", ("{key}",), "{what}.", "{alternative}")


__all__ = sorted(name for name, value in dict(globals()).items() if isinstance(value, Refusal))
