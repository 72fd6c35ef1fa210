"""Cost of `pack_eod_micro_batch` and of reading Megatron's mask per micro-batch, against the attention.

For one micro-batch of ``B`` rows of ``S`` tokens with EOD-separated documents (about one
every 512 tokens), side by side in one run:

* ``convert``: `primus_ext.megatron.pack_eod_micro_batch` (boundaries, positions, loss
  mask; what a ``get_batch`` adds);
* ``from mask``: what a layer does with Megatron's own dense mask instead
  (`primus_ext.megatron.document_mask.document_boundaries`: the boundaries read off the mask
  and the mask held to them, element by element), the first time a mask tensor is seen
  (once per micro-batch) and ``known`` (every other layer of the step), beside
* ``Megatron's build``: megatron-core's ``_get_ltor_masks_and_position_ids`` building that
  mask, row by row, as its dataset does for every sample (both are O(S^2));
* ``dense-mask attention``: one head of the attention Megatron's ``reset_attention_mask``
  would need instead: ``scaled_dot_product_attention`` with the dense ``[B, 1, S, S]``
  document mask, forward only.  One head of one layer is the smallest unit it costs, so
  the ratio is an upper bound of the conversion's share (a model has many heads and
  layers per micro-batch).

The dense-mask attention is O(S^2) in time and memory (1 GiB of mask alone at 32k), so on
a CPU it runs up to ``--dense-limit`` tokens and the row above reports the conversion only.

Goal: convert < 1% of the dense-mask attention on the same batch; reading the mask costs less
than Megatron's building it.

    python -m benchmarks.eod_packing [--sizes 4096 32768] [--repeats 7]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from . import _common as c

NAME = "eod_packing"
EOD = 0
GOAL = 0.01
MASK_GOAL = 1.0


def _batch(rows: int, seq: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 50_000, (rows, seq), generator=gen)
    tokens.view(-1)[torch.randperm(rows * seq, generator=gen)[: rows * seq // 512]] = EOD
    return tokens


def _dense_mask(tokens: torch.Tensor) -> torch.Tensor:
    """Megatron's reset_attention_mask semantics as an allowed-mask: same document and causal."""
    rows, seq = tokens.shape
    after_eod = torch.zeros_like(tokens)
    after_eod[:, 1:] = (tokens[:, :-1] == EOD).long()
    doc = after_eod.cumsum(1)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    return (doc[:, :, None] == doc[:, None, :]).unsqueeze(1) & causal


def main(argv: Any = None) -> int:
    from primus_ext.call.facts import FACTS
    from primus_ext.megatron import pack_eod_micro_batch
    from primus_ext.megatron.document_mask import document_boundaries

    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 32768], help="tokens per row (S)")
    parser.add_argument("--rows", type=int, default=2, help="rows per micro-batch (B)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dense-limit", type=int, default=8192, help="largest S for the dense-mask attention")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    started, env = c.begin(NAME, "EOD -> packed THD conversion vs the dense-mask attention it replaces, ms", args.threads)
    rows, results = [], []
    for seq in args.sizes:
        tokens = _batch(args.rows, seq)
        max_docs = args.rows * seq // 256
        candidates = {"convert": lambda: pack_eod_micro_batch(tokens, eod_token=EOD, max_documents=max_docs,
                                                              eod_mask_loss=True)}
        if seq <= args.dense_limit:
            mask = _dense_mask(tokens)
            megatron_mask = ~mask  # Megatron's convention: True = masked
            q = torch.randn(args.rows, 1, seq, 64, dtype=torch.bfloat16)
            candidates["dense"] = lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
            candidates["from mask"] = lambda: (FACTS.forget(), document_boundaries(
                megatron_mask, args.rows, seq, seq, max_docs))
            candidates["known"] = lambda: document_boundaries(megatron_mask, args.rows, seq, seq, max_docs)
            from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids as ltor

            candidates["Megatron's build"] = lambda: [ltor(row, EOD, True, True, True, True) for row in tokens]
        for fn in candidates.values():
            fn()  # warm-up
        timing = c.interleaved(candidates, repeats=args.repeats, scale=1e3)
        convert = timing["convert"]["median"]
        dense = timing["dense"]["median"] if "dense" in timing else None
        share = convert / dense if dense else None
        from_mask = timing["from mask"]["median"] if "from mask" in timing else None
        known = timing["known"]["median"] if "known" in timing else None
        build = timing["Megatron's build"]["median"] if "Megatron's build" in timing else None
        mask_share = from_mask / build if build else None
        rows.append([f"{seq // 1024}k", args.rows, f"{convert:.3f}",
                     f"{from_mask:.2f}" if from_mask is not None else "-",
                     f"{build:.2f}" if build is not None else "-",
                     f"{1e3 * known:.1f} us" if known is not None else "-",
                     f"{dense:.1f}" if dense else "skipped (CPU)",
                     f"{100 * share:.3f}%" if share is not None else "-",
                     c.verdict(share < GOAL if share is not None else None),
                     f"{mask_share:.2f}x" if mask_share is not None else "-",
                     c.verdict(mask_share < MASK_GOAL if mask_share is not None else None)])
        results.append({"seq": seq, "rows": args.rows, "timing": timing, "share": share, "mask_share": mask_share})
    print(c.table(["S", "B", "convert ms", "from mask ms", "Megatron's build ms", "known",
                   "dense-mask attention ms, 1 head", "convert share", "< 1%", "from mask / build", "< 1x"], rows))
    print(f"\nmedians of {args.repeats} interleaved samples; bf16 q/k/v [B, 1, S, 64]; one EOD per ~512 tokens; "
          f"{args.threads} intra-op thread(s).")
    path = c.write_json(NAME, {"environment": env, "results": results, "goal_share": GOAL,
                               "goal_mask_share": MASK_GOAL})
    c.footer(path, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
