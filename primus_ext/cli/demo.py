"""``primus-ext demo [CONFIG.yaml] [--steps N]``: show that the flex path trains.

Builds a tiny real megatron-core GPT on CPU (one gloo process), trains it on a
synthetic corpus through the flex path with a progress bar, then trains the same
model from the same seed on the same batches through the direct path
(``use_turbo_flex_attention: false``).  Without Primus-Turbo the direct path runs on
`primus_ext.testing.fake_primus_turbo`, and the output says so.  Prints the plan of
every layer and the largest relative loss difference between the two runs; exit 0
when it is below `PARITY_TOLERANCE`, 1 when it is not, 2 when the config is refused.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib.resources
import math
import sys
import time
from typing import Any, Iterator, Mapping, Optional

import torch
import yaml

from ..backends import turbo_import_problem
from ..errors import PrimusExtError, UnsupportedConfigError
from ..settings import TurboAttentionSettings
from . import demo_model as dm

PARITY_TOLERANCE = 1e-5
DEFAULT_NAME = "demo.yaml"


def load_config(path: Optional[str]) -> tuple[dict, str]:
    """The YAML mapping and a label of where it came from (the embedded default when None)."""
    if path is None:
        text = importlib.resources.files(__package__).joinpath(DEFAULT_NAME).read_text(encoding="utf-8")
        origin = "embedded default (same as configs/examples/demo.yaml)"
    else:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        origin = path
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise PrimusExtError(f"{origin} is not valid YAML: {exc}") from exc
    if not isinstance(data, Mapping):
        raise PrimusExtError(f"{origin} must hold a mapping of keys, got {type(data).__name__}")
    return dict(data), origin


# -- progress ------------------------------------------------------------------------
class _Progress:
    """A tqdm bar (step, loss, tokens/s); a plain line every few steps without tqdm."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.tokens, self.seconds = label, total, 0, 0.0
        try:
            from tqdm import tqdm
        except ImportError:
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
            print(f"{self.label:<6} step {step}/{self.total} loss={loss:.4f} {rate:,.0f} tok/s", flush=True)

    def close(self) -> float:
        if self.bar is not None:
            self.bar.close()
        return self.tokens / max(self.seconds, 1e-9)


def _run(label: str, config: Any, settings: TurboAttentionSettings, batches: list, opts: dm.DemoOptions,
         seq_length: int, device: torch.device) -> tuple[list[float], list[Any]]:
    model = dm.build_gpt(config, settings, vocab_size=opts.vocab_size, seq_length=seq_length,
                         seed=opts.seed, device=device)
    progress = _Progress(label, len(batches))
    start = time.perf_counter()
    try:
        losses = dm.train(model, batches, opts.lr, device, progress)
    finally:
        rate = progress.close()
    print(f"{label} path: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps "
          f"({rate:,.0f} tokens/s, {time.perf_counter() - start:.1f} s)", flush=True)
    return losses, dm.layer_plans(model)


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


def parity(flex: list[float], direct: list[float]) -> float:
    """The largest ``|flex - direct| / |direct|`` over the steps (inf if a loss is not finite)."""
    if not all(math.isfinite(x) for x in (*flex, *direct)):
        return math.inf
    return max(abs(f - d) / max(abs(d), 1e-12) for f, d in zip(flex, direct))


def run_demo(path: Optional[str] = None, steps: Optional[int] = None) -> int:
    config, origin = load_config(path)
    try:
        settings = TurboAttentionSettings.from_dict(config)
    except UnsupportedConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    if not (settings.use_turbo_attention and settings.use_turbo_flex_attention):
        print("primus-ext demo: the demo trains on the flex path and compares it with the direct path; "
              "set use_turbo_attention: true and use_turbo_flex_attention: true", file=sys.stderr)
        return 2
    seq_length = int(config.get("seq_length") or 0)
    if seq_length < 2:
        raise PrimusExtError("the demo needs seq_length >= 2 in the YAML")
    opts = dm.DemoOptions.from_mapping(config.get("demo"), seq_length)
    if steps is not None:
        if steps < 1:
            raise PrimusExtError(f"--steps must be >= 1, got {steps}")
        opts = dataclasses.replace(opts, steps=steps)
    packed = bool(config.get("packed_sequences"))

    real_turbo = not turbo_import_problem()
    device = torch.device("cuda" if real_turbo and torch.cuda.is_available() else "cpu")
    direct_settings = settings.replace(use_turbo_flex_attention=False)
    # An explicit `turbo` flex backend cannot load without Primus-Turbo; give it the fake too.
    flex_on_fake = not real_turbo and settings.turbo_flex_attention_backend == "turbo"

    batches = dm.make_batches(opts, opts.steps, packed=packed, seq_length=seq_length)
    cfg = dm.transformer_config(config)
    half = "bf16" if cfg.bf16 else "fp16" if cfg.fp16 else ""
    if device.type == "cpu":  # CPU kernels here are float32 ones; the YAML's half precision is a GPU's
        cfg.bf16 = cfg.fp16 = False
    precision = (f"float32 (the YAML's {half} applies on a GPU)" if half and device.type == "cpu"
                 else half or "float32")
    layout = (f"THD packed, {batches[0].num_tokens} tokens/step in ~{batches[0].documents} documents"
              if packed else f"dense {tuple(batches[0].tokens.shape)} per step")
    print(f"primus-ext demo: {origin}")
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
                flex_losses, plans = _run("flex", cfg, settings, batches, opts, seq_length, device)
                _print_kernels("flex", fake)
            print("flex plans:")
            for plan in plans:
                print(f"  {plan.describe()}")
            print("direct path: Primus-Turbo flash_attn_* " + ("(real)" if real_turbo else "(CPU fake)"),
                  flush=True)
            with _maybe_fake(not real_turbo) as fake:
                direct_losses, direct_plans = _run("direct", cfg, direct_settings, batches, opts, seq_length, device)
                _print_kernels("direct", fake)
    except UnsupportedConfigError as exc:
        # Rebuilt from its reasons: megatron-core appends "when instantiating ..." to the text.
        print(UnsupportedConfigError(list(exc.reasons), context=exc.context), file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)

    unlike = [f.layer_number for f, d in zip(plans, direct_plans)
              if f.pattern != d.pattern or f.score_hook is not None]
    if unlike:
        print(f"note: layer(s) {', '.join(map(str, unlike))} run a mask or score hook on the flex path that the "
              "direct path cannot express, so the two runs compute different attention")
    gap = parity(flex_losses, direct_losses)
    print(f"parity: max relative loss difference flex vs direct = {gap:.2e} (steps {len(flex_losses)})")
    if gap < PARITY_TOLERANCE:
        return 0
    worst = max(range(len(flex_losses)), key=lambda i: abs(flex_losses[i] - direct_losses[i]))
    print(f"MISMATCH: not below the tolerance {PARITY_TOLERANCE:g}; worst at step {worst + 1}: "
          f"flex {flex_losses[worst]!r} vs direct {direct_losses[worst]!r}", file=sys.stderr)
    return 1


__all__ = ["PARITY_TOLERANCE", "load_config", "parity", "run_demo"]
