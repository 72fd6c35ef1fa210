"""BlockMask builds per step on the ``flex`` backend: shared across the layers, or built per layer.

For one packed (THD) row of ``S`` tokens with documents of about ``--doc`` tokens (causal inside each),
one training step of a ``--layers``-layer model asks for the same document BlockMask once per layer:

* ``primus_ext shared``: `primus_ext.backends.flex.FlexBackend.document_block_mask` on the process's kind
  of cache (`primus_ext.backends.flex_cache.BlockMaskCache`), with the step's new ``cu_seqlens`` tensor:
  the first layer builds, the others hit;
* ``primus_ext shared, unchanged``: a step whose boundary tensor is the one already seen: no build;
* ``primus_ext per layer``: every layer builds its own (a cache per layer), as code without the shared
  cache would, and keeps it for its backward: ``--layers`` masks held;
* ``torch create_block_mask``: torch's own ``create_block_mask`` called the usual way (attention-gym's
  document mask from a per-token document-id tensor, ``B = H = None``, default ``BLOCK_SIZE``), once.

Builds are counted (the cache's ``builds``); bytes are those of the BlockMasks held at the end of the
step (block counts and indices) plus what their mask_mods capture (per-token document tensors).  On a CPU
``create_block_mask`` runs eagerly (the backend compiles it only on a GPU): it evaluates the mask at every
cell, O(S^2) time and memory (about 11 GB peak at 32k), so per-layer builds are run up to
``--per-layer-limit`` tokens; above it the row gives ``layers x`` one measured build, marked as not run.

    python -m benchmarks.flex_blockmask [--sizes 8192 32768] [--layers 24] [--repeats 1]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from typing import Any

import torch

from . import _common as c

NAME = "flex_blockmask"


def _boundaries(seq: int, doc: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    lengths, total = [], 0
    while total < seq:
        n = min(int(torch.randint(doc // 2, 3 * doc // 2 + 1, (1,), generator=gen)), seq - total)
        lengths.append(n)
        total += n
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _torch_usual(cu: torch.Tensor, seq: int):
    """attention-gym's document mask: document ids per token, then ``create_block_mask`` once."""
    from torch.nn.attention.flex_attention import create_block_mask

    ids = torch.repeat_interleave(torch.arange(cu.numel() - 1), (cu[1:] - cu[:-1]).long())

    def document_causal(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

    return create_block_mask(document_causal, None, None, seq, seq, device="cpu"), ids.numel() * ids.element_size()


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3f}" if ms < 1 else f"{ms:.1f}"


def _timed(fn) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main(argv: Any = None) -> int:
    from primus_ext.attention.pattern import Pattern
    from primus_ext.backends.flex import FlexBackend
    from primus_ext.backends.flex_cache import BlockMaskCache, block_mask_bytes

    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8192, 32768], help="tokens per packed row (S)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--doc", type=int, default=512, help="mean document length")
    parser.add_argument("--repeats", type=int, default=1, help="steps timed per row (medians)")
    parser.add_argument("--per-layer-limit", type=int, default=8192, help="largest S whose per-layer builds run")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    started, env = c.begin(NAME, f"document BlockMasks per step of {args.layers} layers (CPU, eager "
                                 f"create_block_mask)", args.threads)
    warnings.filterwarnings("ignore", message=".*flex_attention.*")
    causal, cpu = Pattern(-1, 0), torch.device("cpu")
    rows, results = [], []
    for seq in args.sizes:
        cu0 = _boundaries(seq, args.doc)
        docs = cu0.numel() - 1
        samples: dict[str, list[float]] = {}
        counts: dict[str, tuple[int, int, str]] = {}
        # untimed: the first build of a size pays for first-touching its O(S^2) buffers (2x at 32k), which
        # would otherwise count against whichever row runs first
        _torch_usual(cu0, seq)
        for _ in range(args.repeats):
            # shared: a new step's boundary tensor (same values, another object), one cache for every layer
            cache = BlockMaskCache()
            backend = FlexBackend(block_masks=cache)
            cu = cu0.clone()
            t, _ = _timed(lambda: [backend.document_block_mask(causal, cu, cu, seq, seq, cpu)
                                   for _ in range(args.layers)])
            samples.setdefault("shared", []).append(t)
            counts["shared"] = (cache.builds, cache.nbytes, "")
            before = cache.builds
            t, _ = _timed(lambda: [backend.document_block_mask(causal, cu, cu, seq, seq, cpu)
                                   for _ in range(args.layers)])
            samples.setdefault("unchanged", []).append(t)
            counts["unchanged"] = (cache.builds - before, cache.nbytes, "")
            one_build = samples["shared"][-1]
            # per layer: a cache (and a mask) of each layer's own
            if seq <= args.per_layer_limit:
                caches = [BlockMaskCache() for _ in range(args.layers)]
                t, _ = _timed(lambda: [FlexBackend(block_masks=own).document_block_mask(causal, cu, cu, seq, seq, cpu)
                                       for own in caches])
                samples.setdefault("per layer", []).append(t)
                counts["per layer"] = (sum(x.builds for x in caches), sum(x.nbytes for x in caches), "")
            else:
                samples.setdefault("per layer", []).append(args.layers * one_build)
                counts["per layer"] = (args.layers, args.layers * cache.nbytes, f"{args.layers} x one build, not run")
            t, (mask, held) = _timed(lambda: _torch_usual(cu0, seq))
            samples.setdefault("torch", []).append(t)
            counts["torch"] = (1, block_mask_bytes(mask) + held, "once per step, shared by hand")
            del mask
        labels = {"shared": "primus_ext shared (new cu_seqlens)", "unchanged": "primus_ext shared, unchanged",
                  "per layer": "primus_ext per layer", "torch": "torch create_block_mask (usual)"}
        timing = {name: c.summary(values) for name, values in samples.items()}
        for name, label in labels.items():
            builds, nbytes, note = counts[name]
            med = timing[name]["median"]
            rows.append([f"{seq // 1024}k", docs, label, builds, _ms(med),
                         f"{nbytes / 2 ** 20:.2f}", note])
        results.append({"seq": seq, "documents": docs, "layers": args.layers, "timing_s": timing,
                        "builds": {k: v[0] for k, v in counts.items()}, "bytes": {k: v[1] for k, v in counts.items()},
                        "notes": {k: v[2] for k, v in counts.items() if v[2]}})
    print(c.table(["S", "docs", "per step", "builds", "time ms", "MiB held", "note"], rows))
    print(f"\none packed row, causal documents of ~{args.doc} tokens, {args.layers} layers; median of "
          f"{args.repeats} step(s); eager create_block_mask on the CPU (BLOCK_SIZE 128); {args.threads} intra-op "
          f"thread(s).")
    path = c.write_json(NAME, {"environment": env, "results": results})
    c.footer(path, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
