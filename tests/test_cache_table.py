"""docs/performance.md lists every cache and registry the package keeps (section 8, "Every cache and
registry"); this reads the package's source and checks that the table and the code agree.

A container counts when it is made empty and kept beyond one statement: a module-level dict, list, set,
deque, Counter, OrderedDict or weak container, one assigned to ``self`` in a class, or a function memoised
by ``functools.lru_cache`` / ``functools.cache``.  The fakes of `primus_ext.testing` are test doubles and
not counted."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "primus_ext"
TABLE = ROOT / "docs" / "performance.md"
_CONTAINERS = {"dict", "list", "set", "OrderedDict", "WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "deque",
               "Counter", "defaultdict"}


def _empty_container(value: ast.expr | None) -> bool:
    if isinstance(value, ast.Dict):
        return not value.keys
    if isinstance(value, (ast.List, ast.Set)):
        return not value.elts
    if isinstance(value, ast.Call):
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        return name in _CONTAINERS and not value.args and not value.keywords
    return False


def _kept(tree: ast.Module, module: str) -> set[str]:
    found = set()
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else (
            node.target if isinstance(node, ast.AnnAssign) else None)
        if isinstance(target, ast.Name) and _empty_container(node.value):
            found.add(f"{module}:{target.id}")
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                re.search(r"\b(lru_cache|cache)\b", ast.unparse(d)) for d in node.decorator_list):
            found.add(f"{module}:{node.name}()")
        if isinstance(node, ast.ClassDef):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Assign, ast.AnnAssign)):
                    target = sub.targets[0] if isinstance(sub, ast.Assign) else sub.target
                    if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                            and target.value.id == "self" and _empty_container(sub.value)):
                        found.add(f"{module}:{node.name}.{target.attr}")
    return found


def in_code() -> set[str]:
    found: set[str] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
        if module.startswith("primus_ext.testing"):
            continue
        found |= _kept(ast.parse(path.read_text()), module)
    return found


def in_table() -> set[str]:
    text = TABLE.read_text()
    section = text[text.index("### Every cache and registry"):]
    section = section[:section.index("\n#", 1)] if "\n#" in section[1:] else section
    return set(re.findall(r"^\| `(primus_ext\.[\w.]+:[\w.()]+)` \|", section, flags=re.M))


def test_the_cache_table_lists_every_container_the_code_keeps():
    code, table = in_code(), in_table()
    assert not code - table, f"kept in the code, not in docs/performance.md's table: {sorted(code - table)}"
    assert not table - code, f"in docs/performance.md's table, not in the code: {sorted(table - code)}"


def test_the_scan_sees_each_kind_of_container():
    """The scan is not blind: a module-level memo, an instance's, and a memoised function are each found."""
    source = ast.parse("import functools, weakref\n_A = {}\n_B: list = []\n_C = weakref.WeakSet()\n_D = dict(x=1)\n"
                       "class K:\n    def __init__(self):\n        self.e = {}\n        self.f = [1]\n"
                       "@functools.lru_cache(maxsize=8)\ndef g(x):\n    return x\n")
    assert _kept(source, "m") == {"m:_A", "m:_B", "m:_C", "m:K.e", "m:g()"}
