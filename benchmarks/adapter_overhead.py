"""Per-call Python cost of the flex adapter, after its first call.

Both sides call the same no-op kernel stub (real signature, returns a preallocated
tensor; see `benchmarks._stubs`), so the difference is only the code in between:

* ``direct``: the stub called like Megatron's direct path calls ``flash_attn_func``
  (``flash_attn_varlen_func`` for packed rows);
* ``flex``: `TurboFlexAttention` on the ``turbo`` backend with the same arguments, after
  a warm-up call (plan built, hook shapes verified).

The last row compares whole Megatron core-attention forwards (sbhd in, ``[S, B, H*D]``
out), flex path against direct path, both on the stubs.

Goal (issues 13, 27): at most 2 us added per call on every path, at most 30 us for a
layer's first call.  After the table, a prepared (cached) dense and packed causal call is
taken apart: the time of each piece it runs, measured alone, so what remains above the
goal is named.

    python -m benchmarks.adapter_overhead [--repeats 25] [--number 2000] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from typing import Any, Callable

import torch

from . import _common as c
from ._stubs import dense_inputs, stubbed_turbo

NAME = "adapter_overhead"
GOAL_ADDED_US = 2.0
SEQ, HEADS, KV_HEADS, DIM = 4096, 8, 2, 128
WINDOW = (1024, 0)


def _settings(**keys: Any) -> Any:
    from primus_ext.settings import TurboAttentionSettings

    return TurboAttentionSettings.from_dict({"use_turbo_attention": True, "use_turbo_flex_attention": True,
                                             "turbo_flex_attention_backend": "turbo", **keys})


def _adapter(packed: bool = False, **keys: Any) -> Any:
    """A flex adapter on the turbo backend (the caller's ``packed`` layout planned)."""
    from primus_ext.call.adapter import TurboFlexAttention
    from primus_ext.plan import LayerFacts, build_plan

    facts = LayerFacts(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, seq_length=SEQ, packed=packed)
    return TurboFlexAttention(build_plan(_settings(**keys), facts))


def _core(flex: bool, **keys: Any) -> Any:
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from primus_ext.megatron.core import TurboAttentionCore

    config = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                               num_query_groups=KV_HEADS, use_cpu_initialization=True, attention_dropout=0.0,
                               hidden_dropout=0.0)
    settings = _settings(use_turbo_flex_attention=flex, **keys)
    return TurboAttentionCore(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                              attention_dropout=None, softmax_scale=None, k_channels=None, v_channels=None,
                              cp_comm_type=None, pg_collection=None, settings=settings)


def cases(ops: Any, outputs: Any) -> list[tuple[str, str, Callable[[], Any], Callable[[], Any]]]:
    """``(label, kernel, flex_call, direct_call)`` for each measured path."""
    q, k, v = dense_inputs(1, SEQ, HEADS, KV_HEADS, DIM)
    outputs.dense = torch.empty_like(q)
    tq, tk, tv = q[0], k[0], v[0]
    outputs.packed = torch.empty_like(tq)
    cu = torch.tensor([0, 1000, 2500, SEQ], dtype=torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())  # max_seqlen must bound every document (the adapter checks)
    sink = torch.zeros(HEADS)
    flash, varlen = ops.flash_attn_func, ops.flash_attn_varlen_func
    kw = dict(dropout_p=0.0, softmax_scale=None, causal=True)

    causal = _adapter()
    window = _adapter(sink_sliding_window=WINDOW[0])  # the plan's window, as the call passes it
    sinks = _adapter(use_sink_attention=True)
    packed = _adapter(packed=True)
    flex_core, direct_core = _core(True), _core(False)
    sq, sk, sv = (t.transpose(0, 1) for t in (q, k, v))  # Megatron's sbhd
    return [
        ("causal", "flash_attn_func",
         lambda: causal(q, k, v, window_size=(-1, -1), **kw),
         lambda: flash(q, k, v, window_size=(-1, -1), **kw)),
        (f"window {WINDOW}", "flash_attn_func(window_size)",
         lambda: window(q, k, v, window_size=WINDOW, **kw),
         lambda: flash(q, k, v, window_size=WINDOW, **kw)),
        ("causal + sink", "flash_attn_func",
         lambda: sinks(q, k, v, window_size=(-1, -1), sink=sink, **kw),
         lambda: flash(q, k, v, window_size=(-1, -1), sink=sink, **kw)),
        ("packed causal (thd)", "flash_attn_varlen_func",
         lambda: packed.varlen(tq, tk, tv, cu, cu, longest, longest, window_size=(-1, -1), **kw),
         lambda: varlen(tq, tk, tv, cu, cu, longest, longest, window_size=(-1, -1), **kw)),
        ("Megatron core forward (sbhd)", "flex path vs direct path",
         lambda: flex_core.forward(sq, sk, sv, None),
         lambda: direct_core.forward(sq, sk, sv, None)),
    ]


