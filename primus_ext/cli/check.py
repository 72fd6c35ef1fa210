"""``primus-ext check``: what each layer of a Megatron YAML will run, or why it cannot.

Reads the Turbo keys and Megatron's model-shape keys from one YAML, builds every
layer's plan without allocating a model (hooks are imported and proven, kernels are
not called), and prints:

* a table, one row per layer: path, backend, kernel entries, causal, window, sink,
  packing and what each hook was proven to be;
* an ASCII picture of the attention pattern of each distinct layer kind
  (`primus_ext.cli.render`), and with ``--picture`` the same pictures as a PNG;
* on refusal, every reason of every layer (with the settings it reads and the
  alternative), layers with the same reasons reported together.

A Primus experiment YAML (``modules:``) is first merged as Primus merges it (`check_primus`).

Exit status: 0 when every layer can run, 2 on any refusal or unusable settings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union


import torch

from ..attention.heads import head_range
from ..backends import turbo_import_problem
from ..call.agreement import DROP_IN, PLAN
from ..backends.context_parallel import describe_comm
from .. import refusals as R
from ..errors import Reason, UnsupportedConfigError
from ..megatron.facts import layer_facts
from ..plan import build_plan
from ..plan.build import layer_window
from ..plan.plan import AttentionPlan
from ..settings import TurboAttentionSettings
from ..testing import fake_primus_turbo
from .config_input import REFUSED, read_input
from .render import ascii_grid, layer_kinds, layer_list, write_png
from .turbo_build_option import build_option_problem, stand_in_note

PICTURE_LEN = 512
"""Sequence length of the pictures when the YAML has no seq_length (proofs need none)."""

COLUMNS = ("layer", "path", "backend", "dense entry", "packed entry", "causal", "window", "sink",
           "packing", "hooks (proven as)")

LEGEND = ("entries: '-' = this layer gets no such batches (packed_sequences), "
          "'none' = the installed kernels have no such entry")


Outcome = Union[AttentionPlan, UnsupportedConfigError]


def _plans(settings: TurboAttentionSettings, config: Mapping[str, Any],
           ranks: Optional[dict[int, list[AttentionPlan]]] = None) -> list[tuple[int, Outcome]]:
    """Each layer's plan or refusal.

    Under tensor parallelism every rank's plan is built, its hooks proven for that rank's heads
    (their global index: `primus_ext.attention.heads`); the layer runs when every rank's does, and
    shows tensor-parallel rank 0's plan (``ranks`` gets each layer's plans of all ranks).  The
    heads of a context-parallel rank are some of its tensor-parallel rank's, so they are covered.
    A layer whose facts and window equal an earlier runnable layer's reuses that plan
    under its own number (the layer number enters a plan only through the window).  Refused layers are
    always built afresh, because their reasons quote the layer number.
    """
    out: list[tuple[int, Outcome]] = []
    runnable: dict[tuple, AttentionPlan] = {}
    tp = int(config.get("tensor_model_parallel_size") or 1)
    for layer in range(1, int(config.get("num_layers") or 1) + 1):
        outcomes: list[Outcome] = []
        for rank in range(tp):
            facts = layer_facts(config, layer, tp_rank=rank)
            key = (dataclasses.replace(facts, layer_number=0), layer_window(settings, facts))
            if key in runnable:
                outcomes.append(dataclasses.replace(runnable[key], layer_number=layer))
                continue
            try:
                runnable[key] = plan = build_plan(settings, facts)
                outcomes.append(plan)
            except UnsupportedConfigError as exc:
                outcomes.append(exc)
        if ranks is not None and all(isinstance(o, AttentionPlan) for o in outcomes):
            ranks[layer] = outcomes  # type: ignore[assignment]
        out.append((layer, _across_ranks(layer, outcomes)))
    return out


def _across_ranks(layer: int, outcomes: Sequence[Outcome]) -> Outcome:
    """One layer's outcome from its tensor-parallel ranks': rank 0's plan when every rank runs, else every
    reason, those of only some ranks naming them."""
    refused = [(rank, o) for rank, o in enumerate(outcomes) if isinstance(o, UnsupportedConfigError)]
    if not refused:
        return outcomes[0]
    if len(refused) == len(outcomes) and all(o.reasons == refused[0][1].reasons for _, o in refused):
        return refused[0][1]
    where: dict[Reason, list[int]] = {}
    for rank, exc in refused:
        for reason in exc.reasons:
            where.setdefault(reason, []).append(rank)
    reasons = [r if len(on) == len(outcomes) else R.on_ranks(r, on) for r, on in where.items()]
    return R.refuse_all(reasons, context=f"layer {layer}")


# ----------------------------------------------------------------------------- table
def _entry(plan: AttentionPlan, name: Optional[str], used: bool) -> str:
    if not used:
        return "-"
    return name or "none"


def _causal(plan: AttentionPlan) -> str:
    if plan.pattern is None:
        return "custom"
    return "yes" if plan.pattern.is_causal else "no"


def _window(plan: AttentionPlan) -> str:
    if plan.pattern is None:
        return "custom"
    if plan.pattern.kind in ("full", "causal") or plan.pattern.window in ((-1, -1), (-1, 0)):
        return "-"
    return f"({plan.pattern.left}, {plan.pattern.right})"


def _packing(plan: AttentionPlan) -> str:
    if plan.eod_documents:
        return "documents from EOD, packed THD"
    if plan.mask_documents:
        return "documents from attention_mask, varlen"
    if plan.shared_prefix:
        return "shared prefix (thd)"
    return {True: "packed (thd)", False: "unpacked"}.get(plan.packed, "either")  # type: ignore[arg-type]


def _hooks(plan: AttentionPlan) -> str:
    parts = []
    if plan.mask_hook:
        parts.append(f"mask_mod {plan.mask_hook} -> {plan.mask_recognised} [{plan.mask_class}]")
    if plan.score_hook:
        parts.append(f"score_mod {plan.score_hook} -> {plan.score_recognised} [{plan.score_class}]")
    return "; ".join(parts) or "-"


def _row(layer: int, outcome: Outcome) -> tuple[str, ...]:
    if isinstance(outcome, UnsupportedConfigError):
        n = len(outcome.reasons)
        return (str(layer), "REFUSED", "", "", "", "", "", "", "",
                f"{n} reason{'s' if n != 1 else ''}, listed below")
    p = outcome
    return (str(layer), p.path, p.backend,
            _entry(p, p.dense_entry, p.packed is not True),
            _entry(p, p.packed_entry, p.packed is not False),
            _causal(p), _window(p), "yes" if p.sink else "no", _packing(p), _hooks(p))


def format_table(rows: Sequence[Sequence[str]], columns: Sequence[str] = COLUMNS) -> str:
    """Plain-text table with left-aligned columns and a rule under the header."""
    widths = [max(len(str(r[i])) for r in [columns, *rows]) for i in range(len(columns))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()

    return "\n".join([line(columns), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _backend_notes(plans: Sequence[AttentionPlan]) -> list[str]:
    seen: dict[tuple[str, str, str], list[int]] = {}
    for p in plans:
        seen.setdefault((p.path, p.backend, p.backend_reason), []).append(p.layer_number)
    return [f"{layer_list(layers)}: {path} path on backend {backend} ({why})"
            for (path, backend, why), layers in seen.items()] + _call_notes(plans)


def _call_notes(plans: Sequence[AttentionPlan]) -> list[str]:
    """Whose causal / window_size the flex layers' calls run (``turbo_flex_attention_call_flags``)."""
    groups: dict[tuple[str, bool], list[int]] = {}
    for p in plans:
        if p.flex:
            groups.setdefault((p.call_flags, p.mask_mod is not None), []).append(p.layer_number)
    text = {
        (PLAN, False): "run the plan's causal / window_size; others are refused",
        (DROP_IN, False): "drop-in, each call's own causal / window_size checked by the layer's rules",
    }
    hook = "the hook is the whole mask; causal / window_size other than False / (-1, -1) are refused"
    return [f"calls: {layer_list(layers)}: {hook if hooked else text[flags, False]} "
            f"(turbo_flex_attention_call_flags: {flags}, {'B11' if hooked else 'B34'})"
            for (flags, hooked), layers in groups.items()]


