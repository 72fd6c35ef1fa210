"""``primus-ext check``: what each layer of a Megatron YAML will run, or why it cannot.

Reads the Turbo keys and the model-shape keys of one Megatron-style YAML, builds every
layer's plan without allocating a model, and prints one line per layer.  Exit 0 when
every layer can run, 2 on a refusal.
"""

from __future__ import annotations

import sys
from typing import Optional

import yaml

from ..errors import UnsupportedConfigError
from ..megatron.facts import layer_facts
from ..plan import build_plan
from ..settings import TurboAttentionSettings


def run_check(path: str, seq_len: Optional[int] = None, picture: Optional[str] = None) -> int:
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


__all__ = ["run_check"]
