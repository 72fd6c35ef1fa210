"""What proving user hooks (B31) costs a model build, at two sequence lengths.

Each hook below is a plain function as a user writes it (attention-gym, torchtitan and
hand-written styles), named in the settings as ``benchmarks.hook_proofs:<name>``.  For
each hook and each sequence length (``LayerFacts.seq_length``), with the proof caches
emptied first:

* ``first proof ms``: one `prove_mask` / `prove_score` call on the resolved hook
  (trace + z3), cold;
* ``96 layers ms``: `build_plan` for layers 1..96 (each resolves the hook string, probes
  the hook, reads the proof, runs the rule table), cold, i.e. including the one proof;
* ``again ms``: the same 96 builds with the proof cached, so ``96 layers - again`` is
  what proving costs the model;
* ``proofs``: proofs actually run during the 96 cold builds (``hook_proof.PROOFS``).

Medians of ``--repeats`` runs, each after emptying the caches, with hooks and lengths
interleaved round by round; wall clock and the calling thread's CPU time (which a busy
shared machine inflates much less).  A proof assumes no sequence length, so 4k and 128k
should cost the same.  The backend is ``turbo`` on the CPU fake, so a hook that is not
proven would be refused (and reported as such here).

Goal: proving these hooks costs <= 50 ms in total for a 96-layer model, whatever the
sequence length (judged on the sum of ``96 layers - again`` at each length).

    python -m benchmarks.hook_proofs [--sizes 4096 131072] [--layers 96] [--repeats 9]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from . import _common as c

NAME = "hook_proofs"
SIZES = (4096, 131072)
LAYERS = 96
HEADS, KV_HEADS, DIM = 32, 8, 128
GOAL_MS = 50.0

# -- the hooks, as users write them ---------------------------------------------------------
SLIDING_WINDOW = 1024  # attention-gym keeps its window in a module global


def causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return q_idx >= kv_idx


def gym_sliding_window(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    causal_mask = q_idx >= kv_idx
    window_mask = q_idx - kv_idx <= SLIDING_WINDOW
    return causal_mask & window_mask


TITAN_WINDOW = 1024


def titan_sliding_window(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    # torchtitan counts the query itself inside the window
    return (kv_idx <= q_idx) & (q_idx - kv_idx < TITAN_WINDOW)


def full(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return b.new_ones(size=(), dtype=torch.bool)  # torch's noop_mask


def band(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return (q_idx - kv_idx).abs() <= 256


def chunked(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return (q_idx // 8192 == kv_idx // 8192) & (kv_idx <= q_idx)  # Llama-4 style local chunks


def constant_documents(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    # a system prompt of 512 tokens and a 2048-token preamble, each its own document
    same = ((q_idx < 512) == (kv_idx < 512)) & ((q_idx < 2560) == (kv_idx < 2560))
    return same & (kv_idx <= q_idx)


ALIBI_SLOPES = [2 ** (-8 * (i + 1) / HEADS) for i in range(HEADS)]  # the ALiBi paper's geometric slopes
ALIBI_TENSOR = torch.tensor(ALIBI_SLOPES)


def alibi_list(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return score + torch.tensor(ALIBI_SLOPES)[h] * (kv_idx - q_idx)


def alibi_tensor(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return score + ALIBI_TENSOR[h] * (kv_idx - q_idx)


HOOKS: dict[str, tuple[str, str]] = {
    # label: (kind, attribute)
    "hand-written causal": ("mask", "causal"),
    "attention-gym sliding window": ("mask", "gym_sliding_window"),
    "torchtitan sliding window": ("mask", "titan_sliding_window"),
    "full (noop_mask)": ("mask", "full"),
    "two-sided band": ("mask", "band"),
    "chunked": ("mask", "chunked"),
    "constant documents": ("mask", "constant_documents"),
    "ALiBi, slopes from a list": ("score", "alibi_list"),
    "ALiBi, slopes from a tensor": ("score", "alibi_tensor"),
}


# -- measuring -----------------------------------------------------------------------------
def clear_proof_caches() -> None:
    """Empty every cache a proof is served from, so the next proof is a first proof."""
    from primus_ext.hooks import crosscheck as hook_crosscheck, proof as hook_proof, trace as hook_trace

    hook_proof._BY_OBJECT.clear()
    hook_proof._BY_FINGERPRINT.clear()
    hook_crosscheck._SMOKE.clear()
    for module in (hook_proof, hook_trace):  # per-code-object helpers memoised with lru_cache
        for value in vars(module).values():
            if callable(getattr(value, "cache_clear", None)) and getattr(value, "__module__", "") == module.__name__:
                value.cache_clear()


def _settings(kind: str, attr: str) -> Any:
    from primus_ext.settings import TurboAttentionSettings

    return TurboAttentionSettings.from_dict({
        "use_turbo_attention": True, "use_turbo_flex_attention": True, "turbo_flex_attention_backend": "turbo",
        f"turbo_flex_attention_{kind}_mod": f"benchmarks.{NAME}:{attr}",
    })


def _facts(seq: int, layer: int) -> Any:
    from primus_ext.plan import LayerFacts

    return LayerFacts(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, seq_length=seq, layer_number=layer)


def _timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """``(wall ms, calling thread's CPU ms, result)``: CPU time is what other processes on
    a busy machine inflate much less."""
    wall, cpu = time.perf_counter(), time.thread_time()
    out = fn()
    return (time.perf_counter() - wall) * 1e3, (time.thread_time() - cpu) * 1e3, out


def measure(kind: str, attr: str, seq: int, layers: int) -> dict[str, Any]:
    """One cold run: first proof, the cold builds, the warm builds, proofs run."""
    from primus_ext.hooks import proof as hook_proof
    from primus_ext.errors import UnsupportedConfigError
    from primus_ext.settings.hooks import resolve_hook

    settings = _settings(kind, attr)
    hook = resolve_hook(f"benchmarks.{NAME}:{attr}", kind=f"{kind}_mod", setting=f"turbo_flex_attention_{kind}_mod")
    prove = hook_proof.prove_mask if kind == "mask" else hook_proof.prove_score
    clear_proof_caches()
    first_ms, first_cpu, proof = _timed(lambda: prove(hook, num_heads=HEADS))
    what = (proof.pattern.describe() if proof.pattern is not None else f"NOT PROVEN: {proof.reason}") \
        if kind == "mask" else (proof.kind if proof.kind in ("identity", "alibi") else f"NOT PROVEN: {proof.reason}")

    def build_all() -> Optional[str]:
        for layer in range(1, layers + 1):
            try:
                from primus_ext.plan import build_plan

                build_plan(settings, _facts(seq, layer))
            except UnsupportedConfigError as err:
                return f"refused: {','.join(err.codes)}"
        return None

    clear_proof_caches()
    before = sum(hook_proof.PROOFS.values())
    cold_ms, cold_cpu, refused = _timed(build_all)
    proofs = sum(hook_proof.PROOFS.values()) - before
    warm_ms, warm_cpu, _ = _timed(build_all)
    return {"first_proof_ms": first_ms, "first_proof_cpu_ms": first_cpu, "cold_ms": cold_ms, "warm_ms": warm_ms,
            "proof_cost_ms": cold_ms - warm_ms, "proof_cost_cpu_ms": cold_cpu - warm_cpu, "proofs": proofs,
            "proven_as": what, "refused": refused}


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="LayerFacts.seq_length values")
    parser.add_argument("--layers", type=int, default=LAYERS, help="layers built per hook")
    parser.add_argument("--repeats", type=int, default=9, help="cold runs per hook and length (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    started, env = c.begin(NAME, f"cost of proving user hooks for a {args.layers}-layer model, ms", args.threads)

    from primus_ext.testing import fake_primus_turbo

    runs: dict[tuple[int, str], list[dict[str, Any]]] = {(seq, label): [] for seq in args.sizes for label in HOOKS}
    with fake_primus_turbo():
        for kind, attr in HOOKS.values():  # warm-up: imports, z3's first context, torch's first ops
            measure(kind, attr, args.sizes[0], 2)
        # Rounds alternate hooks and lengths, so a busy moment of the machine is spread over
        # all of them instead of being charged to whichever ran then.
        for round_ in range(args.repeats):
            for label, (kind, attr) in HOOKS.items():
                for seq in args.sizes:
                    runs[(seq, label)].append(measure(kind, attr, seq, args.layers))
            print(f"  round {round_ + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    keys = ("first_proof_ms", "first_proof_cpu_ms", "cold_ms", "warm_ms", "proof_cost_ms", "proof_cost_cpu_ms")
    results: list[dict[str, Any]] = []
    for seq in args.sizes:
        for label, (kind, attr) in HOOKS.items():
            these = runs[(seq, label)]
            results.append({"seq": seq, "hook": label, "attr": attr,
                            **{key: statistics.median(r[key] for r in these) for key in keys},
                            "proofs": max(r["proofs"] for r in these), "proven_as": these[0]["proven_as"],
                            "refused": these[0]["refused"]})

    rows = []
    totals: dict[int, dict[str, float]] = {}
    for r in results:
        t = totals.setdefault(r["seq"], {key: 0.0 for key in keys})
        for key in keys:
            t[key] += r[key]
        rows.append([f"{r['seq'] // 1024}k", r["hook"], r["refused"] or r["proven_as"],
                     f"{r['first_proof_ms']:.1f} / {r['first_proof_cpu_ms']:.1f}", f"{r['cold_ms']:.1f}",
                     f"{r['warm_ms']:.1f}", f"{r['proof_cost_ms']:.1f} / {r['proof_cost_cpu_ms']:.1f}", r["proofs"]])
    verdicts = {}
    for seq, t in totals.items():
        ok = t["proof_cost_ms"] <= GOAL_MS and not any(r["refused"] for r in results if r["seq"] == seq)
        verdicts[seq] = ok
        rows.append([f"{seq // 1024}k", f"TOTAL ({len(HOOKS)} hooks)", c.verdict(ok) + f" (<= {GOAL_MS:g} ms)",
                     f"{t['first_proof_ms']:.1f} / {t['first_proof_cpu_ms']:.1f}", f"{t['cold_ms']:.1f}",
                     f"{t['warm_ms']:.1f}", f"{t['proof_cost_ms']:.1f} / {t['proof_cost_cpu_ms']:.1f}", ""])
    print(c.table(["S", "hook", "proven as", "first proof ms (wall / cpu)", f"{args.layers} layers ms",
                   "again ms", "proof cost ms (wall / cpu)", "proofs"], rows))
    print(f"\nfirst proof: one prove_mask/prove_score call, caches emptied. {args.layers} layers: build_plan for "
          f"layers 1..{args.layers} (resolve + probe + proof + rules), caches emptied first; again: the same "
          "builds with the proof cached; proof cost = layers - again (the goal is judged on its wall-clock total). "
          f"Medians of {args.repeats} cold runs, hooks and lengths interleaved; cpu = the calling thread's CPU "
          f"time. Heads {HEADS}/{KV_HEADS}, head dim {DIM}; backend turbo (CPU fake); {args.threads} intra-op "
          "thread(s).")
    path = c.write_json(NAME, {"benchmark": NAME, "environment": env, "layers": args.layers,
                               "heads": [HEADS, KV_HEADS], "goal_ms": GOAL_MS, "results": results,
                               "totals": {str(k): v for k, v in totals.items()},
                               "goal_met": {str(k): v for k, v in verdicts.items()}})
    c.footer(path, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
