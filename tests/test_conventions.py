"""The test suite's own rules (docs/architecture.md, "The checks"): a test that asserts only inside
a loop over data or an `if` would pass silently when the loop ran zero times or the branch was
not taken, so every test has at least one assertion that runs whatever the data; and a test
that asserts inside a loop over data also asserts, outside that loop, something of the
collection it iterates (`assert rows`, `assert len(rows) == 3`), so an empty one fails."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent


def _always_runs(loop: ast.For | ast.AsyncFor | ast.comprehension) -> bool:
    """A loop over a non-empty literal (`for x in ("a", "b")`, `range(3)`) always runs."""
    it = loop.iter
    if isinstance(it, (ast.Tuple, ast.List, ast.Set)):
        return bool(it.elts)
    if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range":
        args = [a.value for a in it.args if isinstance(a, ast.Constant) and isinstance(a.value, int)]
        return len(args) == len(it.args) and len(range(*args)) > 0
    return False


# ---- a loop that asserts inside also asserts that it ran ---------------------------------------
# Calls that iterate their arguments (the collection is theirs), and a mapping's views.
WRAPPERS = {"enumerate", "zip", "sorted", "reversed", "list", "tuple", "set", "frozenset", "iter", "dict"}
VIEWS = {"items", "values", "keys"}
ADDS = {"add", "append", "extend", "update", "setdefault", "insert"}


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _data(node: ast.AST) -> set[str]:
    """The names of the data in an expression: not the functions it calls, nor what its own
    comprehensions bind."""
    called = {id(n.func) for n in ast.walk(node) if isinstance(n, ast.Call)}
    bound = {t for g in ast.walk(node) if isinstance(g, ast.comprehension) for t in _names(g.target)}
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and id(n) not in called} - bound


def _bound(target: ast.expr) -> set[str]:
    """The names an assignment to `target` rebinds (`x[k] = v` rebinds none)."""
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*(_bound(e) for e in target.elts))
    if isinstance(target, ast.Starred):
        return _bound(target.value)
    return set()


def _constant(node: ast.expr, constants: set[str]) -> bool:
    """Something defined once, whose contents the reader sees: an UPPER_CASE name, a class (an
    enum's members), a name the module (or the test, to a literal) binds once; `model.CATEGORIES`."""
    if isinstance(node, ast.Name):
        return node.id.isupper() or node.id[:1].isupper() or node.id in constants
    if isinstance(node, ast.Attribute):
        return node.attr.isupper() or node.attr[:1].isupper() or _constant(node.value, constants)
    return False


def _iterated(it: ast.expr, constants: set[str]) -> set[str] | None:
    """The names that stand for the collection a loop iterates (an assert naming one is about
    it), or None when it cannot be empty unseen (a constant, a literal). An empty set: what no
    name stands for (a call's result): bind it to a name to assert on it."""
    if isinstance(it, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
        return None if _never_empty(it) else set()
    if isinstance(it, ast.Call):
        f = it.func
        if isinstance(f, ast.Name) and f.id == "range":  # as empty as its bounds say
            bounds = set().union(*(_data(a) for a in it.args))
            return {n for n in bounds if not _constant(ast.Name(n), constants)} or None
        if isinstance(f, ast.Attribute) and f.attr in VIEWS:
            return _iterated(f.value, constants)
        if not (isinstance(f, ast.Name) and f.id in WRAPPERS):
            return set()
        found: set[str] = set()
        for a in it.args:
            sub = _iterated(a, constants)
            if sub is not None and not sub and f.id != "zip":
                return set()
            found |= sub or set()
        return found or None
    return None if _constant(it, constants) else _data(it)


def _never_empty(value: ast.expr) -> bool:
    """A non-empty literal, or a comprehension whose every loop always runs, unfiltered
    (`[spawn() for _ in range(3)]`)."""
    if isinstance(value, ast.Dict):
        return bool(value.keys)
    if isinstance(value, (ast.Tuple, ast.List, ast.Set)):
        return bool(value.elts)
    if isinstance(value, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
        return all(not g.ifs and _always_runs(g) for g in value.generators)
    return False


def _module_constants(tree: ast.Module) -> set[str]:
    out: set[str] = set()
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign):
            out |= set().union(*(_bound(t) for t in stmt.targets))
        elif isinstance(stmt, ast.AnnAssign):
            out |= _bound(stmt.target)
    return out


def _test_constants(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """Names the test binds once, to a value that is never empty (`cases = {"a": 1, "b": 2}`)."""
    bound: dict[str, list[ast.expr]] = {}
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                for name in _bound(t):
                    bound.setdefault(name, []).append(n.value if isinstance(t, ast.Name) else t)
        elif isinstance(n, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor, ast.NamedExpr)):
            for name in _bound(n.target):
                bound.setdefault(name, []).append(n.target)
    return {k for k, v in bound.items() if len(v) == 1 and _never_empty(v[0])}


def _drawn(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The parameters hypothesis draws (`@given(...)`) and what the test derives from them: it
    tries them empty and full alike, so a loop over them needs no assert that it ran (the other
    draws run it)."""
    given = [d for d in fn.decorator_list if isinstance(d, ast.Call) and isinstance(d.func, ast.Name)]
    if not any(d.func.id == "given" for d in given):  # type: ignore[union-attr]
        return set()
    drawn = {a.arg for a in fn.args.args}
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign) and _names(n.value) & drawn:
            drawn |= set().union(*(_bound(t) for t in n.targets))
    return drawn


def _aliases(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, set[str]]:
    """Names bound to an unfiltered comprehension over other collections (`helps = {a: f(a) for
    a in commands}`): as empty as those, so an assert naming those names them."""
    out: dict[str, set[str]] = {}
    for n in ast.walk(fn):
        if not (isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)):
            continue
        v = n.value
        comps = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
        if isinstance(v, comps) and not any(g.ifs for g in v.generators):
            out[n.targets[0].id] = set().union(*(_data(g.iter) for g in v.generators))
    return out


def _effects(loop: ast.For | ast.AsyncFor) -> set[str]:
    """What the loop's body changes (`n += 1`, `seen[k] = v`, `seen.add(x)`): asserted after the
    loop, its value says that the loop ran."""
    out: set[str] = set()
    for n in ast.walk(loop):
        if isinstance(n, ast.Assign):  # `n = ...`, `seen[k] = ...`
            out |= set().union(*(_bound(t) | _names(t) for t in n.targets))
        elif isinstance(n, ast.AugAssign):
            out |= _names(n.target)
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ADDS:
            out |= _names(n.func.value)
    return out - _names(loop.target)


def _outside_functions(node: ast.AST, kind: type | tuple[type, ...]) -> list:
    """The nodes of `kind` under `node`, nested functions and classes aside."""
    out = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(child, kind):
            out.append(child)
        out += _outside_functions(child, kind)
    return out


def unchecked_loops(source: str) -> list[str]:
    """The loops over data that assert inside, while no assert outside them names what they
    iterate (nor, after them, what they changed): `test_name (line of the loop)`."""
    tree = ast.parse(source)
    module = _module_constants(tree)
    bad = []
    for node in ast.walk(tree):
        if not (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test")):
            continue
        every = _outside_functions(node, ast.Assert)
        constants, drawn, aliases = module | _test_constants(node), _drawn(node), _aliases(node)
        for loop in _outside_functions(node, (ast.For, ast.AsyncFor)):
            inside = {id(a) for a in _outside_functions(loop, ast.Assert)}
            names = _iterated(loop.iter, constants)
            if not inside or _always_runs(loop) or names is None or (names and names <= drawn):
                continue
            names |= set().union(*(aliases.get(n, set()) for n in names))
            effects, end = _effects(loop), loop.end_lineno or loop.lineno
            if not any(
                names & _names(a.test) or (a.lineno > end and effects & _names(a.test))
                for a in every
                if id(a) not in inside
            ):
                bad.append(f"{node.name} (line {loop.lineno})")
    return bad


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


def test_every_loop_that_asserts_asserts_its_collection_too():
    files = sorted(ROOT.rglob("test_*.py"))
    assert len(files) > 40
    bad = [f"{f.relative_to(ROOT.parent)}: {name}" for f in files for name in unchecked_loops(f.read_text())]
    assert not bad, (
        "these loops assert inside but nothing outside them says what they iterate was not empty "
        "(`assert xs`, `assert len(xs) == n`; a call's result: bind it to a name first):\n" + "\n".join(bad)
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


def test_the_loop_check_asks_each_loop_over_data_to_assert_what_it_iterates():
    src = """
CASES = (1, 2)

def test_data(xs):
    for x in xs:
        assert x

def test_counted(xs):
    for x in xs:
        assert x
    assert len(xs) == 2

def test_constants(xs):
    for c in CATEGORIES:
        assert c in xs
    for c in model.CATEGORIES:
        assert c in xs
    for c in CASES:
        assert c in xs

def test_a_literal_the_test_binds():
    cases = {"a": 1, "b": 2}
    for k, v in cases.items():
        assert v

def test_a_call(f):
    for x in f():
        assert x
    assert f

def test_what_the_loop_changed(f):
    n = 0
    for x in f():
        assert x
        n += 1
    assert n == 3

def test_an_inner_loop(groups):
    assert groups
    for g in groups:
        for r in g["rules"]:
            assert r

@given(st.lists(st.integers()))
def test_drawn(xs):
    ys = sorted(xs)
    for y in ys:
        assert y in xs
"""
    assert unchecked_loops(src) == [
        "test_data (line 5)",
        "test_a_call (line 27)",
        "test_an_inner_loop (line 41)",
    ]
