"""The reference backend's own paths against the best torch alternative on the same inputs, on CPU.

Every row times the reference backend on a path it computes itself (blockwise: windows,
sinks, mask hooks, packed documents), forward + backward, float32, B=1, 8 heads, head
dim 64, q/k/v in bshd as the flex adapter takes them; the alternatives get the same
tensors.  Timed side by side, interleaved, in one run:

* ``window 256`` vs SDPA causal (more work than the window, but what a causal model pays
  today; goal at 4k: <= 1.5x) and vs SDPA with the window as a boolean ``attn_mask``;
* ``causal + sink`` vs SDPA causal (no sink: a cost figure, torch has no sink);
* ``hook`` (a strided causal mask only a hook expresses) vs SDPA with the same mask;
* ``packed`` (32 documents of T/32 tokens) vs SDPA per document (goal at T = 8k: <= 2x);
* forward only, ``window 256`` vs torch's ``flex_attention`` compiled on CPU (its
  BlockMask built outside the timing; the compile itself is reported apart).

Memory, one head, window 256, forward + backward, each measurement in a fresh process
(peak RSS growth): the reference at 8k vs SDPA causal at 8k (goal <= 4x), and the
reference at 32k (goal < 1 GiB).

    python -m benchmarks.reference_vs_sdpa [--sizes 1024 4096] [--packed 8192] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from . import _common as c

NAME = "reference_vs_sdpa"
SIZES = (1024, 4096)
PACKED = 8192
DOCUMENTS = 32
BATCH, HEADS, DIM = 1, 8, 64
WINDOW = (256, 0)
GOALS = {"window_vs_causal": 1.5, "packed_vs_per_document": 2.0, "memory_vs_causal": 4.0, "memory_32k_mib": 1024}


def strided_causal(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    """A mask no fixed kernel has: causal, every other key."""
    return (q_idx >= kv_idx) & ((q_idx - kv_idx) % 2 == 0)


def _adapter(heads: int = HEADS, packed: bool = False, **keys: Any) -> Any:
    from primus_ext.call.adapter import TurboFlexAttention
    from primus_ext.plan import LayerFacts, build_plan
    from primus_ext.settings import TurboAttentionSettings

    settings = TurboAttentionSettings.from_dict({"use_turbo_attention": True, "use_turbo_flex_attention": True,
                                                 "turbo_flex_attention_backend": "reference", **keys})
    facts = LayerFacts(num_heads=heads, num_kv_heads=heads, head_dim=DIM, packed=packed)
    return TurboFlexAttention(build_plan(settings, facts))


def _step(forward: Callable[[], torch.Tensor], leaves: list[torch.Tensor], grad: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        for t in leaves:
            t.grad = None
        forward().backward(grad)

    return run


def _mask(seq: int, fn: Callable[..., torch.Tensor]) -> torch.Tensor:
    qi, ki = torch.arange(seq).view(-1, 1), torch.arange(seq).view(1, -1)
    return fn(None, None, qi, ki)


def dense_rows(seq: int) -> list[tuple[str, Callable[[], None], dict[str, Callable[[], None]], Any]]:
    """``(label, reference step, {alternative: step}, (goal key, alternative) or None)``."""
    gen = torch.Generator().manual_seed(seq)
    q, k, v = (torch.randn(BATCH, seq, HEADS, DIM, generator=gen).requires_grad_() for _ in range(3))
    sink = torch.zeros(HEADS, requires_grad=True)
    grad = torch.randn(BATCH, seq, HEADS, DIM, generator=gen)
    bhsd = grad.transpose(1, 2)
    window = _mask(seq, lambda b, h, qi, ki: (qi >= ki) & (qi - ki <= WINDOW[0]))
    strided = _mask(seq, strided_causal)
    plain, sinks = _adapter(), _adapter(use_sink_attention=True)
    windowed = _adapter(sink_sliding_window=WINDOW[0])  # the plan's window, as the call passes it
    hooked = _adapter(turbo_flex_attention_mask_mod=f"benchmarks.{NAME}:strided_causal")
    leaves = [q, k, v]

    def sdpa(**kw: Any) -> Callable[[], None]:
        return _step(lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                            **kw), leaves, bhsd)

    goal = ("window_vs_causal", "SDPA causal") if seq == 4096 else None
    return [
        (f"window {WINDOW[0]}", _step(lambda: windowed(q, k, v, causal=True, window_size=WINDOW), leaves, grad),
         {"SDPA causal": sdpa(is_causal=True), "SDPA + window mask": sdpa(attn_mask=window)}, goal),
        ("causal + sink", _step(lambda: sinks(q, k, v, causal=True, sink=sink), leaves + [sink], grad),
         {"SDPA causal": sdpa(is_causal=True)}, None),
        ("hook (strided causal)", _step(lambda: hooked(q, k, v), leaves, grad),
         {"SDPA + same mask": sdpa(attn_mask=strided)}, None),
    ]


def packed_row(total: int) -> tuple[str, Callable[[], None], dict[str, Callable[[], None]], Any]:
    gen = torch.Generator().manual_seed(total)
    q, k, v = (torch.randn(total, HEADS, DIM, generator=gen).requires_grad_() for _ in range(3))
    grad = torch.randn(total, HEADS, DIM, generator=gen)
    length = total // DOCUMENTS
    cu = torch.arange(0, total + 1, length, dtype=torch.int32)
    run = _adapter(packed=True)
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))

    def per_document() -> torch.Tensor:
        heads_first = lambda t, a, b: t[a:b].transpose(0, 1)[None]  # noqa: E731
        return torch.cat([F.scaled_dot_product_attention(heads_first(q, a, b), heads_first(k, a, b),
                                                         heads_first(v, a, b), is_causal=True)[0].transpose(0, 1)
                          for a, b in bounds])

    goal = ("packed_vs_per_document", "SDPA per document") if total == PACKED else None
    ours = _step(lambda: run.varlen(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=length,
                             max_seqlen_k=length), [q, k, v], grad)
    return (f"packed ({DOCUMENTS} docs, causal)", ours, {"SDPA per document": _step(per_document, [q, k, v], grad)},
            goal)


def flex_forward(seq: int, repeats: int) -> dict[str, Any]:
    """Forward only: the reference vs torch's compiled flex_attention, window 256."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    gen = torch.Generator().manual_seed(seq)
    q, k, v = (torch.randn(BATCH, seq, HEADS, DIM, generator=gen) for _ in range(3))
    run = _adapter(sink_sliding_window=WINDOW[0])
    mask = create_block_mask(lambda b, h, qi, ki: (qi >= ki) & (qi - ki <= WINDOW[0]), None, None, seq, seq,
                             device="cpu")
    compiled = torch.compile(flex_attention)
    bhsd = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
    with torch.no_grad():
        started = time.perf_counter()
        compiled(*bhsd, block_mask=mask)
        compile_s = time.perf_counter() - started
        compiled(*bhsd, block_mask=mask)
        run(q, k, v, causal=True, window_size=WINDOW)
        timing = c.interleaved({"reference": lambda: run(q, k, v, causal=True, window_size=WINDOW),
                                "flex (compiled)": lambda: compiled(*bhsd, block_mask=mask)},
                               repeats=repeats, scale=1e3)
    return {"seq": seq, "timing": timing, "compile_s": compile_s}


