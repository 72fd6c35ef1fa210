"""Per-call Python cost of the flex adapter, after its first call.

Both sides call the same no-op kernel stub (real signature, returns a preallocated
tensor; see `benchmarks._stubs`), so the difference is only the code in between:

* ``direct``: the stub called like Megatron's direct path calls ``flash_attn_func``
  (``flash_attn_varlen_func`` for packed rows);
* ``flex``: `TurboFlexAttention` on the ``turbo`` backend with the same arguments, after
  a warm-up call (plan built, hook shapes verified).

The last row compares whole Megatron core-attention forwards (sbhd in, ``[S, B, H*D]``
out), flex path against direct path, both on the stubs.

Goals: ``flex`` within 1.10x of ``direct`` and less than 3 us added per call.

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
GOAL_RATIO = 1.10
GOAL_ADDED_US = 3.0
SEQ, HEADS, KV_HEADS, DIM = 4096, 8, 2, 128
WINDOW = (1024, 0)


def _settings(**keys: Any) -> Any:
    from primus_ext.settings import TurboAttentionSettings

    return TurboAttentionSettings.from_dict({"use_turbo_attention": True, "use_turbo_flex_attention": True,
                                             "turbo_flex_attention_backend": "turbo", **keys})


def _adapter(packed: bool = False, **keys: Any) -> Any:
    from primus_ext.backends.adapter import TurboFlexAttention
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
    window = _adapter()
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
         lambda: packed(tq, tk, tv, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                        max_seqlen_kv=longest, window_size=(-1, -1), **kw),
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


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=25, help="samples per side (min/median over them)")
    parser.add_argument("--number", type=int, default=2000, help="calls per sample")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--profile", action="store_true", help="print cProfile's top entries of each flex call")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    c.set_threads(args.threads)
    env = c.environment()
    c.header(NAME, "flex adapter vs direct call of the same no-op kernel stub, cache hit, us/call", env)

    results, rows, profiles = [], [], {}
    with stubbed_turbo() as (ops, outputs):
        for label, kernel, flex, direct in cases(ops, outputs):
            flex(), direct()  # warm-up: shapes verified
            timing = c.interleaved({"flex": flex, "direct": direct}, repeats=args.repeats, number=args.number,
                                   scale=1e6)
            f, d = timing["flex"], timing["direct"]
            ratio = f["median"] / d["median"]
            added = f["median"] - d["median"]
            ok = ratio <= GOAL_RATIO and added < GOAL_ADDED_US
            results.append({"case": label, "kernel": kernel, "flex_us": f, "direct_us": d,
                            "ratio_median": ratio, "ratio_min": f["min"] / d["min"], "added_us_median": added,
                            "added_us_min": f["min"] - d["min"], "ratio_goal_met": ratio <= GOAL_RATIO,
                            "added_goal_met": added < GOAL_ADDED_US})
            rows.append([label, f"{f['min']:.2f} / {f['median']:.2f}", f"{d['min']:.2f} / {d['median']:.2f}",
                         f"{added:.2f}", f"{ratio:.1f}x", c.verdict(added < GOAL_ADDED_US),
                         c.verdict(ratio <= GOAL_RATIO)])
            if args.profile:
                profiles[label] = profile_top(flex)

    print(c.table(["path (cache hit)", "flex us min/med", "direct us min/med", "added us", "ratio",
                   f"< {GOAL_ADDED_US:g} us added", f"<= {GOAL_RATIO:.2f}x"], rows))
    print(f"\n{args.repeats} samples x {args.number} calls per side, interleaved; q/k/v bf16 "
          f"[1, {SEQ}, {HEADS}/{KV_HEADS}, {DIM}]; the stub does no work, so the ratio compares our Python "
          "with a bare Python call and the added microseconds are the figure that matters.")
    for label, text in profiles.items():
        print(f"\ncProfile, flex call, {label} (tottime):\n{text}")
    path = c.write_json(NAME, {"benchmark": NAME, "environment": env, "repeats": args.repeats,
                               "calls_per_sample": args.number, "shape": [1, SEQ, HEADS, KV_HEADS, DIM],
                               "goals": {"ratio": GOAL_RATIO, "added_us": GOAL_ADDED_US},
                               "results": results, "profiles": profiles})
    c.footer(path, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
