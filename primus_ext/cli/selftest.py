"""``primus-ext selftest [CONFIG]``: run each distinct route of a config once against the reference.

On a machine with Primus-Turbo and a GPU this is the model-build self-test, on demand.
Without Primus-Turbo it runs against the CPU fake, so a config and the harness itself
can be tried anywhere; ``--fault`` switches on one of the fake's known silent defects,
which the self-test must catch (exit 2, naming the route).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator, Optional, Sequence

from ..backends import turbo_import_problem
from ..errors import UnsupportedConfigError
from ..plan.plan import AttentionPlan
from ..call.selftest import RouteResult, clear, refuse_failures, self_test
from ..testing import fake_primus_turbo
from ..testing._fake_math import FAULTS, unknown_faults
from .check import _plans, format_table
from .config_input import REFUSED, read_input
from .render import layer_list
from .turbo_build_option import build_option_problem, stand_in_note

DEFAULT_CONFIG = {  # a small layer with a sink and a two-sided window (the route AITER gets wrong)
    "use_turbo_attention": True, "use_turbo_flex_attention": True, "turbo_flex_attention_backend": "turbo",
    "num_layers": 1, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
    "use_sink_attention": True, "packed_sequences": False,
    "turbo_flex_attention_mask_mod": "primus_ext.attention.masks:sliding_window",
    "turbo_flex_attention_mask_mod_kwargs": {"left": 8, "right": 4},
}


@contextlib.contextmanager
def _turbo(faults: Sequence[str], arch: Optional[str], build: Optional[str] = None) -> Iterator[str]:
    if not turbo_import_problem() and not faults:
        yield "installed Primus-Turbo"
        return
    # The fake presents --arch, so its calls are dispatched to the kernel backends that arch has.
    with fake_primus_turbo(faults=tuple(faults), arch=arch, kernels=build or "a6a16cd"):
        yield (f"the CPU fake of Primus-Turbo{f' as {arch}' if arch else ''}"
               + (f" with faults {', '.join(faults)}" if faults else "") + f"; {stand_in_note(build)}")


def run_selftest(path: Optional[str], arch: Optional[str] = None, faults: Sequence[str] = (),
                 out=None, err=None, turbo_build: Optional[str] = None, primus_root: Optional[str] = None) -> int:
    """Print one row per route (under autotune, per route and candidate backend, the route naming the
    backend it pinned); 0 when every route agrees with the reference, else 2.  The file is read as
    ``check`` reads it (`config_input.read_input`: a Primus experiment merged from ``primus_root``)."""
    out, err = out or sys.stdout, err or sys.stderr
    unknown = unknown_faults(faults)
    if unknown:
        print(f"primus-ext selftest: [--fault] unknown fault {', '.join(map(repr, unknown))}; give one of "
              f"{', '.join(sorted(FAULTS))}.", file=err)
        return REFUSED
    problem = build_option_problem(turbo_build, arch)
    if problem:
        print(problem, file=err)
        return REFUSED
    found = read_input(path, out, err, arch=arch, primus_root=primus_root,
                       default=(DEFAULT_CONFIG, "the default config"))
    if isinstance(found, int):
        return found
    if found.idle:
        print(f"{found.idle} Nothing to self-test.", file=out)
        return 0
    config, settings = found.config, found.settings
    clear()
    with _turbo(faults, arch, turbo_build) as what:
        outcomes = _plans(settings, config)
        refused = [o for _, o in outcomes if isinstance(o, UnsupportedConfigError)]
        if refused:
            print(f"the plan refuses {path or 'the default config'}; nothing to self-test:", file=err)
            for exc in refused[:1]:
                print(exc, file=err)
            return REFUSED
        plans = [o for _, o in outcomes if isinstance(o, AttentionPlan)]
        results = self_test(plans)
    print(f"primus-ext selftest: {path or 'default config'} against {what}", file=out)
    columns = ("route", "kernels", "fwd error", "bwd error", "ms", "verdict")
    rows = [(r.route, r.kernels, f"{r.forward_error:.2e}", f"{r.backward_error:.2e}", f"{r.ms:.0f}",
             _verdict(r)) for r in results]
    print(format_table(rows, columns), file=out)
    for r in results:
        if r.ok and r.skipped:
            print(f"skipped [{r.route}]: {r.skipped}", file=out)
    if not results:
        print("no Turbo or FlexAttention route to test (reference backend, or context-parallel / fp8 entries)",
              file=out)
    try:
        refuse_failures(results, layer_list([plan.layer_number for plan in plans]))
    except UnsupportedConfigError as exc:
        print(exc, file=err)
        return REFUSED
    return 0


def _verdict(r: RouteResult) -> str:
    if not r.ok:
        return "FAILED"
    if r.skipped:
        return "skipped"
    return "ok (forward only)" if r.unchecked else "ok"


__all__ = ["run_selftest"]
