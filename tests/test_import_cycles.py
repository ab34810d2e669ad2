"""No import cycles among the modules of `eqx_longctx/` and `models/`: the arrows run one way
(models -> nn -> attention -> the floor; train -> the floor), so a newcomer can read a module
knowing only the ones below it.

Every `import` statement counts, at the top of a module or inside a function (a lazy import
that closes a cycle is still a cycle, only hidden). Importing a package counts as importing
its `__init__`; the implicit import of a module's parent packages does not.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("eqx_longctx", "models")

# Cycles other work of issue 17 removes; emptied when it lands. The test fails whenever this
# differs from what is found, so a fixed cycle cannot linger here and no new one can hide.
PENDING: set[frozenset[str]] = set()


def module_files() -> dict[str, pathlib.Path]:
    """**Returns:** dotted module name -> file, for every module of `PACKAGES`."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def imports_of(name: str, path: pathlib.Path, modules: set[str]) -> set[str]:
    """The modules of `modules` that module `name` (at `path`) imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in modules else base)
    found = set()
    for target in targets:  # `import a.b.c` names a.b.c; keep the deepest known module
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imports_of(name, path, set(files)) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """**Returns:** the strongly connected components of `graph` with more than one
    module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.add(frozenset(component))
    return found


def test_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}, "g": set()}
    assert cycles(graph) == {frozenset("abc"), frozenset("ef")}
    assert cycles({"a": {"b"}, "b": set()}) == set()


def test_import_graph_sees_lazy_and_relative_imports():
    graph = import_graph()
    # A function-level relative import (the CLI imports the loop inside `_train`).
    assert "eqx_longctx.train._loop" in graph["eqx_longctx.train._cli"]
    # `from .. import run` (in a function of the selftest) names the subpackage, not the
    # package it is imported from.
    assert "eqx_longctx.run" in graph["eqx_longctx.selftest"]
    assert "eqx_longctx" not in graph["eqx_longctx.selftest"]


def test_no_import_cycles():
    found = cycles(import_graph())
    shown = "\n".join(" <-> ".join(sorted(c)) for c in sorted(found, key=sorted))
    assert found == PENDING, f"import cycles among {PACKAGES}:\n{shown}"
