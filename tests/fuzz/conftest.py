"""Fuzz profiles, the gloo world for the Megatron cases, and the session tally.

Profiles (hypothesis): ``ci`` is the default for these tests; ``long`` is selected
with ``python -m pytest tests/fuzz --hypothesis-profile=long`` (or with
``PRIMUS_FUZZ_PROFILE=long`` when the whole ``tests`` folder is run, because this
conftest is then loaded after the command line has been read).  ``max_examples``
counts per test function, and there are two: adapter level and Megatron level.
No example database is written: a failure prints its reproduction blob instead.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings

from tests.megatron.conftest import megatron_world  # noqa: F401  (gloo world + parallel state)

_COMMON = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                      HealthCheck.filter_too_much])
# ci: a fixed seed (derandomised); tests/fuzz takes ~35 s on an idle 2-core machine.
settings.register_profile("ci", max_examples=1500, derandomize=True, print_blob=True, **_COMMON)
# long: >= 10,000 examples per test function, fresh random cases on each run.
settings.register_profile("long", max_examples=10_000, print_blob=True, **_COMMON)
if os.environ.get("PRIMUS_FUZZ_PROFILE") in ("ci", "long"):
    settings.load_profile(os.environ["PRIMUS_FUZZ_PROFILE"])


class Tally:
    """What the fuzzer saw: one entry per generated case (shrinking included)."""

    OUTCOMES = ("refused", "matched", "mismatched", "foreign")

    def __init__(self) -> None:
        self.outcomes: Counter = Counter()
        self.by_level: Counter = Counter()
        self.refusals: Counter = Counter()
        self.grads = 0
        self.first_problem = ""
        self.by_hook: Counter = Counter()
        self.features: Counter = Counter()
        """Cases per crossed feature (compiled, an arch of the fake, packed, no query, hooks, ...)."""

    def record(self, case, outcome: str, detail: str) -> None:
        assert outcome in self.OUTCOMES, outcome
        self.outcomes[outcome] += 1
        for feature in features(case):
            self.features[feature] += 1
        self.by_level[(case.level, outcome)] += 1
        if case.flex:
            for spec in (case.mask_hook, case.score_hook):
                if spec and spec.startswith("tests.fuzz.user_hooks:"):
                    where = "turbo" if case.resolved_backend == "turbo" and case.fake is not None else (
                        "flex" if case.resolved_backend == "flex" else "reference")
                    self.by_hook[(spec.partition(":")[2], where, outcome)] += 1
        if outcome == "refused":
            self.refusals[detail] += 1
        elif outcome == "matched" and case.grad:
            self.grads += 1
        elif outcome in ("mismatched", "foreign") and not self.first_problem:
            self.first_problem = detail

    def record_multiprocess(self, world: str, outcome: str, detail: str) -> None:
        """One case of the multi-process profile (``tp2`` / ``cp2``), agreed over its ranks."""
        assert outcome in self.OUTCOMES, outcome
        self.outcomes[outcome] += 1
        self.by_level[("multi-process", outcome)] += 1
        self.features[f"multi-process:{world}"] += 1
        if outcome == "refused":
            self.refusals[detail] += 1

    @property
    def cases(self) -> int:
        return sum(self.outcomes.values())

    def lines(self) -> list[str]:
        o = self.outcomes
        out = [f"cases={self.cases} refused={o['refused']} matched={o['matched']} "
               f"mismatched={o['mismatched']} foreign_exceptions={o['foreign']} "
               f"(gradients checked in {self.grads} matched cases)"]
        for level in ("adapter", "megatron", "multi-process"):
            parts = " ".join(f"{k}={self.by_level[(level, k)]}" for k in self.OUTCOMES)
            out.append(f"  {level:8s} {parts}")
        top = ", ".join(f"{key or '?'}: {n}" for key, n in self.refusals.most_common(12))
        out.append(f"  refusals by rule: {top}")
        hooks = sorted({name for name, _, _ in self.by_hook})
        if hooks:
            out.append("  user hooks, matched/refused on turbo | on reference | on flex:")
            parts = [f"{name} " + "|".join(f"{self.by_hook[(name, where, 'matched')]}/"
                                           f"{self.by_hook[(name, where, 'refused')]}"
                                           for where in ("turbo", "reference", "flex"))
                     for name in hooks]
            for i in range(0, len(parts), 6):
                out.append("    " + ", ".join(parts[i:i + 6]))
        if self.features:
            shares = ", ".join(f"{name} {n} ({100 * n / self.cases:.1f}%)" for name, n in sorted(self.features.items()))
            out.append(f"  crossed features: {shares}")
        if self.first_problem:
            out.append(f"  first problem: {self.first_problem}")
        return out


def features(case) -> list[str]:
    """The features one case crosses, for the tally's shares (docs/reliability.md)."""
    found = [f"level:{case.level}"]
    if getattr(case, "compiled", None):
        found.append(f"compiled:{case.compiled}")
    if case.fake is not None and case.fake.get("arch"):
        found.append(f"arch:{case.fake['arch']}")
    call = case.call
    if call.get("thd"):
        found.append("packed")
    if call.get("batch") == 0 or call.get("q_len") == 0:
        found.append("no-query")
    if case.flex:
        found.append(f"backend:{case.resolved_backend}")
        for spec in (case.mask_hook, case.score_hook):
            if spec:
                module, _, name = spec.partition(":")
                found.append("hook:library" if module.startswith("primus_ext") else "hook:composed" if name in (
                    "combined",) else "hook:user")
    if case.grad:
        found.append("gradients")
    return found


TALLY = Tally()


@pytest.fixture(scope="session")
def fuzz_tally() -> Tally:
    return TALLY


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if TALLY.cases:
        profile = settings.get_current_profile_name()
        terminalreporter.write_sep("=", f"differential fuzzing (hypothesis profile: "
                                        f"{profile if profile in ('ci', 'long') else 'ci'})")
        for line in TALLY.lines():
            terminalreporter.write_line(line)
