"""The reference backend against torch's ``scaled_dot_product_attention`` on CPU.

Forward + backward of one attention call, float32, q/k/v in bshd as the flex adapter
takes them (SDPA gets the bhsd views of the same tensors, as the reference backend
gives it).  Rows:

* ``causal``: the adapter on the reference backend, which sends plain causal attention to
  SDPA itself; against SDPA with ``is_causal=True``.  Goal: <= 1.5x.
* ``window``: a causal sliding window, which the reference computes with its exact
  materialised math; against SDPA with the same window as a boolean ``attn_mask``
  (built once, outside the timing).  No goal: shows the cost of the exact path.
* ``causal + sink``: a learned sink forces the exact path too; against SDPA causal,
  which has no sink (different math, so a cost figure only).

    python -m benchmarks.reference_vs_sdpa [--sizes 512 1024 2048] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from . import _common as c

NAME = "reference_vs_sdpa"
SIZES = (512, 1024, 2048)
BATCH, HEADS, DIM = 1, 8, 64
WINDOW = (128, 0)
GOAL_RATIO = 1.5


def _adapter(**keys: Any) -> Any:
    from primus_ext.backends.adapter import TurboFlexAttention
    from primus_ext.plan import LayerFacts, build_plan
    from primus_ext.settings import TurboAttentionSettings

    settings = TurboAttentionSettings.from_dict({"use_turbo_attention": True, "use_turbo_flex_attention": True,
                                                 "turbo_flex_attention_backend": "reference", **keys})
    return TurboFlexAttention(build_plan(settings, LayerFacts(num_heads=HEADS, head_dim=DIM)))


def _step(forward: Callable[[], torch.Tensor], leaves: list[torch.Tensor], grad: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        for t in leaves:
            t.grad = None
        forward().backward(grad)

    return run


def cases(seq: int) -> list[tuple[str, Callable[[], None], Callable[[], None], bool]]:
    """``(label, reference step, sdpa step, held to the goal)``."""
    gen = torch.Generator().manual_seed(seq)
    q, k, v = (torch.randn(BATCH, seq, HEADS, DIM, generator=gen).requires_grad_() for _ in range(3))
    sink = torch.zeros(HEADS, requires_grad=True)
    grad = torch.randn(BATCH, seq, HEADS, DIM, generator=gen)
    grad_bhsd = grad.transpose(1, 2)
    qi = torch.arange(seq).view(-1, 1)
    window_mask = (qi - torch.arange(seq).view(1, -1) >= 0) & (qi - torch.arange(seq).view(1, -1) <= WINDOW[0])
    causal, sinks = _adapter(), _adapter(use_sink_attention=True)

    def sdpa(**kw: Any) -> torch.Tensor:
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw)

    leaves = [q, k, v]
    return [
        ("causal", _step(lambda: causal(q, k, v, causal=True), leaves, grad),
         _step(lambda: sdpa(is_causal=True), leaves, grad_bhsd), True),
        (f"window {WINDOW}", _step(lambda: causal(q, k, v, causal=True, window_size=WINDOW), leaves, grad),
         _step(lambda: sdpa(attn_mask=window_mask), leaves, grad_bhsd), False),
        ("causal + sink", _step(lambda: sinks(q, k, v, causal=True, sink=sink), leaves + [sink], grad),
         _step(lambda: sdpa(is_causal=True), leaves, grad_bhsd), False),
    ]


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="sequence lengths")
    parser.add_argument("--repeats", type=int, default=5, help="samples per side (fewer above 1024)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    c.set_threads(args.threads)
    env = c.environment()
    c.header(NAME, "reference backend vs scaled_dot_product_attention, forward + backward, ms", env)

    rows, results = [], []
    for seq in args.sizes:
        repeats = args.repeats if seq <= 1024 else max(3, args.repeats // 2)
        for label, ours, sdpa, held in cases(seq):
            ours(), sdpa()  # warm-up
            timing = c.interleaved({"reference": ours, "sdpa": sdpa}, repeats=repeats, scale=1e3)
            r, s = timing["reference"], timing["sdpa"]
            ratio = r["median"] / s["median"]
            ok = ratio <= GOAL_RATIO if held else None
            results.append({"seq": seq, "case": label, "reference_ms": r, "sdpa_ms": s, "ratio_median": ratio,
                            "ratio_min": r["min"] / s["min"], "goal": GOAL_RATIO if held else None,
                            "goal_met": ok})
            rows.append([seq, label, f"{r['min']:.1f} / {r['median']:.1f}", f"{s['min']:.1f} / {s['median']:.1f}",
                         f"{ratio:.2f}x", c.verdict(ok) if held else "no goal"])
    print(c.table(["S", "mask", "reference ms min/med", "SDPA ms min/med", "ratio (median)",
                   f"<= {GOAL_RATIO}x"], rows))
    print(f"\nfloat32, B={BATCH}, {HEADS} heads, head dim {DIM}, forward + backward per sample, interleaved; "
          f"{args.threads} intra-op thread(s).")
    path = c.write_json(NAME, {"benchmark": NAME, "environment": env, "threads": args.threads,
                               "shape": {"B": BATCH, "H": HEADS, "D": DIM}, "results": results})
    c.footer(path, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
