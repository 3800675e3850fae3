"""The package's import graph: no cycles, the engine below the estimators, no lazy imports.

Read from the source with ``ast`` (nothing is imported), so a cycle hidden behind an import
inside a function, which Python only meets at call time, is caught as well.
"""

import ast
import pathlib

import pytest

PACKAGE = "skpathkernel"
ROOT = pathlib.Path(__file__).resolve().parents[1] / PACKAGE

# Imports inside a function are for optional dependencies only: importing the package must
# not need them. Anything else belongs at the top of its module.
OPTIONAL = {
    "matplotlib": "the 'plot' extra: plotting, the printed glyphs and reproduce draw with it",
    "tqdm": "progress bars only when verbose > 0",
    "pandas": "as_frame=True on the dataset loaders returns pandas objects, as sklearn's do",
    "distributed": "the 'distributed' extra: thread limits on a dask worker",
    "dask": "the 'distributed' extra",
    "umap": "not a dependency: TangentEmbeddingDisplay uses umap-learn when installed",
}
# In-function imports of the package's own modules that are allowed, each with its reason.
# Empty: every one of them was a cycle or the missing fitted-network object (issue 17).
ALLOWED_INTERNAL: dict[tuple[str, str], str] = {}

# The engine: tensors in, tensors out. It must never import what sits above it.
ENGINE = ("_checkpoint", "_device", "_modules", "_network._inputs", "_path._losses", "_memory",
          "_parallel", "_analysis._rank_gap", "_path._storage", "_tangent", "_path._training",
          "_path._trajectory", "_path._buffers", "_path._mlp_step", "_path._optim",
          "_validation", "_warnings", "_version")


def _modules():
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_package)
    return out


MODULES = _modules()


def _targets(name, is_package, node):
    """The package's modules an import statement of module ``name`` loads."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == PACKAGE]
    if node.level == 0:
        if (node.module or "").split(".")[0] != PACKAGE:
            return []
        base = node.module
    else:
        here = name.split(".") if is_package else name.split(".")[:-1]
        here = here[: len(here) - (node.level - 1)]
        base = ".".join(here + ([node.module] if node.module else []))
    # ``from pkg import sub`` loads the submodule sub; ``from pkg import name`` needs pkg's
    # __init__ to have run (a package's modules import their siblings by the first form).
    subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
    needs_base = base in MODULES and len(subs) < len(node.names)
    return [base, *subs] if needs_base else subs


def _is_type_checking(node):
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports():
    """(module, line, imported root or package module, in a function?) for every import."""
    rows = []
    for name, (path, is_package) in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))

        def walk(node, in_function, name=name, is_package=is_package):
            for child in ast.iter_child_nodes(node):
                if _is_type_checking(child):
                    continue  # never runs: no edge
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    internal = _targets(name, is_package, child)
                    if internal:
                        rows.extend((name, child.lineno, t, in_function) for t in internal)
                    elif isinstance(child, ast.Import):
                        rows.extend((name, child.lineno, a.name.split(".")[0], in_function)
                                    for a in child.names)
                    elif child.level == 0:
                        rows.append((name, child.lineno, child.module.split(".")[0],
                                     in_function))
                walk(child, in_function or isinstance(
                    child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        walk(tree, False)
    return rows


def _graph(rows):
    graph = {name: set() for name in MODULES}
    for name, _, target, _ in rows:
        if target in MODULES and target != name:
            graph[name].add(target)
    return graph


def _find_cycle(graph):
    """One cycle as a list of modules (first == last), or None: depth-first search."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _reachable(graph, start):
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


ROWS = _imports()
GRAPH = _graph(ROWS)


def test_the_parser_sees_the_imports_the_package_has():
    # Guards the other tests against passing on an empty graph.
    assert "skpathkernel.kernels" in GRAPH["skpathkernel._estimators._base"]
    assert "skpathkernel._tangent._rules" in GRAPH["skpathkernel._tangent._gram"]
    assert "skpathkernel._estimators._machine" in GRAPH["skpathkernel"]
    assert ("skpathkernel.plotting", "matplotlib") in {(m, t) for m, _, t, f in ROWS if f}


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _find_cycle(graph) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_import_graph_has_no_cycle():
    # In-function imports count: they are where cycles hide.
    cycle = _find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("engine", ENGINE)
def test_the_engine_does_not_import_what_sits_above_it(engine):
    name = f"{PACKAGE}.{engine}"
    layer = {m for m in MODULES if any(m == f"{PACKAGE}.{e}" or m.startswith(f"{PACKAGE}.{e}.")
                                       for e in ENGINE)}
    above = _reachable(GRAPH, name) - layer
    assert not above, f"{name} imports {sorted(above)}"


def test_imports_inside_functions_are_for_optional_dependencies_only():
    lazy = [(m, line, t) for m, line, t, in_function in ROWS if in_function]
    bad = [f"{m}:{line} imports {t}" for m, line, t in lazy
           if t not in OPTIONAL and (m, t) not in ALLOWED_INTERNAL]
    assert not bad, "move these imports to the top of their module:\n" + "\n".join(bad)
