"""``primus-ext convert-checkpoint SRC DST --to primus_ext|primus``: a whole torch_dist checkpoint's
learned sinks in the other project's form (`primus_ext.megatron.checkpoint.convert_checkpoint`).

Prints what was renamed and copied.  Exit status: 0 when written, 2 on a refusal (a Primus
source saved at tensor_model_parallel_size > 1, a non-empty DST, a source that is not a
torch_dist checkpoint), like ``check``.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Optional

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def add_parser(sub: Any) -> None:
    """The ``convert-checkpoint`` subcommand on ``primus-ext``'s subparsers."""
    convert = sub.add_parser("convert-checkpoint", help="move learned sinks between Primus's and primus_ext's "
                             "Megatron (torch_dist) checkpoints")
    convert.add_argument("src", metavar="SRC", help="an iteration directory (iter_XXXXXXX), or a save directory "
                         "with Megatron's latest_checkpointed_iteration.txt")
    convert.add_argument("dst", metavar="DST", help="a new or empty directory for the converted checkpoint")
    convert.add_argument("--to", required=True, choices=("primus_ext", "primus"),
                         help="primus_ext: Primus's core_attention.sinks -> softmax_offset; primus: the reverse")
    convert.add_argument("--params-dtype", choices=tuple(DTYPES), default=None,
                         help="dtype of the sinks for --to primus_ext (default: the source's args.params_dtype)")


def run_convert(src: str, dst: str, to: str, params_dtype: Optional[str] = None) -> int:
    """Convert ``src`` into ``dst``; our errors propagate to ``main``, which prints them and exits 2."""
    import torch

    from .. import refusals as R  # not at import: `primus-ext` prints its loading line before torch loads
    from ..megatron.checkpoint import convert_checkpoint

    if not os.path.exists(src):
        raise R.refuse_option(R.CLI_OPTION, option="SRC", what=f"SRC {src} does not exist",
                              alternative="give an iteration directory (iter_XXXXXXX) or a save directory.")
    if params_dtype and to == "primus":  # Primus's sinks parameter is float32 whatever the model's dtype
        raise R.refuse_option(R.CLI_OPTION, option="--params-dtype", what="--params-dtype sets the dtype of the "
                              "sinks written for --to primus_ext; --to primus writes Primus's float32 sinks",
                              alternative="leave --params-dtype out with --to primus.")
    dtype = getattr(torch, DTYPES[params_dtype]) if params_dtype else None
    with warnings.catch_warnings():
        # megatron-core 0.16 calls torch's deprecated checkpoint APIs: torch's notice, not the user's concern
        warnings.simplefilter("ignore", FutureWarning)
        done = convert_checkpoint(src, dst, to=to, params_dtype=dtype)
    print(f"primus-ext: {done.source} -> {done.target} ({to})")
    for old, new in done.renamed:
        print(f"  {old} -> {new}")
    print(f"  {len(done.renamed)} sink tensors renamed, {done.copied_tensors} tensors and "
          f"{done.copied_objects} objects copied unchanged, the common state copied")
    return 0


__all__ = ["add_parser", "run_convert"]
