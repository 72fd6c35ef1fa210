"""Every refusal comes from a catalogue: no module builds a reason or a project error by hand.

The two catalogues are the layer's rule table (`primus_ext.plan.rules.RULES`, rendered by `Rule.render`) and
`primus_ext.refusals` (call-time `CALL_RULES`, build-time `BUILD_REFUSALS`, raised through `refuse`,
`refuse_naming`, `refuse_build` and `refuse_all`).  A reason written at a raise site would have no code, no
row in docs/refusals.md and a wording of its own; this scan finds one wherever it is.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from primus_ext import refusals as R
from primus_ext.errors import Reason, UnsupportedConfigError, UnsupportedInputError

PACKAGE = Path(__file__).resolve().parent.parent / "primus_ext"
REFUSAL_TYPES = {"Reason", "UnsupportedConfigError", "UnsupportedInputError", "CompiledCallRefusal", "PrimusExtError"}
"""What carries a refusal to the user: only the catalogues' helpers make one."""
CATALOGUE_HELPERS = {("plan/rule_input.py", "Rule.render")}
"""The rule table's own renderer (the other catalogue's helpers live in `primus_ext/refusals/`)."""
NOT_REFUSALS = {"KernelOutputError": "backends/turbo_pairs_gfx950.py"}
"""Project errors that refuse nothing: the installed Primus-Turbo returned what no binding expects (no
setting of the user's is at fault); raised only where the kernel's output is read."""


def _sources(package: Path) -> list[Path]:
    skipped = ("refusals", "testing")  # the catalogues; the fake raises upstream's own errors
    return [path for path in sorted(package.rglob("*.py"))
            if path.relative_to(package).parts[0] not in skipped and path.name != "errors.py"]


def _called(node: ast.Call) -> str:
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


class _Finder(ast.NodeVisitor):
    """The calls that construct a refusal type (by its name, an alias it was imported as, or as the class of an
    error just caught: ``type(exc)(...)``, ``exc.__class__(...)``), with the function they are in."""

    def __init__(self) -> None:
        self.scope: list[str] = []
        self.found: list[tuple[str, int, str]] = []
        self.aliases: dict[str, str] = {}
        self.caught: list[str] = []

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        self.caught.append(node.name or "")
        self.generic_visit(node)
        self.caught.pop()

    def _of_caught(self, node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id in self.caught

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            if alias.asname and (alias.name in REFUSAL_TYPES or alias.name in NOT_REFUSALS):
                self.aliases[alias.asname] = alias.name

    def _scoped(self, node: ast.AST) -> None:
        self.scope.append(node.name)  # type: ignore[attr-defined]
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_Call(self, node: ast.Call) -> None:
        name = self.aliases.get(_called(node), _called(node))
        func = node.func
        if (isinstance(func, ast.Call) and _called(func) == "type" and func.args and self._of_caught(func.args[0])) or (
                isinstance(func, ast.Attribute) and func.attr == "__class__" and self._of_caught(func.value)):
            name = "a refusal's own class"  # re-making whatever was caught: a project error by hand, or a foreign one
        if name in REFUSAL_TYPES or name in NOT_REFUSALS or name == "a refusal's own class":
            self.found.append((".".join(self.scope), node.lineno, name))
        self.generic_visit(node)


def _hand_built(package: Path = PACKAGE) -> list[str]:
    out = []
    for path in _sources(package):
        relative = path.relative_to(package).as_posix()
        finder = _Finder()
        finder.visit(ast.parse(path.read_text(encoding="utf-8")))
        for scope, line, name in finder.found:
            if (relative, scope) in CATALOGUE_HELPERS or NOT_REFUSALS.get(name) == relative:
                continue
            out.append(f"primus_ext/{relative}:{line} ({scope or 'module'}) builds {name}")
    return out


def test_no_module_builds_a_refusal_outside_the_catalogues():
    found = _hand_built()
    assert not found, "\n".join(found)


def test_the_scan_sees_a_hand_built_refusal(tmp_path):
    """The scan is not vacuous: a module that raises a reason of its own is found (and one through the
    catalogue is not)."""
    fake = tmp_path / "primus_ext"
    (fake / "plan").mkdir(parents=True)
    (fake / "plan" / "rule_input.py").write_text("class Rule:\n    def render(self):\n        return Reason(())\n")
    (fake / "cli").mkdir()
    (fake / "cli" / "bad.py").write_text(
        "def f():\n    raise errors.UnsupportedConfigError(Reason(('k',), 'why'))\n"
        "def g():\n    raise R.refuse_build(R.SETTING_VALUE, key='k', expected='x', got='y', example='z')\n")
    (fake / "cli" / "alias.py").write_text(
        "from ..errors import UnsupportedInputError as Refused\n"
        "def h(exc):\n    raise Refused('x')\n"
        "def i(f):\n    try:\n        f()\n    except ValueError as exc:\n        raise type(exc)('x')\n"
        "def j(f):\n    try:\n        f()\n    except ValueError as err:\n        raise err.__class__('x')\n"
        "def k(value):\n    return type(value)(x for x in value)\n")
    found = _hand_built(fake)
    assert found == ["primus_ext/cli/alias.py:3 (h) builds UnsupportedInputError",
                     "primus_ext/cli/alias.py:8 (i) builds a refusal's own class",
                     "primus_ext/cli/alias.py:13 (j) builds a refusal's own class",
                     "primus_ext/cli/bad.py:2 (f) builds UnsupportedConfigError",
                     "primus_ext/cli/bad.py:2 (f) builds Reason"], found


@pytest.mark.parametrize("code", sorted(R.BUILD_REFUSALS))
def test_every_build_refusal_names_a_setting_or_says_why_not_and_gives_an_alternative(code):
    for found in R.BUILD_REFUSALS[code]:
        assert found.reason and found.alternative, code
        assert found.settings or code == "settings-mapping", code


def test_collected_reasons_raise_once_as_the_right_error():
    first = R.SETTING_VALUE.reason_for(key="turbo_arch", expected="one of auto", got="the string 'x'", example="e")
    second = R.MODEL_KEY_MISSING.reason_for(key="num_attention_heads")
    assert isinstance(first, Reason) and first.code == "setting-value" and first.settings == ("turbo_arch",)
    built = R.refuse_all([first, second], context="here")
    assert type(built) is UnsupportedConfigError and built.codes == ("setting-value", "model-key")
    assert type(R.refuse_all([first], at_call=True)) is UnsupportedInputError
    with pytest.raises(TypeError, match="Reason"):  # a bare string would become a reason without a code
        R.refuse_all(["a reason of its own"])
    # a settings template naming a sequence names each of its settings; an empty one names none
    lost = R.SPEC_LOST_KEYS.reason_for(function="f()", lost=["qk_layernorm", "qk_l2_norm"], lost_text="...")
    assert lost.settings == ("qk_layernorm", "qk_l2_norm", "spec")
    bare = R.HOOK_UNRESOLVED.reason_for(setting="turbo_flex_attention_mask_mod", kwargs_key="", spec="'m:f'",
                                        what="w", alternative="a")
    assert bare.settings == ("turbo_flex_attention_mask_mod",) and bare.code == "B2"
