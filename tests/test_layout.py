"""The package's layers, as its imports really run: one way only, no circle, nothing hidden in a function.

Read from the source with ``ast`` (what Python would import, not what a docstring says), so a
new module that imports back up a layer, or hides an import inside a function to dodge a
circle, fails here with the arrow named.
"""
import ast
import functools
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "trunksplit"

# lowest first: a module may import its own layer and the layers before it
LAYERS = ["chains", "recompute", "planning", "trunk", "distributed", "lars", "in_backward", "fit", "ssl", "cli"]
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 45  # a function's body, its docstring not counted: one screen
MAX_CLASS_LINES = 250
MAX_TRUNK_LINES = 300  # trunk.py runs a plan; planning, compiling and names live below it
TOOLS = PACKAGE.parent / "tools"


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield name, path


@functools.lru_cache(maxsize=None)
def _parsed(path: pathlib.Path) -> ast.Module:
    """A module's syntax tree, parsed once per test process (every check here walks every module; none changes a tree)."""
    return ast.parse(path.read_text())


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> list:
    """The trunksplit modules an ``import`` statement loads (a package's ``__init__`` included)."""
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if not target.startswith("trunksplit"):
        return []
    known = dict(_modules())
    found = [target]
    for alias in node.names:  # `from . import families` imports a module, not a name
        if f"{target}.{alias.name}" in known:
            found.append(f"{target}.{alias.name}")
    return found


def _loaded_by_name(module: str, is_package: bool, tree):
    """The modules a lazy table names (the package's ``PUBLIC``, the command line's ``COMMANDS``):
    loaded on first use, they are imports all the same, held to the same layers."""
    package = module if is_package else module.rsplit(".", 1)[0]
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") in ("PUBLIC", "COMMANDS") for t in node.targets):
            for value in node.value.values:
                yield f"{package}.{value.value}", node.lineno


def _imports():
    """(importer, imported, line, at module level) for every trunksplit import in the package."""
    for module, path in _modules():
        tree = _parsed(path)
        typing_only = [n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "").lstrip("_") == "TYPE_CHECKING"]
        top = set(map(id, tree.body + [s for n in typing_only for s in n.body]))  # what editors read is imported at the top too
        is_package = path.name == "__init__.py"
        for target, line in _loaded_by_name(module, is_package, tree):
            yield module, target, line, True
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                targets = _resolve(module, is_package, node)
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("trunksplit")]
            else:
                continue
            for target in targets:
                yield module, target, node.lineno, id(node) in top


def _layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return len(LAYERS)  # the package's own __init__ (the public API) and python -m trunksplit: above everything
    return LAYERS.index(parts[1])


def test_every_module_belongs_to_a_layer():
    unknown = [m for m, _ in _modules() if m not in ("trunksplit", "trunksplit.__main__") and m.split(".")[1] not in LAYERS]
    assert unknown == [], f"modules outside the layers {LAYERS}: {unknown}"


def test_no_import_of_the_package_inside_a_function():
    hidden = [f"{m} line {line}: {t}" for m, t, line, at_top in _imports() if not at_top]
    assert hidden == [], "imports hidden in functions (move what is in the wrong place instead):\n" + "\n".join(hidden)


def test_imports_run_down_the_layers_only():
    upward = [f"{m} -> {t} (line {line})" for m, t, line, _ in _imports() if _layer(t) > _layer(m)]
    assert upward == [], f"imports up the layers {LAYERS}:\n" + "\n".join(upward)


def test_the_import_graph_has_no_circle():
    graph = {}
    for m, t, _, _ in _imports():
        if t != m and not m.startswith(t + "."):  # a module's own package runs before it: not an arrow back
            graph.setdefault(m, set()).add(t)
    state = {}

    def visit(node, path):
        if state.get(node) == "done":
            return
        if state.get(node) == "open":
            cycle = path[path.index(node):] + [node]
            pytest.fail("import circle: " + " -> ".join(cycle))
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, path + [node])
        state[node] = "done"

    for node in sorted(graph):
        visit(node, [])


