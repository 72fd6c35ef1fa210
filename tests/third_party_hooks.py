"""The mask and score factories of attn-gym and torchtitan, as a config reaches them.

A config may only call factories marked ``@primus_ext.hook_factory`` (B32), so each library
factory is called from one of these, with the arguments its docs show.  attn-gym is
imported as installed.  torchtitan's mask factories live in
``torchtitan/models/common/attention.py``, whose imports pull in its training stack
(installed ``--no-deps`` here), so the factory functions are compiled from that installed
file as written, under their own file name, without importing the package.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import attn_gym.masks as gym_masks
import attn_gym.mods as gym_mods
import torch
from torch.nn.attention.flex_attention import _mask_mod_signature, and_masks, or_masks

from primus_ext import hook_factory

_TITAN_FACTORIES = ("get_causal_mask_mod", "get_document_mask_mod", "get_fixed_block_mask_mod",
                    "get_sliding_window_mask_mod")


def _torchtitan_factories() -> dict:
    spec = importlib.util.find_spec("torchtitan")
    assert spec is not None and spec.origin, "torchtitan is not installed (scripts/setup.sh installs it --no-deps)"
    path = Path(spec.origin).parent / "models" / "common" / "attention.py"
    tree = ast.parse(path.read_text(), str(path))
    body = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in _TITAN_FACTORIES]
    assert len(body) == len(_TITAN_FACTORIES), f"torchtitan's {path} no longer defines {_TITAN_FACTORIES}"
    namespace = {"torch": torch, "_mask_mod_signature": _mask_mod_signature, "and_masks": and_masks,
                 "or_masks": or_masks, "__name__": "torchtitan.models.common.attention"}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
    return {name: namespace[name] for name in _TITAN_FACTORIES}


TITAN = _torchtitan_factories()
POSITIONS = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7],
                          [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 5]])
"""torchtitan's per-token positions ([b, s], reset to 0 at each document): 2 sequences of 16 tokens."""
IS_GLOBAL = torch.zeros(16, dtype=torch.bool)
IS_GLOBAL[[0, 5]] = True


# ------------------------------------------------------------------ attn-gym
@hook_factory
def gym_causal():
    return gym_masks.causal_mask


@hook_factory
def gym_sliding_window(window_size: int):
    return gym_masks.generate_sliding_window(window_size)


@hook_factory
def gym_prefix_lm(prefix_length: int):
    return gym_masks.generate_prefix_lm_mask(prefix_length)


@hook_factory
def gym_dilated_sliding_window(window_size: int, dilation: int):
    return gym_masks.generate_dilated_sliding_window(window_size, dilation)


@hook_factory
def gym_global_sliding_window(window_size: int):
    return gym_masks.generate_global_sliding_window(window_size, IS_GLOBAL)


@hook_factory
def gym_alibi(num_heads: int):
    return gym_mods.generate_alibi_bias(num_heads)


@hook_factory
def gym_softcap(soft_cap: int):
    return gym_mods.generate_tanh_softcap(soft_cap)


# ------------------------------------------------------------------ torchtitan
@hook_factory
def titan_causal():
    return TITAN["get_causal_mask_mod"]()


@hook_factory
def titan_sliding_window(window_size: int):
    return TITAN["get_sliding_window_mask_mod"](window_size)


@hook_factory
def titan_fixed_block(fixed_block_size: int):
    return TITAN["get_fixed_block_mask_mod"](fixed_block_size)


@hook_factory
def titan_document():
    return TITAN["get_document_mask_mod"](POSITIONS)


@hook_factory
def titan_sliding_window_and_blocks(window_size: int, fixed_block_size: int):
    return and_masks(TITAN["get_sliding_window_mask_mod"](window_size),
                     TITAN["get_fixed_block_mask_mod"](fixed_block_size))