def _refusal_text(refused: Sequence[tuple[int, UnsupportedConfigError]]) -> list[str]:
    """One `UnsupportedConfigError` message per distinct set of reasons, naming its layers."""
    groups: dict[tuple[Reason, ...], list[int]] = {}
    for layer, exc in refused:
        groups.setdefault(tuple(exc.reasons), []).append(layer)
    return [str(R.refuse_all(reasons, context=layer_list(layers)))
            for reasons, layers in groups.items()]


# ---------------------------------------------------------------------------- command
def _header(path: str, config: Mapping[str, Any], seq_length: int, overridden: bool) -> str:
    # the model's heads (before tensor parallelism), as the layers read them: MLA and group_query_attention: false
    # give every query head its own key-value head
    facts = layer_facts({**config, "tensor_model_parallel_size": 1}, 1)
    heads, groups = facts.num_heads, facts.kv_heads
    dims = f"head dim {facts.head_dim}" if facts.v_dim == facts.head_dim else (
        f"head dims q/k {facts.head_dim}, v {facts.v_dim}")
    if overridden:
        seq = f"seq_length {seq_length} (--seq-len)"
    elif config.get("seq_length"):
        seq = f"seq_length {seq_length}"
    else:
        seq = f"seq_length not set ({seq_length} assumed for mask probing and pictures)"
    layers = config.get("num_layers")
    count = f"{layers} layers" if layers else "num_layers not set (1 layer checked)"
    return f"{path}: {count}, {seq}, {heads} query heads / {groups} key-value groups, {dims}"


