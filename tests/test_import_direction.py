"""The model zoo builds on the library's public API only.

`models/` is what a family written outside this repository would be: it may import
`eqx_longctx` and its public subpackages, never a private module (a dotted name with a
component that starts with `_`) nor a private name. Imports inside functions count. Reads
source only. (That `models/` modules import no cycle is tests/test_import_cycles.py's.)
"""

import ast
from pathlib import Path

import pytest

MODELS = Path(__file__).resolve().parents[1] / "models"


def imports(file: Path) -> list[tuple[int, str, tuple[str, ...]]]:
    """`(line, module, imported names)` of every absolute import statement in `file`."""
    found = []
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append((node.lineno, node.module, tuple(alias.name for alias in node.names)))
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


@pytest.mark.parametrize("file", sorted(MODELS.glob("*.py")), ids=lambda f: f.name)
def test_models_import_only_public_library_names(file):
    assert private_library_imports(file) == []


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