# -- memory, each in its own process ----------------------------------------------------
def _memory_child(which: str, seq: int) -> None:
    q, k, v = (torch.randn(1, seq, 1, DIM).requires_grad_() for _ in range(3))
    grad = torch.randn(1, seq, 1, DIM)
    run = _adapter(heads=1, sink_sliding_window=WINDOW[0])
    with c.PeakRSS() as peak:
        if which == "reference":
            run(q, k, v, causal=True, window_size=WINDOW).backward(grad)
        else:
            F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True).backward(grad.transpose(1, 2))
    print(json.dumps({"mib": peak.mib}))


def memory(which: str, seq: int) -> float:
    out = subprocess.run([sys.executable, "-m", f"benchmarks.{NAME}", "--memory-child", which, str(seq)],
                         check=True, capture_output=True, text=True, cwd=c.ROOT)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["mib"])


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="dense sequence lengths")
    parser.add_argument("--packed", type=int, nargs="+", default=[PACKED], help="packed token counts")
    parser.add_argument("--repeats", type=int, default=3, help="samples per side")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--no-flex", action="store_true", help="skip the compiled flex_attention rows")
    parser.add_argument("--memory-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        c.set_threads(args.threads)
        _memory_child(args.memory_child[0], int(args.memory_child[1]))
        return 0
    started, env = c.begin(NAME, "the reference's own paths vs the best torch alternative, forward + backward, ms",
                           args.threads)

    rows, results = [], []
    cases = [(seq, row) for seq in args.sizes for row in dense_rows(seq)]
    cases += [(total, packed_row(total)) for total in args.packed]
    for size, (label, ours, others, goal) in cases:
        candidates = {"reference": ours, **others}
        for fn in candidates.values():
            fn()  # warm-up
        timing = c.interleaved(candidates, repeats=args.repeats, scale=1e3)
        ref = timing["reference"]["median"]
        for name in others:
            ratio = ref / timing[name]["median"]
            held = goal is not None and goal[1] == name
            ok = ratio <= GOALS[goal[0]] if held else None
            results.append({"size": size, "case": label, "against": name, "reference_ms": timing["reference"],
                            "other_ms": timing[name], "ratio_median": ratio,
                            "goal": GOALS[goal[0]] if held else None, "goal_met": ok})
            rows.append([size, label, name, f"{ref:.1f}", f"{timing[name]['median']:.1f}", f"{ratio:.2f}x",
                         f"{c.verdict(ok)} (<= {GOALS[goal[0]]}x)" if held else "-"])
    print(c.table(["S/T", "reference path", "against", "reference ms", "other ms", "ratio", "goal"], rows))

    flex = [] if args.no_flex else [flex_forward(seq, args.repeats) for seq in args.sizes]
    if flex:
        print("\nforward only, window 256: reference vs torch flex_attention compiled on CPU (ms, median)")
        print(c.table(["S", "reference", "flex (compiled)", "ratio", "flex compile s"],
                      [[f["seq"], f"{f['timing']['reference']['median']:.1f}",
                        f"{f['timing']['flex (compiled)']['median']:.1f}",
                        f"{f['timing']['reference']['median'] / f['timing']['flex (compiled)']['median']:.2f}x",
                        f"{f['compile_s']:.1f}"] for f in flex]))

    ours_8k, sdpa_8k, ours_32k = memory("reference", 8192), memory("sdpa", 8192), memory("reference", 32768)
    mem_ratio = ours_8k / max(sdpa_8k, 1e-6)
    mem = {"reference_8k_mib": ours_8k, "sdpa_causal_8k_mib": sdpa_8k, "ratio_8k": mem_ratio,
           "ratio_goal_met": mem_ratio <= GOALS["memory_vs_causal"], "reference_32k_mib": ours_32k,
           "limit_32k_goal_met": ours_32k < GOALS["memory_32k_mib"]}
    print("\nforward + backward peak RSS growth, one head, window 256 (MiB, fresh process each)")
    print(c.table(["S", "reference", "SDPA causal", "ratio", "goal"],
                  [[8192, f"{ours_8k:.0f}", f"{sdpa_8k:.0f}", f"{mem_ratio:.2f}x",
                    f"{c.verdict(mem['ratio_goal_met'])} (<= {GOALS['memory_vs_causal']}x)"],
                   [32768, f"{ours_32k:.0f}", "-", "-",
                    f"{c.verdict(mem['limit_32k_goal_met'])} (< {GOALS['memory_32k_mib']} MiB)"]]))
    print(f"\nfloat32, B={BATCH}, {HEADS} heads, head dim {DIM}; {args.threads} intra-op thread(s).")
    path = c.write_json(NAME, {"benchmark": NAME, "environment": env, "threads": args.threads,
                               "shape": {"B": BATCH, "H": HEADS, "D": DIM}, "results": results,
                               "flex_forward": flex, "memory": mem})
    c.footer(path, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
