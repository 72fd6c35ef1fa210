"""``primus-ext demo [CONFIG.yaml] [--steps N]``: show that the flex path trains.

Builds a tiny real megatron-core GPT on CPU (one gloo process), trains it on a
synthetic corpus through the flex path with a progress bar, then trains the same
model from the same seed on the same batches through a second implementation of the
same attention (`_partner`): the direct path (``use_turbo_flex_attention: false``), the
exact ``reference`` backend, or, for a hook only ``reference`` ran, torch's own
flex_attention (the ``flex`` backend; loss only on the CPU, where it has no backward).
Without Primus-Turbo the direct path runs on `primus_ext.testing.fake_primus_turbo`, and
the output says so.  Prints the plan of every layer and the largest relative loss and
gradient differences between the two runs; exit 0 when they are below `LOSS_TOLERANCE`
and `GRAD_TOLERANCE`, 1 when they are not, 2 when the config is refused.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib.resources
import math
import sys
import time
import warnings
from typing import Any, Iterator, Mapping, Optional

import torch
import yaml

from ..backends import turbo_import_problem
from ..backends.arch import device_arch
from .. import refusals as R
from ..errors import UnsupportedConfigError, UnsupportedInputError
from ..settings import TurboAttentionSettings
from ..settings.yaml_file import load_yaml_mapping
from . import demo_model as dm
from .check import _plans, _refusal_text
from .config_input import read_input

LOSS_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-4
"""Per step, from identical parameters: float32 rounding of two attention implementations
stays near 1e-6 on the loss and 1e-5 on a gradient; an attention that differs is far above."""
DEFAULT_NAME = "demo.yaml"
FLEX = "torch-flex"
"""The partner of a hook only the reference backend ran: the same model on the ``flex`` backend."""
FORWARD_ONLY = "forward only: torch's flex_attention has no CPU backward"
IMPLEMENTATIONS = {
    "direct": "Primus-Turbo flash_attn_*",
    "reference": "the exact reference backend",
    FLEX: "torch's flex_attention",
    "dense-mask": "megatron-core's dense reset_attention_mask mask",
}
"""What each comparison partner computes attention with, for the parity line."""


def load_config(path: Optional[str]) -> tuple[dict, str]:
    """The YAML mapping and a label of where it came from (the embedded default when None)."""
    if path is None:
        text = importlib.resources.files(__package__).joinpath(DEFAULT_NAME).read_text(encoding="utf-8")
        origin = "embedded default (same as configs/examples/demo.yaml)"
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise R.refuse_build(R.YAML_FILE, path=origin, what=f"is not valid YAML: {exc}",
                                 alternative="fix the YAML syntax.") from exc
        return dict(data), origin
    return load_yaml_mapping(path, allow_empty=False), path


# -- progress ------------------------------------------------------------------------
class _Progress:
    """A tqdm bar (step, loss, tokens/s) on a terminal; a plain line every few steps in a log, a pipe or
    without tqdm."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.tokens, self.seconds = label, total, 0, 0.0
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
            return
        if not sys.stdout.isatty():  # a bar redrawn with \r is noise in a log or a pipe: plain lines there
            self.bar = None
        else:
            self.bar = tqdm(total=total, desc=f"{label:<6}", unit="step", file=sys.stdout, leave=True,
                            bar_format="{desc} {bar:24} {n_fmt}/{total_fmt} [{elapsed}{postfix}]")

    def __call__(self, step: int, loss: float, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds
        rate = self.tokens / max(self.seconds, 1e-9)
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss={loss:.4f}, {rate:,.0f} tok/s", refresh=False)
            self.bar.update(1)
        elif step == self.total or step % max(1, self.total // 5) == 0:
            print(f"{self.label:<6} step {step}/{self.total} loss={loss:.4f}, {rate:,.0f} tok/s", flush=True)

    def close(self, failed: bool = False) -> float:
        """The tokens per second so far; a failed run's bar is wiped, so the error starts its own line."""
        if self.bar is not None:
            self.bar.leave = not failed
            self.bar.close()
        return self.tokens / max(self.seconds, 1e-9)


def _model(config: Any, settings: TurboAttentionSettings, opts: dm.DemoOptions, seq_length: int,
           device: torch.device, core_attention: Any = None) -> Any:
    """The demo's GPT from ``opts.seed``: the same weights for every run (a refused plan raises here)."""
    vocab = opts.vocab_size + (1 if opts.eod_documents else 0)  # the EOD token is one past the corpus
    return dm.build_gpt(config, settings, vocab_size=vocab, seq_length=seq_length,
                        seed=opts.seed, device=device, core_attention=core_attention)


def _run(label: str, model: Any, batches: list, opts: dm.DemoOptions, device: torch.device,
         replay: Optional[list] = None, forward_only: bool = False) -> list[Any]:
    progress = _Progress(label, len(batches))
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():  # torch's note on eager flex_attention: on the CPU there is no other
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            steps = dm.train(model, batches, opts.lr, device, progress, replay=replay, backward=not forward_only)
    except BaseException:
        progress.close(failed=True)
        raise
    rate = progress.close()
    each = ", each from the flex run's parameters" if replay is not None else ""
    each += ", forward only (no gradients)" if forward_only else ""
    print(f"{label} path: loss {steps[0].loss:.4f} -> {steps[-1].loss:.4f} over {len(steps)} steps{each} "
          f"({rate:,.0f} tokens/s, {time.perf_counter() - start:.1f} s)", flush=True)
    return steps


def _partner(plans: list[Any], settings: TurboAttentionSettings, cfg: Any) -> tuple[str, Any, Any, str]:
    """What the flex run is compared with: ``(label, settings, config, why)``; label "" when nothing can be.

    The direct path when it computes the same attention (also for a hook proven to be a
    causal window, given to it as ``window_size``); otherwise the exact ``reference`` backend,
    unless the flex run already ran on it: then torch's flex_attention (`FLEX`, the ``flex``
    backend), the one other implementation of any hook here (`run_demo` says "nothing" when
    the plan refuses the hook on it).
    """
    hooked = any(p.mask_hook or p.score_hook for p in plans)
    if not hooked and settings.packed_shared_prefix and settings.turbo_arch == "auto" and not device_arch():
        return FLEX, settings.replace(turbo_flex_attention_backend="flex"), cfg, (
            "shared-prefix layers on Primus-Turbo bind the kernel pairs of a known arch, and none is known here "
            "(B37-arch); the same model on the flex backend (turbo_flex_attention_backend: flex) is the second "
            "implementation")
    if not hooked:
        return "direct", settings.replace(use_turbo_flex_attention=False), cfg, ""
    patterns = {p.pattern for p in plans}
    pattern = next(iter(patterns))
    if len(patterns) == 1 and pattern is not None and not pattern.documents and pattern.right == 0 \
            and not any(p.score_hook for p in plans):
        plain = settings.replace(use_turbo_flex_attention=False, turbo_flex_attention_mask_mod=None,
                                 turbo_flex_attention_mask_mod_kwargs=None)
        window = None if pattern.window == (-1, 0) else pattern.window
        return "direct", plain, dataclasses.replace(cfg, window_size=window), (
            f"the hook is proven {pattern.describe()}, which the direct path runs as window_size")
    if all(p.backend == "reference" for p in plans):
        return FLEX, settings.replace(turbo_flex_attention_backend="flex"), cfg, (
            "the hook ran on the exact reference backend; the same model on the flex backend "
            "(turbo_flex_attention_backend: flex) is its second implementation")
    return "reference", settings.replace(turbo_flex_attention_backend="reference"), cfg, (
        "the direct path cannot express the hook, so the exact reference backend is the comparison")


def _refused_direct(exc: Any) -> str:
    """Why there is nothing to compare with when the direct path refuses a layer the flex run trained."""
    reasons = " ".join(f"{r.reason} ({r.code})" if r.code else r.reason for r in exc.reasons)
    return ("the direct path (use_turbo_flex_attention: false), the comparison, refuses this layer here, while the "
            f"flex run trained it: {reasons}")


def _refused_by_flex(exc: Any) -> str:
    """Why there is nothing to compare with when the flex backend refuses the hook: its reasons."""
    reasons = " ".join(f"{r.reason} ({r.code})" if r.code else r.reason for r in exc.reasons)
    return ("the hook runs on the exact reference backend, its only implementation here: torch's flex_attention, "
            f"the second one, refuses it: {reasons}")


@contextlib.contextmanager
def _maybe_fake(use: bool) -> Iterator[Any]:
    if not use:
        yield None
        return
    from ..testing import fake_primus_turbo

    with fake_primus_turbo() as fake:
        yield fake


def _print_kernels(label: str, fake: Any) -> None:
    """Which fake Primus-Turbo entries ran (forward calls), so a reader sees the path taken."""
    if fake is not None:
        used = collections.Counter(c.entry for c in fake.calls)
        print(f"{label} kernels: " + (", ".join(f"{name} x{n}" for name, n in sorted(used.items())) or "none"))


def parity(flex: list[Any], other: list[Any]) -> tuple[float, Optional[float], int]:
    """``(loss gap, gradient gap, worst step)`` of two runs compared step by step.

    Both started each step from the same parameters (`dm.train` with ``replay``), so a gap is
    the two attention implementations' difference on that step alone.  The loss gap is
    ``|a - b| / |b|``; the gradient gap is the largest ``||ga - gb|| / ||gb||`` over the
    parameters, None when ``other`` computed no gradients (forward only).  inf when a number
    is not finite.
    """
    worst, worst_step, grads_seen = (0.0, 0.0), 0, False
    for i, (a, b) in enumerate(zip(flex, other)):
        if not (math.isfinite(a.loss) and math.isfinite(b.loss)):
            return math.inf, math.inf if b.grads else None, i + 1
        loss_gap = abs(a.loss - b.loss) / max(abs(b.loss), 1e-12)
        grad_gap = max((((a.grads[n] - g).norm() / g.norm().clamp_min(1e-12)).item() for n, g in b.grads.items()),
                       default=0.0)
        grads_seen = grads_seen or bool(b.grads)
        if max(loss_gap / LOSS_TOLERANCE, grad_gap / GRAD_TOLERANCE) > max(
                worst[0] / LOSS_TOLERANCE, worst[1] / GRAD_TOLERANCE):
            worst_step = i + 1
        worst = (max(worst[0], loss_gap), max(worst[1], grad_gap))
    return worst[0], worst[1] if grads_seen else None, worst_step


def _flex_run_on(plans: list[Any], fake: bool) -> str:
    """What the flex run computed attention with: its layers' backends."""
    backends = sorted({p.backend for p in plans})
    return "/".join(backends) + (" backend" if len(backends) == 1 else " backends") + (
        " on the CPU fake" if fake and "turbo" in backends else "")


def _trains_here(model: Any, device: torch.device) -> None:
    """Refuse, before the first step, a flex run whose layers cannot take a backward on this device."""
    flex = [plan.layer_number for plan in dm.layer_plans(model) if plan.backend == "flex"]
    if flex and device.type == "cpu":
        raise R.refuse_build(R.DEMO_KEY, key="turbo_flex_attention_backend", what=(
            f"layers {', '.join(map(str, flex))} run on the flex backend, and torch's flex_attention has no CPU "
            "backward, so the demo cannot train them on this machine (no GPU)"),
            alternative="set turbo_flex_attention_backend: reference (or auto, which picks it on a CPU), or run "
                        "the demo on a GPU.")


def run_demo(path: Optional[str] = None, steps: Optional[int] = None, primus_root: Optional[str] = None) -> int:
    """Train the demo model of ``path`` (read as ``check`` reads it: `config_input.read_input`) and compare."""
    found = read_input(path, sys.stdout, sys.stderr, primus_root=primus_root,
                       default=load_config(None) if path is None else None)
    if isinstance(found, int):
        return found
    config, settings, origin = found.config, found.settings, found.path
    if found.fragment:
        print(found.idle + " For the demo, run configs/examples/demo.yaml.")
        return 0
    if not (settings.use_turbo_attention and settings.use_turbo_flex_attention):
        print("primus-ext demo: the demo trains on the flex path and compares it with the direct path; "
              "set use_turbo_attention: true and use_turbo_flex_attention: true", file=sys.stderr)
        return 2
    seq_length = int(config.get("seq_length") or 0)
    if seq_length < 2:
        raise R.refuse_build(R.DEMO_KEY, key="seq_length", what="the demo needs seq_length >= 2 in the YAML",
                             alternative="set seq_length: 64 or more.")
    opts = dm.DemoOptions.from_mapping(config.get("demo"), seq_length)
    if steps is not None:
        if steps < 1:
            raise R.refuse_option(R.CLI_OPTION, option="--steps", what=f"--steps must be >= 1, got {steps}",
                                 alternative="give a step count such as --steps 20.")
        opts = dataclasses.replace(opts, steps=steps)
    packed = bool(config.get("packed_sequences"))
    given = config.get("demo") or {}
    if not packed and "tokens_per_step" in given and opts.tokens_per_step % seq_length:  # dense rows are whole
        raise R.refuse_build(R.DEMO_KEY, key="demo.tokens_per_step", what=(
            f"demo.tokens_per_step {opts.tokens_per_step} is not a whole number of dense rows of seq_length "
            f"{seq_length}: the demo would train {max(1, opts.tokens_per_step // seq_length) * seq_length} tokens a "
            "step"), alternative=f"give a multiple of seq_length, such as demo.tokens_per_step: {4 * seq_length}, or "
            "train packed (packed_sequences: true), where a step holds exactly tokens_per_step tokens.")

    real_turbo = not turbo_import_problem()
    device = torch.device("cuda" if real_turbo and torch.cuda.is_available() else "cpu")
    # An explicit `turbo` flex backend cannot load without Primus-Turbo; give it the fake too.
    flex_on_fake = not real_turbo and settings.turbo_flex_attention_backend == "turbo"
    with _maybe_fake(flex_on_fake):
        refused = [(layer, o) for layer, o in _plans(settings, config) if isinstance(o, UnsupportedConfigError)]
    if refused:  # what check refuses, the demo does not train: the same plans, before any model is built
        print("\n".join(_refusal_text(refused)), file=sys.stderr)
        return 2

    dense_mask_batches: Optional[list] = None
    if opts.eod_documents:
        if not (settings.reset_attention_mask and packed):
            print("primus-ext demo: demo.eod_documents trains on EOD-separated documents converted to packed THD; "
                  "set reset_attention_mask: true and packed_sequences: true", file=sys.stderr)
            return 2
        from .demo_eod import eod_batches

        batches, dense_mask_batches = eod_batches(opts, opts.steps, seq_length)
    elif settings.reset_attention_mask and not packed:  # the demo's dense rows carry no Megatron document mask
        raise R.refuse_build(R.DEMO_KEY, key="reset_attention_mask", what=(
            "reset_attention_mask: true trains separate documents, and the demo's rows carry documents only with "
            "demo.eod_documents: true (EOD-separated rows, converted to packed THD); its plain rows reach the layers "
            "without Megatron's document mask"), alternative=(
            "set demo: {eod_documents: true} with packed_sequences: true (as configs/examples/eod_documents.yaml "
            "does), or reset_attention_mask: false."))
    else:
        batches = dm.make_batches(opts, opts.steps, packed=packed, seq_length=seq_length)
    cfg = dm.transformer_config(config)
    half = "bf16" if cfg.bf16 else "fp16" if cfg.fp16 else ""
    if device.type == "cpu":  # CPU kernels here are float32 ones; the YAML's half precision is a GPU's
        cfg.bf16 = cfg.fp16 = False
    precision = (f"float32 (the YAML's {half} applies on a GPU)" if half and device.type == "cpu"
                 else half or "float32")
    layout = (f"THD packed, {batches[0].num_tokens} tokens/step in ~{batches[0].documents} documents"
              if packed else f"dense {tuple(batches[0].tokens.shape)} per step")
    if dense_mask_batches is not None:
        layout = (f"EOD-separated documents in {tuple(dense_mask_batches[0].tokens.shape)} rows, converted to "
                  f"packed THD (~{batches[0].documents} documents per step)")
    print(f"primus-ext demo: {origin}")
    unused = dm.unused_keys(config)
    if unused:
        print(f"not used by the demo's tiny GPT (it is built from the attention and model-shape keys only): "
              f"{', '.join(unused)}")
    print(f"model: megatron-core GPT, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.num_attention_heads} heads / {cfg.num_query_groups} query groups, vocab {opts.vocab_size}, "
          f"on {device.type} in {precision}; data: counting documents, {layout}", flush=True)
    # One intra-op thread: this model's ops are tiny, and with a thread per core a step
    # stalls for up to a second whenever another process takes a core (OpenMP workers
    # wait for each other at every op).  Restored on the way out.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with dm.single_process_world():
            with _maybe_fake(flex_on_fake) as fake:
                if fake is not None:
                    print("flex path: Primus-Turbo flex entries (CPU fake)")
                model = _model(cfg, settings, opts, seq_length, device)
                _trains_here(model, device)
                flex_steps = _run("flex", model, batches, opts, device)
                _print_kernels("flex", fake)
            plans = dm.layer_plans(model)
            print("flex plans:")
            for plan in plans:
                print(f"  {plan.describe()}")
            label, other_settings, other_cfg, why = _partner(plans, settings, cfg)
            core_attention, other_batches = None, batches
            if dense_mask_batches is not None:
                from .demo_eod import DenseMaskAttention

                label, other_settings, other_cfg, core_attention, other_batches = (
                    "dense-mask", settings, cfg, DenseMaskAttention, dense_mask_batches)
                why = "megatron-core's own reset_attention_mask mask and positions, applied densely"
            # torch's flex_attention has no CPU backward: there the flex backend gives each step's loss only.
            forward_only = label == FLEX and device.type != "cuda"
            direct_on_fake = label == "direct" and not real_turbo
            with _maybe_fake(direct_on_fake) as fake:
                other = None
                try:
                    if label:
                        other = _model(other_cfg, other_settings, opts, seq_length, device, core_attention)
                except UnsupportedConfigError as exc:  # a refused partner: the config itself passed its plans
                    if label not in (FLEX, "direct"):
                        raise
                    label, why = "", (_refused_by_flex(exc) if label == FLEX else _refused_direct(exc))
                if why:
                    note = f"; {FORWARD_ONLY}" if forward_only and label else ""
                    print(f"compared with: {label or 'nothing'} ({why}{note})")
                if not label:
                    return 0
                if label == "direct":
                    print("direct path: Primus-Turbo flash_attn_* " + ("(CPU fake)" if direct_on_fake else "(real)"),
                          flush=True)
                try:
                    other_steps = _run(label, other, other_batches, opts, device, replay=flex_steps,
                                       forward_only=forward_only)
                except UnsupportedInputError as exc:  # e.g. a hook torch's flex_attention cannot trace (B34)
                    if label != FLEX:
                        raise
                    print(f"compared with: nothing ({_refused_by_flex(exc)})")
                    return 0
                _print_kernels(label, fake)
    except UnsupportedConfigError as exc:
        # Rebuilt from its reasons: megatron-core appends "when instantiating ..." to the text.
        print(R.refuse_all(exc.reasons, context=exc.context), file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)

    loss_gap, grad_gap, worst = parity(flex_steps, other_steps)
    theirs = IMPLEMENTATIONS[label] + (" on the CPU fake" if direct_on_fake else "")
    grads, note = ("n/a", f"; {FORWARD_ONLY}, gradients not compared") if grad_gap is None else (f"{grad_gap:.2e}", "")
    print(f"parity, step by step from identical parameters, flex vs {label} ({_flex_run_on(plans, flex_on_fake)} "
          f"vs {theirs}): max relative loss difference {loss_gap:.2e}, max relative gradient difference {grads} "
          f"(steps {len(flex_steps)}{note})")
    if loss_gap < LOSS_TOLERANCE and (grad_gap is None or grad_gap < GRAD_TOLERANCE):
        return 0
    print(f"MISMATCH: above the tolerances (loss {LOSS_TOLERANCE:g}, gradients {GRAD_TOLERANCE:g}); worst at "
          f"step {worst}: flex loss {flex_steps[worst - 1].loss!r} vs {label} {other_steps[worst - 1].loss!r}",
          file=sys.stderr)
    return 1


__all__ = ["FLEX", "GRAD_TOLERANCE", "LOSS_TOLERANCE", "load_config", "parity", "run_demo"]
