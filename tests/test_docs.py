"""The docs cannot drift from the code: every key and every refusal rule is documented."""

from __future__ import annotations

import re
from pathlib import Path

from primus_ext.plan import RULES
from primus_ext.refusals import BUILD_REFUSALS, CALL_RULES
from primus_ext.settings import SETTING_KEYS

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_every_setting_key_is_in_the_yaml_reference():
    text = (DOCS / "yaml_reference.md").read_text()
    missing = [key for key in SETTING_KEYS if f"`{key}`" not in text]
    assert not missing, f"undocumented keys: {missing}"


def test_every_model_key_check_reads_is_in_the_yaml_reference_s_megatron_table():
    from primus_ext.settings.model_keys import READERS

    table = (DOCS / "yaml_reference.md").read_text().split("## Megatron keys that the plan reads", 1)[1]
    documented = set(re.findall(r"^\| `(\w+)` \|", table, flags=re.M))
    assert documented == set(READERS), (sorted(set(READERS) - documented), sorted(documented - set(READERS)))


def test_refusal_table_matches_the_rules():
    text = (DOCS / "refusals.md").read_text().split("## Refused at call time")[0]
    documented = set(re.findall(r"^\| `([\w-]+)` \|", text, flags=re.M))
    codes = {rule.code for rule in RULES}
    assert documented == codes, (sorted(codes - documented), sorted(documented - codes))


def test_call_time_table_matches_the_catalogue():
    """Every call-time rule (`primus_ext.refusals.CALL_RULES`) has its row, and every row is a rule."""
    text = (DOCS / "refusals.md").read_text().split("## Refused at call time")[1].split("\n## ")[0]
    documented = re.findall(r"^\| `([\w.-]+)` \|", text, flags=re.M)
    assert len(documented) == len(set(documented)), "a code has two rows"
    assert set(documented) == set(CALL_RULES), (sorted(set(CALL_RULES) - set(documented)),
                                                sorted(set(documented) - set(CALL_RULES)))


def test_build_refusal_tables_match_the_catalogue():
    """Every code of the build-time catalogue outside a layer's table (`BUILD_REFUSALS`) has its row in the
    sections after the call-time one, and every row there is a code of it."""
    text = (DOCS / "refusals.md").read_text().split("## Refused at call time")[1].split("\n## ", 1)[1]
    documented = re.findall(r"^\| `([\w.-]+)` \|", text, flags=re.M)
    assert len(documented) == len(set(documented)), "a code has two rows"
    assert set(documented) == set(BUILD_REFUSALS), (sorted(set(BUILD_REFUSALS) - set(documented)),
                                                    sorted(set(documented) - set(BUILD_REFUSALS)))


def test_readme_gives_the_two_commands_and_ci_runs_the_test_one():
    root = DOCS.parent
    readme = (root / "README.md").read_text()
    test_cmd = "bash scripts/setup.sh && .venv/bin/python -m pytest -q"
    assert "bash scripts/setup.sh && .venv/bin/primus-ext demo" in readme
    assert test_cmd in readme
    assert test_cmd in (root / ".ci" / "run").read_text()


def test_every_cited_behaviour_code_is_defined_in_the_docs():
    """A user reading "B16" in a message or a doc finds it in docs/behaviours.md or docs/refusals.md."""
    root = DOCS.parent
    defined = set(re.findall(r"^- \*\*(B\d+)\*\*", (DOCS / "behaviours.md").read_text(), flags=re.M))
    refusal_text = (DOCS / "refusals.md").read_text()
    defined |= set(re.findall(r"^\| `?(B[\w-]+)`? \|", refusal_text, flags=re.M))
    sources = [*DOCS.glob("*.md"), root / "README.md", *(root / "primus_ext").rglob("*.py")]
    cited = {code for path in sources for code in re.findall(r"\bB\d+\b", path.read_text(encoding="utf-8"))}
    assert defined >= set(f"B{n}" for n in range(1, 35))
    assert not cited - defined, sorted(cited - defined)