@contextlib.contextmanager
def _turbo_for(arch: Optional[str], build: Optional[str] = None) -> Iterator[str]:
    """With ``--arch`` and no Primus-Turbo here, plan against the CPU fake's entries, imitating the
    kernel build ``build`` (``--turbo-build``; a6a16cd by default)."""
    if arch is None or not turbo_import_problem():
        yield ""
        return
    with fake_primus_turbo(build="main", kernels=build or "a6a16cd"):
        yield (f"--arch {arch}: Primus-Turbo is not installed here; planned against the entry "
               "signatures of Primus-Turbo main, the build Primus pins (the CPU fake), with that arch's "
               f"kernel dispatch; {stand_in_note(build)}")


def _kernel_notes(plans: Sequence[AttentionPlan]) -> list[str]:
    """``kernels on gfx942: layers 1-4: dense AITER ...``, layers with equal routes together."""
    groups: dict[tuple, list[int]] = {}
    for plan in plans:
        if plan.kernels:
            groups.setdefault((plan.arch, plan.turbo_build.name, plan.kernels, plan.storage), []).append(
                plan.layer_number)
    return [f"kernels on {arch} (Primus-Turbo build {build}): {layer_list(layers)}: {'; '.join(kernels)}; "
            f"q/k/v stored {storage}" for (arch, build, kernels, storage), layers in groups.items()]


def _shared_prefix_notes(plans: Sequence[AttentionPlan]) -> list[str]:
    """How a shared-prefix row runs (B37): its two varlen calls and the merge, named once for the layers."""
    layers = [plan.layer_number for plan in plans if plan.shared_prefix]
    if not layers:
        return []
    return [f"shared-prefix rows: {layer_list(layers)}: 2 varlen calls per row, 'packed' (every prompt, response and "
            "document causal, the sink here) and 'shared-prefix cross' (each tree's responses against its whole "
            "prompt, non-causal), merged through their LSEs; the backward runs each kernel's backward given the merged "
            "output and LSE (B37). Train with primus_ext.megatron.pack_shared_prefix rows on a model prepared by "
            "prepare_shared_prefix(model)"]


def _flex_off_notes(settings: TurboAttentionSettings) -> list[str]:
    """Flex-path keys a direct-path YAML sets: the direct path computes the same attention without them (hooks,
    which would change it, are refused: setting-hook-unused), so they are said, not refused."""
    if settings.use_turbo_flex_attention:
        return []
    defaults = TurboAttentionSettings()
    unused = [f"{key}: {getattr(settings, key)}" for key in ("turbo_flex_attention_backend",
                                                                "turbo_flex_attention_call_flags")
              if getattr(settings, key) != getattr(defaults, key)]
    return [f"not used: {', '.join(unused)} (use_turbo_flex_attention is false: every layer runs the direct path, "
            "Primus-Turbo's flash entries; set use_turbo_flex_attention: true to use them)"] if unused else []


def _flex_notes(plans: Sequence[AttentionPlan]) -> list[str]:
    """Layers on the ``flex`` backend where no GPU is: they plan, but torch's flex_attention has no CPU backward."""
    layers = [plan.layer_number for plan in plans if plan.backend == "flex"]
    if not layers or torch.cuda.is_available():
        return []
    return [f"cannot train here: {layer_list(layers)} run on the flex backend, and torch's flex_attention has no "
            "CPU backward (this machine has no GPU): a training step here is refused at its first backward, and "
            "primus-ext demo refuses to start. They train on a GPU; to train on this CPU set "
            "turbo_flex_attention_backend: reference (or auto, which picks it here)"]


def _cp_notes(config: Mapping[str, Any], plans: Sequence[AttentionPlan]) -> list[str]:
    """``context parallel: layers 1-4: ... runs as Ulysses``, layers with equal settings together."""
    groups: dict[tuple, list[int]] = {}
    for plan in plans:
        facts = layer_facts(config, plan.layer_number)
        if facts.context_parallel_size > 1:
            groups.setdefault((facts.context_parallel_size, facts.cp_comm_type), []).append(plan.layer_number)
    return [f"context parallel: {layer_list(layers)}: {describe_comm(cp, comm)}"
            for (cp, comm), layers in groups.items()]


