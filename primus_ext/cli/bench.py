"""``primus-ext bench [NAME ...]``: run the benchmarks of a source checkout.

The benchmarks are not part of the installed package: they live in ``benchmarks/`` at
the root of the repository, next to ``primus_ext/``.  This command finds that folder
(from the current directory upwards, then next to the imported ``primus_ext``, which
is the checkout itself for an editable install) and runs each requested benchmark as
``python -m benchmarks.NAME`` from the repository root, one process per benchmark, so
that one benchmark's threads, caches and memory never colour the next one's figures.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

PACKAGE = "benchmarks"


def find_checkout(start: Optional[Path] = None) -> Optional[Path]:
    """The repository root holding ``benchmarks/__init__.py``, or None."""
    here = (start or Path.cwd()).resolve()
    import primus_ext

    candidates = [here, *here.parents, Path(primus_ext.__file__).resolve().parent.parent]
    for root in candidates:
        if (root / PACKAGE / "__init__.py").is_file():
            return root
    return None


def benchmark_names(root: Path) -> list[str]:
    """The names in ``benchmarks.NAMES`` (read without importing), else the modules on disk."""
    init = root / PACKAGE / "__init__.py"
    for node in ast.parse(init.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "NAMES" for t in node.targets):
            return [str(n) for n in ast.literal_eval(node.value)]
    return sorted(p.stem for p in (root / PACKAGE).glob("*.py") if not p.name.startswith("_"))


def run_bench(names: Sequence[str], list_only: bool = False) -> int:
    root = find_checkout()
    if root is None:
        print("primus-ext bench: no benchmarks/ folder found. The benchmarks ship with the source, not with "
              "the installed package: run this command inside a clone of the repository "
              "(or `python -m benchmarks.NAME` from its root).", file=sys.stderr)
        return 2
    available = benchmark_names(root)
    if list_only:
        print("\n".join(available))
        return 0
    unknown = [n for n in names if n not in available]
    if unknown:
        print(f"primus-ext bench: unknown benchmark(s) {', '.join(unknown)}; available: {', '.join(available)}",
              file=sys.stderr)
        return 2
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    done = []
    for name in names or available:
        print(f"=== {name} " + "=" * max(0, 60 - len(name)), flush=True)
        start = time.perf_counter()
        code = subprocess.call([sys.executable, "-m", f"{PACKAGE}.{name}"], cwd=root, env=env)
        done.append((name, code, time.perf_counter() - start))
        print(flush=True)
    width = max(len(n) for n, _, _ in done)
    for name, code, seconds in done:
        print(f"{name:<{width}}  {'ok' if code == 0 else f'exit {code}'}  {seconds:6.1f} s")
    print(f"results: {root / PACKAGE / 'results'}")
    return 0 if all(code == 0 for _, code, _ in done) else 1


__all__ = ["benchmark_names", "find_checkout", "run_bench"]
