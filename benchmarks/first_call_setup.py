"""First-call setup of a causal or windowed layer: plan + BlockMask, against torch.

What a layer pays once, before its first kernel call: the plan (build time) and the
BlockMask of its pattern and shape (first forward).  Three ways of declaring the same
pattern, because they cost differently:

* ``config``: causal from Megatron's mask type, the window from ``window_size``;
* ``library hook``: ``primus_ext.attention.masks:causal`` / ``sliding_window`` (tagged
  with their pattern, never evaluated);
* ``user hook``: a plain ``mask_mod`` function, recognised by evaluating it (see
  `primus_ext.attention.recognition`).

torch's ``create_block_mask`` (eager, ``_compile=False``) gets the same ``mask_mod`` as
the user hook.  It evaluates it on all S x S cells, about 10 s at 32k on a 2-core CPU,
so it runs once at 32k and is skipped at 128k.

Every measurement runs in a fresh process forked from an idle server that has the
imports done (``multiprocessing`` forkserver), so the first call at each shape really is
the first.  Each process first builds the same thing at S = 256, so that lazy imports
and torch's first-use initialisation (a one-time cost of the process, about 13 MiB and a
few ms) are not charged to the measured shape.  Peak memory is the growth of the
process's peak resident set (Linux ``VmHWM``, reset through ``/proc/self/clear_refs``)
during the call: it sees torch's allocations, which ``tracemalloc`` does not.  ``held``
is what stays: the BlockMask's tensors.  Times are wall clock; with one intra-op thread
(the default here) the CPU time of the calling thread is recorded too, which other
processes on a busy machine inflate much less.

Goal (S = 128k): plan + BlockMask <= 50 ms and <= 64 MiB.

    python -m benchmarks.first_call_setup [--sizes 4096 32768 131072] [--repeats 5]
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from typing import Any, Callable, Optional

from torch import Tensor

from . import _common as c

NAME = "first_call_setup"
SIZES = (4096, 32768, 131072)
WINDOW = (1024, 0)
TORCH_LIMIT = 32768  # torch's builder is O(S^2): ~10 s at 32k here, skipped above
GOAL_MS, GOAL_MIB = 50.0, 64.0
HEADS, KV_HEADS, DIM = 32, 8, 128


# The user's own mask_mods (plain functions: recognised by evaluation).
def causal_hook(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return kv_idx <= q_idx


def window_hook(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= WINDOW[0])


HOOKS = {"causal": causal_hook, "window": window_hook}


def _keys(kind: str, declared: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(settings keys, LayerFacts fields)`` declaring ``kind`` the ``declared`` way."""
    keys: dict[str, Any] = {"use_turbo_attention": True, "use_turbo_flex_attention": True,
                            "turbo_flex_attention_backend": "turbo"}
    facts: dict[str, Any] = {}
    if declared == "config":
        if kind == "window":
            facts["window_size"] = WINDOW
    elif declared == "library hook":
        if kind == "causal":
            keys.update(turbo_flex_attention_mask_mod="primus_ext.attention.masks:causal",
                        turbo_flex_attention_mask_mod_kwargs={})
        else:
            keys.update(turbo_flex_attention_mask_mod="primus_ext.attention.masks:sliding_window",
                        turbo_flex_attention_mask_mod_kwargs={"left": WINDOW[0], "right": WINDOW[1]})
    else:
        keys["turbo_flex_attention_mask_mod"] = f"benchmarks.{NAME}:{kind}_hook"
    return keys, facts


def _plan(kind: str, declared: str, seq: int) -> Any:
    from primus_ext.plan import LayerFacts, build_plan
    from primus_ext.settings import TurboAttentionSettings

    keys, fields = _keys(kind, declared)
    facts = LayerFacts(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, seq_length=seq, **fields)
    return build_plan(TurboAttentionSettings.from_dict(keys), facts)


