"""Every `eqx_longctx...` and `models...` name the docs, the notebooks and the examples mention
exists: a dotted name imports its longest module prefix and getattrs the rest; `el.<name>` counts
where the file does `import eqx_longctx as el`; `from eqx_longctx.x import a, b` checks `a` and
`b`; a `python -m` target must be a runnable module. A renamed function fails here, with the file
and line of each stale mention, instead of in a reader's hands."""

import importlib
import importlib.util
import json
import pathlib
import re

import pytest
from helpers import resolve_dotted

from eqx_longctx._family import ENTRY_POINT_GROUP

ROOT = pathlib.Path(__file__).parent.parent
SOURCES = sorted(
    [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "notebooks").glob("*.ipynb")]
    + [p for p in (ROOT / "examples").rglob("*") if p.is_file()]
)
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
DOTTED = re.compile(rf"(?<![\w./-])((?:eqx_longctx|models)(?:\.{IDENT})+)")
ALIAS = re.compile(rf"(?<![\w.])el((?:\.{IDENT})+)")
RUN_MODULE = re.compile(rf"python3? -m ((?:eqx_longctx|models)(?:\.{IDENT})*)")
FROM_IMPORT = re.compile(
    rf"from ((?:eqx_longctx|models)(?:\.{IDENT})*) import (\([^)]*\)|[^\n#]*)", re.MULTILINE
)
FILE_SUFFIXES = {"md", "py", "ipynb", "sh", "git", "toml", "json", "txt", "yaml", "yml"}


def lines_of(path):
    """`(where, text)` per line: `file:line`, or `file:cell N:line` in a notebook."""
    rel = path.relative_to(ROOT)
    if path.suffix != ".ipynb":
        text = path.read_text(errors="replace")
        return [(f"{rel}:{i}", line) for i, line in enumerate(text.splitlines(), 1)]
    out = []
    for n, cell in enumerate(json.loads(path.read_text())["cells"]):
        for i, line in enumerate("".join(cell["source"]).splitlines(), 1):
            out.append((f"{rel}:cell {n}:{i}", line))
    return out


def mentions(path):
    """`[(where, name, kind)]`: kind "module" for `python -m` targets, else "name"."""
    lines = lines_of(path)
    text = "\n".join(line for _, line in lines)
    aliased = re.search(r"import eqx_longctx as el\b", text) is not None
    found = []
    for where, line in lines:
        run = [(m.start(1), m.end(1)) for m in RUN_MODULE.finditer(line)]
        found += [(where, line[a:b], "module") for a, b in run]
        for match in DOTTED.finditer(line):
            if match.group(1).rsplit(".", 1)[1] not in FILE_SUFFIXES and match.span(1) not in run:
                found.append((where, match.group(1), "name"))
        if aliased:
            found += [(where, "eqx_longctx" + m.group(1), "name") for m in ALIAS.finditer(line)]
    starts = [0]  # offsets of the lines, to place a multi-line import
    for _, line in lines:
        starts.append(starts[-1] + len(line) + 1)
    for match in FROM_IMPORT.finditer(text):
        where = lines[max(i for i, s in enumerate(starts) if s <= match.start())][0]
        for item in match.group(2).strip("()").split(","):
            name = item.split("#")[0].split(" as ")[0].strip()
            if re.fullmatch(IDENT, name):
                found.append((where, f"{match.group(1)}.{name}", "name"))
    return found


def resolve(name, kind):
    """None if `name` exists (as a runnable module for kind "module"), else why not. The
    entry-point group families register under is a name too, though not a module's."""
    if kind == "name" and name == ENTRY_POINT_GROUP:
        return None
    if kind == "module":
        spec = importlib.util.find_spec(name)
        if spec is None:
            return "no such module"
        if spec.submodule_search_locations is not None:  # a package runs its __main__
            if importlib.util.find_spec(f"{name}.__main__") is None:
                return "a package without __main__: `python -m` cannot run it"
        return None
    try:
        resolve_dotted(name)
    except (ImportError, AttributeError) as e:
        return str(e)
    return None


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(ROOT)) for p in SOURCES])
def test_mentioned_names_exist(path):
    found = {(where, name, resolve(name, kind)) for where, name, kind in mentions(path)}
    bad = sorted(f"{where}: {name} ({why})" for where, name, why in found if why is not None)
    assert not bad, f"{len(bad)} stale name(s); rename or remove them:\n" + "\n".join(bad)


def test_the_scan_finds_names():
    """The patterns still match the docs' spellings (a scan that finds nothing checks nothing)."""
    found = {(name, kind) for path in SOURCES for _, name, kind in mentions(path)}
    names = {name for name, _ in found}
    assert len(names) > 100, sorted(names)
    assert ("eqx_longctx.train", "module") in found  # `python -m eqx_longctx.train`
    assert "eqx_longctx.ShardingSpec" in names  # `el.ShardingSpec` and `::: eqx_longctx....`
    assert "eqx_longctx.data.place_batch" in names  # `from eqx_longctx.data import place_batch`
    assert "models.llama.Llama" in names
    assert "no attribute 'no_such_name'" in resolve("eqx_longctx.no_such_name", "name")
    assert resolve("eqx_longctx.data", "module") is not None  # no __main__