def _tp_notes(config: Mapping[str, Any], ranks: Mapping[int, Sequence[AttentionPlan]]) -> list[str]:
    """The head ranges hooks are proven for under tensor parallelism, and the ranks whose plans differ."""
    tp = int(config.get("tensor_model_parallel_size") or 1)
    if tp == 1 or not ranks:
        return []
    first = next(iter(ranks.values()))
    spans = ", ".join(f"rank {r}: {head_range(p.head_offset, p.num_heads)}" for r, p in enumerate(first))
    lines = [f"tensor parallel: tensor_model_parallel_size={tp}; mask and score hooks see the model's head index "
             f"and are proven for each rank's heads ({spans})"]
    for layer, plans in ranks.items():
        for rank, plan in enumerate(plans[1:], start=1):
            if _row(0, plan)[1:] != _row(0, plans[0])[1:] or plan.kernels != plans[0].kernels:
                lines.append(f"  tensor-parallel rank {rank}, {plan.describe()}")
    return lines


def _picture_problem(picture: Optional[str]) -> str:
    """Why ``--picture`` cannot be written, found before any plan is printed."""
    if picture is None:
        return ""
    if not picture.lower().endswith(".png"):
        return f"--picture {picture}: the picture is a PNG; give a file name ending in .png"
    folder = os.path.dirname(os.path.abspath(picture))
    if not os.path.isdir(folder):
        return f"--picture {picture}: the folder {folder} does not exist; create it or name another"
    existed = os.path.exists(picture)
    try:  # what the PNG writer would meet after the plans (a read-only or virtual folder, a directory's name)
        with open(picture, "ab"):
            pass
    except OSError as exc:
        return f"--picture {picture}: it cannot be written ({exc.strerror}); name a file in a folder you can write"
    if not existed:
        os.remove(picture)
    return ""


def run_check(path: str, seq_len: Optional[int] = None, picture: Optional[str] = None,
              out=None, err=None, arch: Optional[str] = None, primus_root: Optional[str] = None,
              turbo_build: Optional[str] = None) -> int:
    """Print the plan table and pattern pictures of ``path``; 0 when all layers run, else 2.

    ``arch`` (``--arch gfx942|gfx950``) answers for a Turbo machine from any machine: the
    kernel dispatch of that arch is checked, with the CPU fake standing in for a
    Primus-Turbo that is not installed here.  A Primus experiment YAML is checked as Primus
    merges it, from ``primus_root`` or the installed Primus (`primus_ext.cli.check_primus`).
    ``turbo_build`` (``--turbo-build``) names the Primus-Turbo build whose dispatch ``arch`` is checked for
    where none is installed (`primus_ext.cli.turbo_build_option`).
    """
    out = out or sys.stdout
    err = err or sys.stderr
    problem = build_option_problem(turbo_build, arch) or _picture_problem(picture)
    if problem:
        print(problem, file=err)
        return REFUSED
    found = read_input(path, out, err, arch=arch, primus_root=primus_root, seq_len=seq_len)
    if isinstance(found, int):
        return found
    if found.idle:
        print(found.idle, file=out)
        return 0
    config, settings = found.config, found.settings
    try:
        ranks: dict[int, list[AttentionPlan]] = {}
        with _turbo_for(arch, turbo_build) as note:
            outcomes = _plans(settings, config, ranks)
    except (TypeError, ValueError, ImportError) as exc:
        raise R.refuse_build(R.MODEL_KEYS_UNREAD, path=path, error=exc) from exc
    plans = [o for _, o in outcomes if isinstance(o, AttentionPlan)]
    refused = [(layer, o) for layer, o in outcomes if isinstance(o, UnsupportedConfigError)]
    seq_length = int(config.get("seq_length") or PICTURE_LEN)

    print(_header(path, config, seq_length, seq_len is not None), file=out)
    if note:
        print(note, file=out)
    print(file=out)
    print(format_table([_row(layer, o) for layer, o in outcomes]), file=out)
    if plans:
        print(file=out)
        notes = (_backend_notes(plans) + _kernel_notes(plans) + _shared_prefix_notes(plans) + _flex_notes(plans)
                 + _flex_off_notes(settings)
                 + _cp_notes(config, plans)
                 + _tp_notes(config, ranks))
        for line in notes:
            print(line, file=out)
        if any(cell in ("-", "none") for _, o in outcomes if isinstance(o, AttentionPlan)
               for cell in _row(0, o)[3:5]):
            print(LEGEND, file=out)
        kinds = layer_kinds(plans, seq_length)
        print(f"\nattention pattern of each layer kind (rows: query positions, columns: key positions)",
              file=out)
        for kind in kinds:
            print(file=out)
            print(ascii_grid(kind), file=out)
        if picture:
            write_png(kinds, picture)
            print(f"\npicture of {len(kinds)} layer kind{'s' if len(kinds) != 1 else ''} written to {picture}",
                  file=out)
    elif picture:
        print(f"\nno picture written to {picture}: no layer can run", file=out)
    if refused:
        out.flush()
        print(file=err)
        for text in _refusal_text(refused):
            print(text, file=err)
        return REFUSED
    return 0


__all__ = ["format_table", "run_check"]
