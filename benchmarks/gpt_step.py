"""Training step time of a tiny megatron-core GPT on CPU: flex path against direct path.

The models are the ones `primus-ext demo` trains (`primus_ext.cli.demo_model`), built
from the same seed and stepped on the same batches (forward, backward, Adam step):

* ``direct``: ``use_turbo_flex_attention: false``, Megatron's direct Primus-Turbo
  entries, here the CPU fake (``flash_attn_func`` / ``flash_attn_varlen_func``);
* ``flex, reference``: the flex path on the reference backend;
* ``flex, turbo``: the flex path on the turbo backend, i.e. the same fake entries as
  ``direct``, so the two differ only by primus_ext's own layer.

``flex, reference`` computes attention with `primus_ext.backends.blockwise` (the configs
use learned sinks, so the reference backend does not take its SDPA shortcut); the fake
entries behind the other two compute with their own blockwise online softmax.  Configs:
the demo's (dense bf16 rows, sinks, a sliding window on even layers), the same model on
packed THD documents, and a deep model on short rows (24 layers, 16 tokens) where the
adapter's per-call cost is the largest share it can be; its table adds the time added
per attention call, (flex - direct) / (layers x calls per step).

Then, the compiled step: the demo model in bf16 on the CPU fake with the gfx942 dispatch
modelled, one training step eager and one under ``torch.compile`` (``aot_eager``), and
the attention forward kernel calls the fake recorded for each (goal: layers per step
compiled, not twice that), next to the same compiled step with the arch unknown (no
kernel route to bind, so the backward recomputes the forward).

Goal: flex step time <= 1.05x the direct one.

    python -m benchmarks.gpt_step [--repeats 25] [--steps 4]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

import torch

from . import _common as c

NAME = "gpt_step"
GOAL_RATIO = 1.05
DEEP_LAYERS = 24


def _configs() -> dict[str, dict[str, Any]]:
    from primus_ext.cli.demo import load_config

    demo, _ = load_config(None)
    packed = {**demo, "packed_sequences": True, "use_sink_attention": False}  # no varlen sink on most shapes
    deep = {**demo, "num_layers": DEEP_LAYERS, "seq_length": 16, "demo": {**demo["demo"], "tokens_per_step": 64,
                                                                         "max_doc_len": 16}}
    return {"demo: dense bf16 rows, sinks, window on even layers": demo,
            "packed THD documents, window on even layers": packed,
            f"{DEEP_LAYERS} layers, 16-token rows (adapter cost visible)": deep}


FORWARD_ENTRIES = ("flash_attn_func", "flash_attn_varlen_func", "attention_aiter_forward_impl",
                   "attention_aiter_varlen_forward_impl")


def compiled_forward_counts() -> list[dict[str, Any]]:
    """Attention forward kernel calls of one training step of the demo model, eager and compiled."""
    from collections import Counter

    from primus_ext.cli import demo_model as dm
    from primus_ext.cli.demo import load_config
    from primus_ext.settings import TurboAttentionSettings
    from primus_ext.testing import fake_primus_turbo

    demo, _ = load_config(None)
    seq = int(demo["seq_length"])
    opts = dm.DemoOptions.from_mapping(demo.get("demo"), seq)
    batch = dm.make_batches(opts, 1, packed=False, seq_length=seq)[0]
    rows = []
    for label, arch, compiled in (("eager", "gfx942", False), ("compiled", "gfx942", True),
                                  ("compiled, arch unknown", None, True)):
        settings = TurboAttentionSettings.from_dict({**demo, "turbo_flex_attention_backend": "turbo",
                                                     "turbo_arch": arch or "auto"})
        torch._dynamo.reset()
        with fake_primus_turbo(arch=arch, build="main") as fake:
            model = dm.build_gpt(dm.transformer_config(demo), settings, vocab_size=opts.vocab_size, seq_length=seq,
                                 seed=opts.seed, device=torch.device("cpu"))
            run = torch.compile(model, backend="aot_eager") if compiled else model

            def step() -> None:
                run(batch.tokens, batch.positions, None, labels=batch.labels).float().mean().backward()

            step()  # compiles
            fake.reset()
            step()
            calls = Counter(c.entry for c in fake.calls)
        forwards = sum(n for entry, n in calls.items() if entry in FORWARD_ENTRIES)
        layers = int(demo["num_layers"])
        rows.append({"step": label, "layers": layers, "forward_calls": forwards, "calls": dict(calls),
                     "goal_met": forwards == layers if compiled and arch else None})
    return rows


def _stepper(model: Any, batches: list, fake: Any) -> Callable[[], None]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    cycle = {"i": 0}

    def step() -> None:
        batch = batches[cycle["i"] % len(batches)]
        cycle["i"] += 1
        loss = model(batch.tokens, batch.positions, None, labels=batch.labels,
                     packed_seq_params=batch.packed_seq_params()).float().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        fake.reset()  # the fake records every kernel call; keep its log from growing

    return step


def measure(label: str, config: dict[str, Any], repeats: int, steps: int) -> dict[str, Any]:
    from primus_ext.cli import demo_model as dm
    from primus_ext.settings import TurboAttentionSettings
    from primus_ext.testing import fake_primus_turbo

    settings = TurboAttentionSettings.from_dict(config)
    variants = {
        "flex, reference": settings.replace(turbo_flex_attention_backend="reference"),
        "flex, turbo": settings.replace(turbo_flex_attention_backend="turbo"),
        "direct": settings.replace(use_turbo_flex_attention=False),
    }
    seq = int(config["seq_length"])
    opts = dm.DemoOptions.from_mapping(config.get("demo"), seq)
    packed = bool(config.get("packed_sequences"))
    batches = dm.make_batches(opts, steps, packed=packed, seq_length=seq)
    cfg = dm.transformer_config(config)
    with fake_primus_turbo() as fake:
        runners = {}
        for name, turbo in variants.items():
            model = dm.build_gpt(cfg, turbo, vocab_size=opts.vocab_size, seq_length=seq, seed=opts.seed,
                                 device=torch.device("cpu"))
            runners[name] = _stepper(model, batches, fake)
        for run in runners.values():  # warm-up: first steps allocate, verify and cache
            for _ in range(2):
                run()

        def block(run: Callable[[], None]) -> Callable[[], None]:
            return lambda: [run() for _ in range(steps)]

        timing = c.interleaved({name: block(run) for name, run in runners.items()}, repeats=repeats,
                               scale=1e3 / steps)
    tokens = batches[0].num_tokens
    return {"config": label, "tokens_per_step": tokens, "timing_ms": timing}


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=25, help="samples per path (min/median over them)")
    parser.add_argument("--steps", type=int, default=4, help="training steps per sample")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    started, env = c.begin(NAME, "tiny megatron-core GPT training step on CPU, flex path vs direct path, ms/step", args.threads)
    from primus_ext.cli import demo_model as dm

    results, rows = [], []
    with dm.single_process_world():
        for label, config in _configs().items():
            result = measure(label, config, args.repeats, args.steps)
            direct = result["timing_ms"]["direct"]
            layers = int(config["num_layers"])
            for name in ("flex, reference", "flex, turbo"):
                flex = result["timing_ms"][name]
                ratio = flex["median"] / direct["median"]
                added = (flex["median"] - direct["median"]) * 1e3 / layers  # us per layer-call per step
                result[f"ratio_{name}"] = ratio
                result[f"added_us_per_call_{name}"] = added
                rows.append([label, name, f"{flex['min']:.2f} / {flex['median']:.2f}",
                             f"{direct['min']:.2f} / {direct['median']:.2f}", f"{ratio:.3f}x",
                             f"{added:+.1f}", c.verdict(ratio <= GOAL_RATIO)])
            result["goal_met"] = all(result[f"ratio_{n}"] <= GOAL_RATIO for n in ("flex, reference", "flex, turbo"))
            results.append(result)
    print(c.table(["config", "flex path", "flex ms min/med", "direct ms min/med", "ratio (median)",
                   "us added per attention call", f"<= {GOAL_RATIO}x"], rows))
    print(f"\nmodels: hidden 64, 4 heads / 2 query groups, head dim 16, vocab 32 (the demo's); "
          f"{args.repeats} samples of {args.steps} steps per path, interleaved; direct and 'flex, turbo' run the "
          f"CPU fake of Primus-Turbo; {args.threads} intra-op thread(s).  'us added per attention call' is "
          "(flex - direct) per step over the layers: forward and backward of one layer's call.")
    with dm.single_process_world():
        counts = compiled_forward_counts()
    print("\nattention forward kernel calls in one training step of the demo model (bf16, CPU fake):")
    print(c.table(["step", "layers", "forward kernel calls", "calls recorded", "= layers"],
                  [[r["step"], r["layers"], r["forward_calls"], ", ".join(f"{k} x{v}" for k, v in r["calls"].items()),
                    "n/a" if r["goal_met"] is None else c.verdict(r["goal_met"])] for r in counts]))
    path = c.write_json(NAME, {"benchmark": NAME, "environment": env, "threads": args.threads,
                               "repeats": args.repeats, "steps_per_sample": args.steps, "goal": GOAL_RATIO,
                               "results": results, "compiled_forward_counts": counts})
    c.footer(path, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
