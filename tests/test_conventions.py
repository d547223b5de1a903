"""The test suite's own rules (docs/architecture.md, "The checks"): a test that asserts only inside
a loop over data or an `if` would pass silently when the loop ran zero times or the branch was
not taken, so every test has at least one assertion that runs whatever the data."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent


def _always_runs(loop: ast.For | ast.AsyncFor) -> bool:
    """A loop over a non-empty literal (`for x in ("a", "b")`, `range(3)`) always runs."""
    it = loop.iter
    if isinstance(it, (ast.Tuple, ast.List, ast.Set)):
        return bool(it.elts)
    if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range":
        args = [a.value for a in it.args if isinstance(a, ast.Constant) and isinstance(a.value, int)]
        return len(args) == len(it.args) and len(range(*args)) > 0
    return False


def _asserts(node: ast.AST, conditional: bool, out: list[bool]) -> None:
    """Append, for each assert under `node` (nested functions aside), whether it is conditional."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(child, ast.Assert):
            out.append(conditional)
        nested = conditional or isinstance(child, (ast.If, ast.While))
        if isinstance(child, (ast.For, ast.AsyncFor)) and not _always_runs(child):
            nested = True
        _asserts(child, nested, out)


def only_conditional_asserts(source: str) -> list[str]:
    """The test functions whose every assert sits in a loop over data or in a branch."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            found: list[bool] = []
            _asserts(node, False, found)
            if found and all(found):
                bad.append(f"{node.name} (line {node.lineno})")
    return bad


def test_every_test_asserts_something_whatever_its_data():
    files = sorted(ROOT.rglob("test_*.py"))
    assert len(files) > 40
    bad = [
        f"{f.relative_to(ROOT.parent)}: {name}"
        for f in files
        for name in only_conditional_asserts(f.read_text())
    ]
    assert not bad, (
        "these tests assert only inside a loop over data or an `if`; assert the loop ran (or what "
        "an empty collection means) outside it:\n" + "\n".join(bad)
    )


def test_the_check_tells_a_loop_over_data_from_one_that_always_runs():
    src = """
def test_data(xs):
    for x in xs:
        assert x

def test_counted(xs):
    for x in xs:
        assert x
    assert xs

def test_literal():
    for x in ("a", "b"):
        assert x

def test_branch(flag):
    if flag:
        assert flag

def test_none():
    pass
"""
    assert only_conditional_asserts(src) == ["test_data (line 2)", "test_branch (line 15)"]
