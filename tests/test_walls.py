"""The walls of the house (`../shared/STYLE.md`, "Layout"): which way the imports run between
the library's rooms, and what each room may see of another.

Rooms are the subpackages of `eqx_longctx/` and the zoo (`models/`); the floor is the
package's own small modules (`eqx_longctx/_*.py`, and `family.py`, the face a plugin author
imports). Arrows run down the floors: a module imports only its own room, rooms on lower
floors, and the floor. Across rooms it imports public names only: a room's face
(`eqx_longctx.train`, not `eqx_longctx.train._loop`), never a name that starts with `_`.
Imports inside functions count. Reads source only, except the tests that import a module in
a fresh process and list what it loaded.
"""

import ast
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "eqx_longctx"

# The floors, lowest first; rooms on one floor do not import each other.
FLOORS = (
    ("kernels",),
    ("attention", "linear"),
    ("nn", "data"),
    ("run",),
    ("inference",),
    ("evals",),
    ("train",),
    ("plan", "selftest"),
    ("models",),
)
LEVEL = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}
# The package's face (`__init__`, which re-exports every room and loads the heavy ones
# lazily) and its `python -m` doors (`generate.py`, `export.py`) stand above the house.
FACES = {PACKAGE, f"{PACKAGE}.generate", f"{PACKAGE}.export", f"{PACKAGE}.eval"}


def modules() -> dict[str, pathlib.Path]:
    """Dotted name -> file of every module of `eqx_longctx/` and `models/`."""
    found = {}
    for top in (PACKAGE, "models"):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def room(module: str) -> str | None:
    """The room of `module` (a subpackage name, or "models"), or `None` for the floor."""
    parts = module.split(".")
    if parts[0] == "models":
        return "models"
    if len(parts) > 1 and (ROOT / PACKAGE / parts[1]).is_dir():
        return parts[1]
    return None


def imports(module: str, path: pathlib.Path, known: set[str]) -> list[tuple[int, str, str]]:
    """`(line, imported module, imported name or "")` of every import in `module` that
    names a module of `known`: `from a.b import c` gives `(a.b.c, "")` when `a.b.c` is a
    module, else `(a.b, "c")`."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, "") for a in node.names if a.name in known]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    out.append((node.lineno, sub, ""))
                elif base in known:
                    out.append((node.lineno, base, alias.name))
    return out


def arrows() -> list[tuple[str, int, str, str]]:
    """`(module, line, imported module, name)` of every import between two modules of the
    house."""
    files = modules()
    known = set(files)
    return [(m, *i) for m, p in files.items() for i in imports(m, p, known)]


def private_crossings(found) -> list[str]:
    """Imports across rooms of a private module or name. The floor's private modules are
    the library's own (its rooms share them), not the zoo's: `models/` is what a family
    written outside this repository would be, and sees public names only."""
    bad = []
    for module, line, target, name in found:
        here, there = room(module), room(target)
        if here == there and there is not None:
            continue
        if there is None:  # the floor
            inner = target.split(".")[1:] if here == "models" else []
        else:
            inner = target.split(".")[1 if there == "models" else 2 :]
        if any(part.startswith("_") for part in inner) or name.startswith("_"):
            bad.append(f"{module}:{line} imports {target} {name}".strip())
    return bad


def upward(found) -> list[str]:
    """Imports from a room into a room on the same or a higher floor (faces excepted)."""
    bad = []
    for module, line, target, _ in found:
        here, there = room(module), room(target)
        if module in FACES or there is None or here == there:
            continue
        if here is None or LEVEL[there] >= LEVEL[here]:
            bad.append(f"{module}:{line} ({here or 'floor'}) imports {target} ({there})")
    return bad


def test_every_room_has_a_floor():
    rooms = {room(m) for m in modules()} - {None}
    assert rooms <= set(LEVEL), sorted(rooms - set(LEVEL))


def test_no_private_imports_across_rooms():
    assert private_crossings(arrows()) == []


def test_arrows_run_down_the_floors():
    assert upward(arrows()) == []


def test_inference_imports_nothing_of_train():
    bad = [a for a in arrows() if room(a[0]) == "inference" and room(a[2]) == "train"]
    assert bad == []


def test_the_checks_see_what_they_forbid():
    """The walls catch a private crossing, an upward arrow and a sideways one."""
    found = [
        ("eqx_longctx.inference._cli", 3, "eqx_longctx.train._cli", "_Parser"),
        ("eqx_longctx.plan._compile", 4, "eqx_longctx.inference._run", ""),
        ("eqx_longctx.nn._attention", 5, "eqx_longctx.attention", "_impl_name"),
        ("eqx_longctx.run._placement", 6, "eqx_longctx._checks", "check_int"),  # the floor
        ("eqx_longctx.kernels._impl", 7, "eqx_longctx.attention._block", "BlockOptions"),
        ("eqx_longctx.inference._cli", 8, "eqx_longctx.train", "TrainConfig"),
        ("models.llama", 9, "eqx_longctx.nn", "RoPE"),
        ("models.llama", 10, "eqx_longctx._checks", "check_int"),  # the floor, from the zoo
        ("models.llama", 11, "eqx_longctx.nn._rope", ""),
    ]
    assert len(private_crossings(found)) == 6
    assert [b.split(" ")[0] for b in upward(found)] == [
        "eqx_longctx.inference._cli:3", "eqx_longctx.kernels._impl:7",
        "eqx_longctx.inference._cli:8",
    ]  # fmt: skip


def _loaded_by(statement: str) -> list[str]:
    """The `eqx_longctx` modules a fresh process has loaded after `statement`."""
    code = f"import sys, json; {statement}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
        check=True,
    )  # fmt: skip
    return [m for m in json.loads(out.stdout.splitlines()[-1]) if m.startswith(PACKAGE)]


@pytest.mark.parametrize("family", ["models.llama", "models.deepseek"])
def test_a_family_loads_no_trainer_inference_or_planner(family):
    """A plugin author pays for what a family uses: the layers and the family face, not the
    trainer, inference, the planner or the run floor under them."""
    loaded = _loaded_by(f"import {family}")
    heavy = [m for m in loaded if room(m) in ("train", "inference", "plan", "run", "selftest")]
    assert heavy == [], heavy
    assert f"{PACKAGE}.family" in loaded


def test_inference_loads_no_trainer_and_the_package_loads_inference_when_asked():
    assert [m for m in _loaded_by(f"import {PACKAGE}.inference") if room(m) == "train"] == []
    lazy = _loaded_by(f"import {PACKAGE}")
    assert not [m for m in lazy if room(m) in ("inference", "plan", "train")], lazy
    used = _loaded_by(f"import {PACKAGE} as el; el.generate")
    assert f"{PACKAGE}.inference" in used and not [m for m in used if room(m) == "train"]
