"""``primus-ext``: what each layer of a Megatron YAML will run, or why it cannot.

``primus-ext check CONFIG.yaml`` reads the Turbo keys and the model-shape keys of
one Megatron-style YAML, builds every layer's plan without allocating a model, and
prints one line per layer.  Exit 0 when every layer can run, 2 on a refusal.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import yaml

from .errors import PrimusExtError, UnsupportedConfigError
from .megatron.facts import layer_facts
from .plan import build_plan
from .settings import TurboAttentionSettings


def check(path: str, seq_len: Optional[int] = None) -> int:
    with open(path, encoding="utf-8") as fh:
        config = yaml.safe_load(fh) or {}
    try:
        settings = TurboAttentionSettings.from_dict(config)
    except UnsupportedConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    if seq_len is not None:
        config = {**config, "seq_length": seq_len}
    failures: list[str] = []
    for layer in range(1, int(config.get("num_layers", 1)) + 1):
        try:
            print(build_plan(settings, layer_facts(config, layer)).describe())
        except UnsupportedConfigError as exc:
            failures.append(str(exc))
    for text in failures:
        print(text, file=sys.stderr)
    return 2 if failures else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="primus-ext", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_check = sub.add_parser("check", help="print each layer's attention plan for a YAML")
    p_check.add_argument("config")
    p_check.add_argument("--seq-len", type=int, default=None, help="override seq_length")
    args = parser.parse_args(argv)
    try:
        return check(args.config, args.seq_len)
    except (PrimusExtError, OSError) as exc:
        print(f"primus-ext: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