def profile_top(fn: Callable[[], Any], calls: int = 20000, top: int = 12) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    text = out.getvalue()
    return text[text.find("   ncalls"):].rstrip()


def first_calls(ops: Any, outputs: Any, fresh: int = 40) -> list[tuple[str, float, float]]:
    """``(path, first call us, later call us)`` medians over ``fresh`` new adapters per path.

    The first call of a layer builds what its route needs: the plan's binding of the
    call's causal/window, the arch route, the `KernelCall` and the memo of the fast path;
    no per-shape table (no BlockMask) on any route.
    """
    q, k, v = dense_inputs(1, SEQ, HEADS, KV_HEADS, DIM)
    outputs.dense = torch.empty_like(q)
    tq, tk, tv = q[0], k[0], v[0]
    outputs.packed = torch.empty_like(tq)
    cu = torch.tensor([0, 1000, 2500, SEQ], dtype=torch.int32)
    sink = torch.zeros(HEADS)
    kw = dict(dropout_p=0.0, softmax_scale=None, causal=True)
    paths = {
        "causal": (dict(), lambda run: run(q, k, v, window_size=(-1, -1), **kw)),
        f"window {WINDOW}": (dict(sink_sliding_window=WINDOW[0]), lambda run: run(q, k, v, window_size=WINDOW, **kw)),
        "causal + sink": (dict(use_sink_attention=True), lambda run: run(q, k, v, sink=sink, **kw)),
        "packed causal (thd)": (dict(packed=True), lambda run: run.varlen(tq, tk, tv, cu, cu, 1596, 1596, **kw)),
    }
    rows = []
    for label, (keys, call) in paths.items():
        firsts, laters = [], []
        for _ in range(fresh):
            run = _adapter(**keys)
            for sample in (firsts, laters):
                start = time.perf_counter()
                call(run)
                sample.append((time.perf_counter() - start) * 1e6)
        rows.append((label, sorted(firsts)[fresh // 2], sorted(laters)[fresh // 2]))
    return rows


def _per_call(fn: Callable[[], Any], number: int, repeats: int = 7) -> float:
    """Median microseconds per call of ``fn`` over ``repeats`` samples of ``number`` calls."""
    return c.interleaved({"x": fn}, repeats=repeats, number=number, scale=1e6)["x"]["median"]


def breakdown(ops: Any, outputs: Any, number: int) -> list[tuple[str, float]]:
    """The pieces of the prepared-call path for a dense and a packed causal call, each timed alone (us)."""
    from primus_ext.call.checks import boundaries_proven, check_packed
    from primus_ext.call.spec import call_spec

    q, k, v = dense_inputs(1, SEQ, HEADS, KV_HEADS, DIM)
    outputs.dense = torch.empty_like(q)
    tq, tk, tv = q[0], k[0], v[0]
    outputs.packed = torch.empty_like(tq)
    cu = torch.tensor([0, 1000, 2500, SEQ], dtype=torch.int32)
    longest = 1596
    run = _adapter()
    kw = dict(dropout_p=0.0, softmax_scale=None, causal=True, window_size=(-1, -1))
    run(q, k, v, **kw)
    scalars = (0.0, None, True, (-1, -1), False, False)
    spec = call_spec(False, *scalars, q, k, v, None)
    prepared, flash = run.calls.get(spec), ops.flash_attn_func
    packed = _adapter(packed=True)
    packed.varlen(tq, tk, tv, cu, cu, longest, longest, **kw)
    pprepared, varlen = packed.calls.get(call_spec(True, *scalars, tq, tk, tv, None)), ops.flash_attn_varlen_func

    def signature_like(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), bias=None,
                       alibi_slopes=None, deterministic=False, return_lse=False, return_attn_probs=False, sink=None):
        return None

    pieces = [
        ("whole adapter call", lambda: run(q, k, v, **kw)),
        ("direct stub call (the baseline)", lambda: flash(q, k, v, **kw)),
        ("calling a no-op with the adapter's signature", lambda: signature_like(q, k, v, **kw)),
        ("torch.compiler.is_compiling()", torch.compiler.is_compiling),
        ("the call's spec alone (scalar types checked, q/k/v/sink metadata; call_spec)",
         lambda: call_spec(False, *scalars, q, k, v, None)),
        ("cache lookup of a built spec (last spec compared; PreparedCalls.find)", lambda: run.calls.find(spec)),
        ("bound kernel runner (keywords prepared) incl. the stub", lambda: prepared.run(q, k, v, None)),
        ("packed: whole adapter call", lambda: packed.varlen(tq, tk, tv, cu, cu, longest, longest, **kw)),
        ("packed: direct varlen stub call (the baseline)", lambda: varlen(tq, tk, tv, cu, cu, longest, longest,
                                                                          **kw)),
        ("packed: the boundaries' whole check (check_packed, as the full path)", lambda: check_packed(
            tq, tk, cu, cu, longest, longest, kv="k")),
        ("packed: boundary values found proven (shared facts)", lambda: boundaries_proven(cu, SEQ, longest)),
        ("packed: bound kernel runner incl. the stub", lambda: pprepared.run(tq, tk, tv, cu, cu, longest, longest,
                                                                              None)),
    ]
    return [(label, _per_call(fn, number)) for label, fn in pieces]


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=25, help="samples per side (min/median over them)")
    parser.add_argument("--number", type=int, default=2000, help="calls per sample")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--profile", action="store_true", help="print cProfile's top entries of each flex call")
    args = parser.parse_args(argv)
    started, env = c.begin(NAME, "flex adapter vs direct call of the same no-op kernel stub, cache hit, us/call", args.threads)

    results, rows, profiles = [], [], {}
    with stubbed_turbo() as (ops, outputs):
        for label, kernel, flex, direct in cases(ops, outputs):
            flex(), direct()  # warm-up: shapes verified
            timing = c.interleaved({"flex": flex, "direct": direct}, repeats=args.repeats, number=args.number,
                                   scale=1e6)
            f, d = timing["flex"], timing["direct"]
            ratio = f["median"] / d["median"]
            added = f["median"] - d["median"]
            results.append({"case": label, "kernel": kernel, "flex_us": f, "direct_us": d,
                            "ratio_median": ratio, "added_us_median": added, "added_us_min": f["min"] - d["min"],
                            "added_goal_met": added <= GOAL_ADDED_US})
            rows.append([label, f"{f['min']:.2f} / {f['median']:.2f}", f"{d['min']:.2f} / {d['median']:.2f}",
                         f"{added:.2f}", f"{ratio:.1f}x", c.verdict(added <= GOAL_ADDED_US)])
            if args.profile:
                profiles[label] = profile_top(flex)
        pieces = breakdown(ops, outputs, args.number)
        firsts = first_calls(ops, outputs)

    print(c.table(["path (cache hit)", "flex us min/med", "direct us min/med", "added us", "ratio",
                   f"<= {GOAL_ADDED_US:g} us added"], rows))
    print(f"\n{args.repeats} samples x {args.number} calls per side, interleaved; q/k/v bf16 "
          f"[1, {SEQ}, {HEADS}/{KV_HEADS}, {DIM}]; the stub does no work, so the ratio compares our Python "
          "with a bare Python call and the added microseconds are the figure that matters.")
    print("\nfirst call of a new layer vs its second call (us, median over 40 new adapters per path):")
    print(c.table(["path", "first call us", "second call us"],
                  [[label, f"{a:.1f}", f"{b:.1f}"] for label, a, b in firsts]))
    print("\nwhere the fast path's time goes (each piece timed alone, us per call, median):")
    print(c.table(["piece", "us"], [[label, f"{us:.2f}"] for label, us in pieces]))
    for label, text in profiles.items():
        print(f"\ncProfile, flex call, {label} (tottime):\n{text}")
    path = c.write_json(NAME, {"benchmark": NAME, "environment": env, "repeats": args.repeats,
                               "calls_per_sample": args.number, "shape": [1, SEQ, HEADS, KV_HEADS, DIM],
                               "goals": {"added_us": GOAL_ADDED_US}, "results": results,
                               "breakdown_us": dict(pieces),
                               "first_calls_us": [{"path": p, "first": a, "second": b} for p, a, b in firsts],
                               "profiles": profiles})
    c.footer(path, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
