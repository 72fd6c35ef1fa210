"""Shared pieces of the benchmarks: timing, memory, the environment, tables, JSON."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import statistics
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"

# megatron-core's import-time notices about GPU packages a CPU machine does not have.
for _text in ("Transformer Engine and Apex are not installed", "Apex is not installed",
              "full scope is deprecated", ".*tp_group is None.*"):
    warnings.filterwarnings("ignore", message=_text)
warnings.filterwarnings("ignore", category=DeprecationWarning)


# -- environment -----------------------------------------------------------------
def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    found = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    return found.group(1).strip() if found else platform.machine()


def environment() -> dict[str, Any]:
    import torch

    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cores": os.cpu_count(),
        "cpu": _cpu_model(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
    }


def environment_line(env: dict[str, Any]) -> str:
    return (f"{env['date']} | {env['cores']} cores ({env['cpu']}) | torch {env['torch']} "
            f"({env['torch_threads']} intra-op threads) | python {env['python']}")


# -- timing ----------------------------------------------------------------------
def summary(samples: Sequence[float]) -> dict[str, float]:
    return {"min": min(samples), "median": statistics.median(samples), "max": max(samples), "n": len(samples)}


def interleaved(candidates: dict[str, Callable[[], Any]], *, repeats: int, number: int = 1,
                scale: float = 1.0) -> dict[str, dict[str, float]]:
    """Time each candidate ``repeats`` times, alternating between them in every round.

    One sample is the mean time of ``number`` back-to-back calls, times ``scale``
    (1e6 for microseconds).  Alternating spreads the machine's noise over all
    candidates instead of charging it to whichever ran during a busy moment.
    """
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            start = time.perf_counter()
            for _ in range(number):
                fn()
            samples[name].append((time.perf_counter() - start) / number * scale)
    return {name: summary(values) for name, values in samples.items()}


# -- memory ----------------------------------------------------------------------
def _status_kib(key: str) -> Optional[int]:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    found = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
    return int(found.group(1)) if found else None


class PeakRSS:
    """Peak growth of the process's resident memory while the block runs, in MiB.

    Resets the kernel's high-water mark (``/proc/self/clear_refs``, Linux) to the
    current RSS on entry and reads it back (``VmHWM``) on exit.  It counts every
    allocation that touched memory, torch's and Python's alike, which is why it is
    used here rather than ``tracemalloc`` (Python objects only).  ``None`` where the
    kernel does not offer it.
    """

    def __enter__(self) -> "PeakRSS":
        self.mib: Optional[float] = None
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self._ok = True
        except OSError:
            self._ok = False
        self._start = _status_kib("VmRSS")
        return self

    def __exit__(self, *exc: Any) -> None:
        peak = _status_kib("VmHWM")
        if self._ok and peak is not None and self._start is not None:
            self.mib = max(0, peak - self._start) / 1024


# -- output ----------------------------------------------------------------------
def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    rows = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def verdict(ok: Optional[bool]) -> str:
    return "n/a" if ok is None else ("met" if ok else "MISSED")


def write_json(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, sort_keys=False, default=str) + "\n")
    return path


def header(name: str, what: str, env: dict[str, Any]) -> None:
    print(f"benchmarks.{name}: {what}")
    print(environment_line(env))
    print()


def begin(name: str, what: str, threads: Optional[int]) -> tuple[float, dict[str, Any]]:
    """Start a benchmark run: ``threads`` intra-op threads, the header printed; returns the start
    time (for `footer`) and the environment (for the JSON)."""
    started = time.perf_counter()
    set_threads(threads)
    env = environment()
    header(name, what, env)
    return started, env


def footer(path: Path, started: float) -> None:
    print(f"\nwrote {path.relative_to(ROOT)} ({time.perf_counter() - started:.1f} s)")


# -- settings --------------------------------------------------------------------
def set_threads(n: Optional[int]) -> None:
    import torch

    if n:
        torch.set_num_threads(int(n))
