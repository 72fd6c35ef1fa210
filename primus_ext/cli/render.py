"""Pictures of attention patterns for ``primus-ext check``: ASCII in the terminal, PNG on request.

A grid has one row per query position and one column per key/value position.  When
the sequence is longer than `GRID_SIZE`, both axes sample every ``stride``-th token
(0, stride, 2*stride, ...), so a window of ``W`` tokens shows as a band of
``W // stride + 1`` cells and the picture still has the shape of the whole mask;
each cell is exact for the two positions it names.  A layer with a sink gets an
extra ``S`` column at the left: the sink logit every query may attend to.

Layers whose pictures are identical (same mask, same sink, same description) form
one *kind* and are drawn once, titled with the layers that share it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from torch import Tensor

from ..attention.library import library_name
from ..backends.exact import mask_from_mask_mod
from .. import refusals as R
from ..plan.plan import AttentionPlan

GRID_SIZE = 16
"""Most query (and key) positions a grid shows."""

ALLOWED, MASKED, SINK = "#", ".", "S"


def grid_positions(seq_length: int, size: int = GRID_SIZE) -> tuple[int, ...]:
    """Token positions on each axis: all of them up to ``size``, else every ``stride``-th."""
    if seq_length < 1:
        raise ValueError(f"seq_length must be >= 1, got {seq_length}")
    stride = max(1, math.ceil(seq_length / size))
    return tuple(range(0, seq_length, stride))


def _plan_mask(plan: AttentionPlan, positions: Sequence[int]) -> Tensor:
    """``[n, n]`` booleans: may query ``positions[i]`` see key ``positions[j]``."""
    pos = torch.tensor(positions, dtype=torch.int64)
    if plan.pattern is not None:
        return plan.pattern.allows(pos[:, None], pos[None, :])
    assert plan.mask_mod is not None, "build_plan gives a pattern or a mask_mod"
    user_mod = plan.mask_mod

    def sampled(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        # Grid index i stands for token pos[i]; the user's mask sees real token positions.
        return user_mod(b, h, pos[q_idx], pos[kv_idx])

    n = len(positions)
    mask = mask_from_mask_mod(sampled, 1, 1, n, n, torch.device("cpu"))  # batch 0, head 0
    return mask.expand(1, 1, n, n)[0, 0]


def describe_mask(plan: AttentionPlan) -> str:
    """What the grid shows, in words: the recognised pattern or the custom hook's name."""
    if plan.pattern is not None:
        text = plan.pattern.describe()
        if plan.mask_hook:
            text += f" (mask_mod {plan.mask_hook})"
    else:
        name = library_name(plan.mask_mod) or plan.mask_hook or "mask_mod"
        text = f"custom mask {name}"
    if plan.shared_prefix:
        text += ", inside each packed document; in a shared-prefix row each response also sees its whole prompt"
    elif plan.packed:
        text += ", inside each packed document"
    if plan.sink:
        text += ", with sink"
    return text


@dataclass(frozen=True)
class LayerKind:
    """One distinct picture and the layers that share it."""

    layers: tuple[int, ...]
    description: str
    sink: bool
    positions: tuple[int, ...]
    seq_length: int
    allowed: tuple[tuple[bool, ...], ...]

    @property
    def stride(self) -> int:
        return self.positions[1] - self.positions[0] if len(self.positions) > 1 else 1

    @property
    def title(self) -> str:
        return f"{layer_list(self.layers)}: {self.description}"


