"""``primus-ext``: the command line.

* ``primus-ext check CONFIG.yaml``: each layer's plan, or every reason it cannot run.
* ``primus-ext demo [CONFIG.yaml]``: a tiny Megatron GPT trained on CPU through the flex path.
* ``primus-ext bench [NAME ...]``: the benchmarks of a source checkout (``benchmarks/``).
* ``primus-ext convert-checkpoint SRC DST --to primus_ext|primus``: learned sinks between Primus's
  checkpoints and primus_ext's (``convert``).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Optional, Sequence

from ..errors import PrimusExtError
from .convert import add_parser as add_convert_parser

BUILD_NAMES = ("a6a16cd", "pt509")  # primus_ext.backends.turbo_build.BUILDS, kept literal: no torch import to parse
BUILD_HELP = ("the Primus-Turbo build whose kernel dispatch --arch checks where none is installed: a6a16cd "
              "(default), or pt509 (a6a16cd with PT #509, #480, #469, #481 merged)")

# megatron-core announces at import that GPU-only packages are missing; on a laptop
# that is expected and not the user's concern.
_QUIET = ("Transformer Engine and Apex are not installed", "Apex is not installed")


def _primus_root(command: argparse.ArgumentParser) -> None:
    command.add_argument("--primus-root", default=None, metavar="DIR",
                         help="Primus checkout whose configs a Primus experiment YAML is merged from "
                              "(default: the installed primus package)")


def _loading(command: str) -> None:
    """Say what the first seconds go to, where a person watches: importing torch and megatron-core."""
    if sys.stderr.isatty():
        print(f"primus-ext {command}: loading torch and megatron-core ...", file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="primus-ext", description="FlexAttention masks on Primus-Turbo kernels.")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="print each layer's attention plan for a Megatron YAML")
    check.add_argument("config", help="Megatron-style YAML with model-shape and Turbo keys")
    check.add_argument("--seq-len", type=int, default=None, help="override seq_length")
    check.add_argument("--picture", default=None, help="write the attention pattern of each layer kind to this PNG")
    check.add_argument("--arch", choices=("gfx942", "gfx950"), default=None,
                       help="check Primus-Turbo's kernel dispatch for this GPU (MI300 = gfx942, MI355 = gfx950)")
    check.add_argument("--turbo-build", choices=BUILD_NAMES, default=None, help=BUILD_HELP)
    _primus_root(check)
    demo = sub.add_parser("demo", help="train a tiny Megatron GPT on CPU through the flex path")
    demo.add_argument("config", nargs="?", default=None, help="YAML (default: the embedded example)")
    demo.add_argument("--steps", type=int, default=None, help="training steps")
    _primus_root(demo)
    selftest = sub.add_parser("selftest", help="run each distinct Turbo or FlexAttention route of a config once against the reference")
    selftest.add_argument("config", nargs="?", default=None, help="YAML (default: a small config of common kinds)")
    selftest.add_argument("--arch", choices=("gfx942", "gfx950"), default=None, help="plan for this GPU")
    selftest.add_argument("--turbo-build", choices=BUILD_NAMES, default=None, help=BUILD_HELP)
    selftest.add_argument("--fault", action="append", default=[], metavar="NAME",
                          help="switch on a known silent defect of the CPU fake (sink_backward_ignores_right_window)")
    _primus_root(selftest)
    bench = sub.add_parser("bench", help="run the benchmarks of a source checkout (all, or the NAMEs given)")
    bench.add_argument("names", nargs="*", metavar="NAME", help="benchmark names (default: all)")
    bench.add_argument("--list", action="store_true", help="list the benchmark names and exit")
    add_convert_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    for text in _QUIET:
        warnings.filterwarnings("ignore", message=text)
    if args.command in ("check", "demo", "selftest"):
        _loading(args.command)
    try:
        if args.command == "check":
            from .check import run_check

            return run_check(args.config, args.seq_len, args.picture, arch=args.arch, primus_root=args.primus_root,
                             turbo_build=args.turbo_build)
        if args.command == "selftest":
            from .selftest import run_selftest

            return run_selftest(args.config, args.arch, args.fault, turbo_build=args.turbo_build,
                                primus_root=args.primus_root)
        if args.command == "convert-checkpoint":
            from .convert import run_convert

            return run_convert(args.src, args.dst, args.to, args.params_dtype)
        if args.command == "bench":
            from .bench import run_bench

            return run_bench(args.names, args.list)
        from .demo import run_demo

        return run_demo(args.config, args.steps, primus_root=args.primus_root)
    except BrokenPipeError:  # e.g. `primus-ext check x.yaml | head`: the reader left, not an error
        sys.stderr.close()
        return 0
    except (PrimusExtError, OSError) as exc:
        print(f"primus-ext: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
