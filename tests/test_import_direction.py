"""The model zoo builds on the library's public API only, and its modules import no cycle.

`models/` is what a family written outside this repository would be: it may import
`eqx_longctx` and its public subpackages, never a private module (a dotted name with a
component that starts with `_`) nor a private name. Its own modules import each other in one
direction (e.g. `models.llama` -> `models._llama_hf`, never back). Imports inside functions
count. Reads source only.
"""

import ast
from pathlib import Path

import pytest

MODELS = Path(__file__).resolve().parents[1] / "models"


def _module_name(file: Path) -> str:
    return "models" if file.name == "__init__.py" else f"models.{file.stem}"


def imports(file: Path) -> list[tuple[int, str, tuple[str, ...]]]:
    """`(line, absolute module, imported names)` of every import statement in `file`."""
    package = ["models"]
    found = []
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.append((node.lineno, module, tuple(alias.name for alias in node.names)))
    return found


def private_library_imports(file: Path) -> list[str]:
    """The imports of private `eqx_longctx` modules or names in `file`."""
    bad = []
    for line, module, names in imports(file):
        if module.split(".")[0] != "eqx_longctx":
            continue
        private = [part for part in module.split(".") if part.startswith("_")]
        private += [name for name in names if name.startswith("_")]
        if private:
            bad.append(f"{file.name}:{line} imports {module} {names or ''} (private: {private})")
    return bad


def import_graph() -> dict[str, set[str]]:
    """`models` module -> the `models` modules it imports (`from . import x` is `models.x`)."""
    files = {_module_name(f): f for f in MODELS.glob("*.py")}
    graph = {}
    for name, file in files.items():
        edges = set()
        for _, module, names in imports(file):
            targets = [f"{module}.{n}" for n in names] + [module]
            edges |= {t for t in targets if t in files and t != name}
        graph[name] = edges - {"models"}  # the package itself: every submodule's parent
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One path for each back edge found by a depth-first walk (empty: no cycle)."""
    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


@pytest.mark.parametrize("file", sorted(MODELS.glob("*.py")), ids=lambda f: f.name)
def test_models_import_only_public_library_names(file):
    assert private_library_imports(file) == []


def test_models_modules_import_no_cycle():
    graph = import_graph()
    assert "models._llama_hf" in graph["models.llama"]  # the walk sees relative imports
    assert cycles(graph) == []


def test_the_checks_catch_what_they_forbid(tmp_path):
    file = tmp_path / "family.py"
    file.write_text(
        "from eqx_longctx.nn import RoPE\n"
        "def f():\n"
        "    from eqx_longctx._checks import check_int\n"
        "    from eqx_longctx.nn import _moe\n"
        "import eqx_longctx.nn._rope\n"
    )
    assert len(private_library_imports(file)) == 3
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