def layer_list(numbers: Iterable[int]) -> str:
    """``layer 2`` / ``layers 1, 3, 5-8``: consecutive runs shortened."""
    nums = sorted(set(numbers))
    runs: list[list[int]] = []
    for n in nums:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    parts = [str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" if len(r) > 2 else f"{r[0]}, {r[1]}" for r in runs]
    return ("layer " if len(nums) == 1 else "layers ") + ", ".join(parts)


def layer_kinds(plans: Sequence[AttentionPlan], seq_length: int, size: int = GRID_SIZE) -> list[LayerKind]:
    """Group the plans by picture, in order of each kind's first layer."""
    positions = grid_positions(seq_length, size)
    groups: dict[tuple, list[int]] = {}
    for plan in plans:
        mask = _plan_mask(plan, positions)
        rows = tuple(tuple(bool(x) for x in row) for row in mask.tolist())
        key = (describe_mask(plan), plan.sink, rows)
        groups.setdefault(key, []).append(plan.layer_number)
    return [
        LayerKind(tuple(layers), desc, sink, positions, seq_length, rows)
        for (desc, sink, rows), layers in groups.items()
    ]


def _axis_text(kind: LayerKind) -> str:
    if kind.stride == 1:
        return f"q x kv = {len(kind.positions)} x {len(kind.positions)} tokens (seq_length {kind.seq_length})"
    n, s = len(kind.positions), kind.stride
    return (f"q x kv = {n} x {n} sampled positions 0, {s}, ..., {kind.positions[-1]} "
            f"of seq_length {kind.seq_length}")


def ascii_grid(kind: LayerKind) -> str:
    """The kind's title and grid: rows are query positions, ``#`` allowed, ``.`` masked.

    Each row reads ``<query position> | [S] cells...``; the key positions are the same
    list as the query positions.
    """
    width = len(str(kind.positions[-1]))
    lines = [kind.title, f"  {_axis_text(kind)}; {ALLOWED} allowed, {MASKED} masked"
             + (f", {SINK} sink" if kind.sink else "")]
    for pos, row in zip(kind.positions, kind.allowed):
        cells = " ".join(ALLOWED if ok else MASKED for ok in row)
        lines.append(f"  {pos:>{width}} | " + (f"{SINK} " if kind.sink else "") + cells)
    return "\n".join(lines)


def write_png(kinds: Sequence[LayerKind], path: str) -> None:
    """One subplot per kind (allowed / masked, sink column at the left) written to ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise R.refuse_option(R.CLI_OPTION, option="--picture", what=f"--picture needs matplotlib ({exc})",
                             alternative="install it with pip install 'primus-ext[cli]'.") from exc
    if not kinds:
        raise R.refuse_option(R.CLI_OPTION, option="--picture", what="--picture: no layer can run, so there is no "
                             "pattern to draw", alternative="fix the refusals check prints first.")
    colours = ["#f2f2f2", "#2b6cb0", "#d69e2e"]  # masked, allowed, sink
    cols = min(len(kinds), 3)
    rows = math.ceil(len(kinds) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 4.6 * rows), squeeze=False)
    for ax in axes.flat[len(kinds):]:
        ax.axis("off")
    for ax, kind in zip(axes.flat, kinds):
        grid = [[1 if ok else 0 for ok in row] for row in kind.allowed]
        labels = [str(p) for p in kind.positions]
        if kind.sink:
            grid = [[2] + row for row in grid]
            labels = [SINK] + labels
        ax.imshow(grid, cmap=ListedColormap(colours), vmin=0, vmax=2, interpolation="nearest")
        n = len(kind.positions)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=90, fontsize=6)
        ax.set_yticks(range(n))
        ax.set_yticklabels(labels[1:] if kind.sink else labels, fontsize=6)
        if kind.sink:
            ax.axvline(0.5, color="black", linewidth=1)
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
        ax.set_title(_wrap(kind.title, 40) + "\n" + _wrap(_axis_text(kind), 48), fontsize=8)
    handles = [Patch(color=colours[1], label="allowed"), Patch(color=colours[0], label="masked")]
    if any(k.sink for k in kinds):
        handles.append(Patch(color=colours[2], label="sink"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    try:
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)


def _wrap(text: str, width: int) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width)) or text


__all__ = ["GRID_SIZE", "LayerKind", "ascii_grid", "describe_mask", "grid_positions", "layer_kinds",
           "layer_list", "write_png"]