def test_modules_and_functions_fit_a_reader():
    too_long = []
    for module, path in _modules():
        source = path.read_text()
        if source.count("\n") > MAX_MODULE_LINES:
            too_long.append(f"{module}: {source.count(chr(10))} lines")
        for node in ast.walk(_parsed(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body[1:] if ast.get_docstring(node) is not None else node.body
                length = body[-1].end_lineno - body[0].lineno + 1 if body else 0
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{module}.{node.name}: a body of {length} lines")
    assert too_long == [], "split these:\n" + "\n".join(too_long)


def test_classes_fit_a_reader_and_the_trunk_only_runs_its_plan():
    too_long = []
    for module, path in _modules():
        for node in ast.walk(_parsed(path)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                too_long.append(f"{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert too_long == [], "split these classes:\n" + "\n".join(too_long)
    lines = (PACKAGE / "trunk.py").read_text().count("\n")
    assert lines <= MAX_TRUNK_LINES, f"trunk.py has {lines} lines: move what is not running a plan below it"


def _trunk_private_names() -> set:
    """The private attributes and methods of ``CheckpointedTrunk``, read from trunk.py."""
    tree = _parsed(PACKAGE / "trunk.py")
    trunk = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CheckpointedTrunk")
    names = set()
    for node in ast.walk(trunk):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("_") and not node.name.startswith("__"):
            names.add(node.name)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name) and node.value.id == "self":
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                names.add(node.attr)
    return names


def test_no_module_but_the_trunk_reads_the_trunks_private_names():
    """Data flows down: the planner, fit, the CLI, FSDP and the tools get what they need from the
    trunk's public names (``plan_request()``, ``units``, ``store_plan``), never its insides."""
    private = _trunk_private_names()
    assert {"_plans", "_ends", "_fixed_plan"} <= private  # the reader finds them
    reads = []
    paths = [p for _, p in _modules() if p.name != "trunk.py"] + sorted(TOOLS.glob("*.py"))
    for path in paths:
        for node in ast.walk(_parsed(path)):
            if isinstance(node, ast.Attribute) and node.attr in private and not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                reads.append(f"{path.relative_to(PACKAGE.parent)} line {node.lineno}: .{node.attr}")
    assert reads == [], "private names of CheckpointedTrunk read outside trunk.py:\n" + "\n".join(reads)


def test_the_checker_sees_an_upward_import():
    """The checks above would pass vacuously if the resolver found no arrows: it finds the real ones."""
    arrows = {(m, t) for m, t, _, _ in _imports()}
    assert ("trunksplit.trunk", "trunksplit.planning.search") in arrows
    assert ("trunksplit.chains", "trunksplit.chains.families") in arrows
    assert _layer("trunksplit.ssl.loop") > _layer("trunksplit.trunk") > _layer("trunksplit.chains.blocks")


def test_no_test_module_imports_another_test_modules_names():
    """Shared test helpers live in helper modules (reference.py, zoo.py, conftest.py), not in another test file."""
    tests = pathlib.Path(__file__).parent
    found = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(_parsed(path)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1].startswith("test_"):
                found.append(f"{path.relative_to(tests)}: from {node.module} import ...")
    assert found == []


def _policy_names_spelled(tree: ast.AST) -> list:
    """String constants in code (docstrings aside) that are a checkpoint policy's name."""
    from trunksplit.recompute.policies import POLICIES

    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in POLICIES and id(node) not in docstrings]


def test_only_the_policy_registry_spells_a_policys_name_as_code():
    """A policy is a type chosen by name in one place (trunksplit/recompute/policies.py): what it keeps,
    how it nests and how it is priced are its attributes, so no other module decides by its name."""
    spelled = {name: found for name, path in _modules() if name != "trunksplit.recompute.policies"
               for found in [_policy_names_spelled(_parsed(path))] if found}
    assert spelled == {}
    assert _policy_names_spelled(ast.parse('def f(p):\n    """a "recompute" region"""\n    return p == "recompute"\n')) == [(3, "recompute")]