def _held_mib(block_mask: Any) -> float:
    tensors = [getattr(block_mask, name, None) for name in (
        "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
        "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None) / 2 ** 20


def _ms(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return (time.perf_counter() - start) * 1e3, out


def _timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """``(wall ms, calling thread's CPU ms, result)``."""
    wall, cpu = time.perf_counter(), time.thread_time()
    out = fn()
    return (time.perf_counter() - wall) * 1e3, (time.thread_time() - cpu) * 1e3, out


WARM_UP_SEQ = 256


# -- one measurement, in its own process -------------------------------------------------
def measure(task: tuple[str, str, int, int, int]) -> dict[str, Any]:
    """``(what, kind, seq, repeats, threads)``; ``what`` is ``config``, ``user hook`` or ``torch``."""
    import torch

    from primus_ext.attention.block_mask_cache import BlockMaskCache
    from primus_ext.testing import fake_primus_turbo

    what, kind, seq, repeats, threads = task
    torch.set_num_threads(threads)
    result: dict[str, Any] = {"what": what, "kind": kind, "seq": seq}
    with fake_primus_turbo():
        if what == "torch":
            from torch.nn.attention.flex_attention import create_block_mask

            def build(n: int) -> Any:
                return create_block_mask(HOOKS[kind], None, None, n, n, device="cpu", _compile=False)

            build(WARM_UP_SEQ)
            with c.PeakRSS() as peak:
                ms, cpu_ms, block_mask = _timed(lambda: build(seq))
            result.update(first_ms=ms, first_cpu_ms=cpu_ms, peak_mib=peak.mib, held_mib=_held_mib(block_mask))
            del block_mask
            warm = [_ms(lambda: build(seq))[0] for _ in range(repeats)]
            result["warm_ms"] = c.summary(warm) if warm else None
            return result

        declared = what

        def first_call(n: int) -> Any:
            plan_ms, plan_cpu, plan = _timed(lambda: _plan(kind, declared, n))
            mask_ms, mask_cpu, block_mask = _timed(lambda: BlockMaskCache().get(plan.pattern, n, n, "cpu"))
            return plan_ms, mask_ms, plan_cpu + mask_cpu, plan, block_mask

        with c.PeakRSS() as warm_up:
            first_call(WARM_UP_SEQ)
        result["process_warm_up_peak_mib"] = warm_up.mib
        with c.PeakRSS() as peak:
            plan_ms, mask_ms, cpu_ms, plan, block_mask = first_call(seq)
        result.update(first_plan_ms=plan_ms, first_mask_ms=mask_ms, first_ms=plan_ms + mask_ms,
                      first_cpu_ms=cpu_ms, peak_mib=peak.mib, held_mib=_held_mib(block_mask),
                      pattern=plan.pattern.describe())
        del block_mask
        if repeats < 1:
            return result
        plans, masks = [], []
        for _ in range(repeats):
            plans.append(_ms(lambda: _plan(kind, declared, seq))[0])
            masks.append(_ms(lambda: BlockMaskCache().get(plan.pattern, seq, seq, "cpu"))[0])
        result["warm_plan_ms"], result["warm_mask_ms"] = c.summary(plans), c.summary(masks)
        if declared == "config":
            result["warm_library_plan_ms"] = c.summary(
                [_ms(lambda: _plan(kind, "library hook", seq))[0] for _ in range(repeats)])
    return result


def _pool_context() -> Any:
    try:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.nn.attention.flex_attention", "primus_ext.plan",
                                    "primus_ext.testing", "primus_ext.attention.block_mask_cache",
                                    f"{__package__}._common"])
        return ctx
    except ValueError:  # no forkserver on this platform
        return multiprocessing.get_context("spawn")


def run_all(tasks: list[tuple[str, str, int, int, int]]) -> list[dict[str, Any]]:
    ctx = _pool_context()
    results = []
    with ctx.Pool(1, maxtasksperchild=1) as pool:  # a fresh process per measurement
        for task in tasks:
            results.append(pool.apply(measure, (task,)))
            print(f"  measured {task[0]:<10} {task[1]:<6} S={task[2]:>6}", file=sys.stderr, flush=True)
    return results


def _fmt(x: Optional[float], digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="sequence lengths")
    parser.add_argument("--repeats", type=int, default=5, help="warm repeats after the first call")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    import torch

    threads = args.threads
    torch.set_num_threads(threads)
    env = c.environment()
    c.header(NAME, "plan + BlockMask at the first call vs torch create_block_mask, ms and MiB", env)

    tasks = []
    for seq in args.sizes:
        for kind in ("causal", "window"):
            tasks.append(("config", kind, seq, args.repeats, threads))
            tasks.append(("user hook", kind, seq, 0, threads))
            if seq <= TORCH_LIMIT:
                tasks.append(("torch", kind, seq, 1 if seq < TORCH_LIMIT else 0, threads))
    results = run_all(tasks)
    by = {(r["what"], r["kind"], r["seq"]): r for r in results}

    rows, summary_rows = [], []
    for seq in args.sizes:
        for kind in ("causal", "window"):
            ours, hook, ref = by[("config", kind, seq)], by[("user hook", kind, seq)], by.get(("torch", kind, seq))
            ok = ours["first_ms"] <= GOAL_MS and (ours["peak_mib"] or 0) <= GOAL_MIB
            ours["goal_met"] = ok if seq == max(SIZES) else None
            rows.append([
                f"{seq // 1024}k", kind if kind == "causal" else f"window {WINDOW}",
                f"{ours['first_plan_ms']:.1f} + {ours['first_mask_ms']:.1f} = {ours['first_ms']:.1f}",
                f"{ours['first_cpu_ms']:.1f}", _fmt(ours["peak_mib"]), _fmt(ours["held_mib"], 2),
                f"{ours['warm_mask_ms']['median']:.1f}", f"{ours['warm_library_plan_ms']['median']:.2f}",
                f"{hook['first_plan_ms']:.0f}", _fmt(hook["peak_mib"], 0),
                _fmt(ref["first_ms"], 0) if ref else "skipped", _fmt(ref["peak_mib"], 0) if ref else "-",
                f"{ref['first_ms'] / ours['first_ms']:.0f}x" if ref else "-",
                c.verdict(ok) if seq == max(SIZES) else "-",
            ])
            summary_rows.append({"seq": seq, "kind": kind, "config": ours, "user_hook": hook, "torch": ref})

    print(c.table(["S", "pattern", "first call ms (plan + mask)", "cpu ms", "peak MiB", "held MiB",
                   "mask ms again", "library-hook plan ms", "user-hook plan ms", "user-hook peak MiB",
                   "torch ms", "torch peak MiB", "torch / ours", f"<= {GOAL_MS:g} ms and {GOAL_MIB:g} MiB"], rows))
    print(f"\nfirst call: a fresh process (after a {WARM_UP_SEQ}-token build), plan with the window from the "
          "config / causal from the mask type, then the BlockMask. mask ms again: median of "
          f"{args.repeats} more builds. library-hook plan: masks.causal / masks.sliding_window (tagged, not "
          "evaluated), median. user-hook plan: the same pattern as a plain mask_mod, evaluated by the "
          "recogniser at build time, first call (its BlockMask costs what the config's does). torch: "
          f"create_block_mask with that mask_mod, eager, first call; skipped above {TORCH_LIMIT // 1024}k. "
          f"heads {HEADS}/{KV_HEADS}, head dim {DIM}; {threads} intra-op thread(s).")
    path = c.write_json(NAME, {"benchmark": NAME, "environment": env, "threads": threads, "window": WINDOW,
                               "goals": {"ms": GOAL_MS, "mib": GOAL_MIB, "at_seq": SIZES[-1]},
                               "results": summary_rows})
    c.footer(path, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
