"""Every exception a public function or class raises is named in its docstring.

The names checked are the API reference's: each package's public names (`public_names` of
`docs/hooks.py`, the same walk the strict docs build runs) and every `::: path` directive
under `docs/api/`, which also documents a few private helpers. For a function, the
exceptions are those its own source raises (`raise ValueError(...)`, or a helper call
annotated `-> ValueError`); for a class, those of `__init__`, `__check_init__`,
`__post_init__` (named in the class docstring or `__init__`'s) and of each public method
(named in that method's docstring). Each must appear after `**Raises:**`. Errors raised by
the functions a name calls are not followed: their docstrings are checked on their own.

Reads source and imports modules; nothing is traced or compiled.
"""

import ast
import builtins
import importlib
import importlib.util
import inspect
import re
import textwrap
import types
from pathlib import Path

import pytest
from helpers import resolve_dotted

ROOT = Path(__file__).resolve().parents[1]
_CONSTRUCTORS = ("__init__", "__check_init__", "__post_init__")
_PACKAGES = ("eqx_longctx", "models", __name__)  # this module: the checker's own test
_DIRECTIVE = re.compile(r"^::: +(\S+)", re.MULTILINE)


def _hooks():
    spec = importlib.util.spec_from_file_location("_docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def documented_paths() -> list[str]:
    """The API reference's names: each package's public names and each `::: path`."""
    hooks = _hooks()
    paths = set()
    for package in hooks.PACKAGES:
        module = importlib.import_module(package)
        file = Path(module.__file__ or "")
        is_init = file.name == "__init__.py"
        paths |= set(hooks.public_names(file.read_text(), package, is_init).values())
    for page in sorted((ROOT / "docs" / "api").glob("*.md")):
        paths |= set(_DIRECTIVE.findall(page.read_text()))
    return sorted(paths)


def documented_objects() -> dict[str, object]:
    """The functions and classes among `documented_paths()`, each once, under its shortest
    public path (`eqx_longctx.data.load_corpus`, not `eqx_longctx.data._corpus.load_corpus`)."""

    def rank(path: str) -> tuple:
        return path.count("._"), len(path), path

    by_id: dict[int, tuple[str, object]] = {}
    for path in documented_paths():
        obj = resolve_dotted(path)
        if not (inspect.isclass(obj) or inspect.isfunction(inspect.unwrap(obj))):
            continue  # constants and modules have no code to check
        if id(obj) not in by_id or rank(path) < rank(by_id[id(obj)][0]):
            by_id[id(obj)] = (path, obj)
    return dict(sorted(by_id.values(), key=lambda item: item[0]))


def _exception_name(node: ast.expr, namespace: dict) -> str | None:
    """The exception class a `raise` statement's expression raises, if it names one."""
    target = node.func if isinstance(node, ast.Call) else node
    parts = []
    while isinstance(target, ast.Attribute):
        parts.append(target.attr)
        target = target.value
    if not isinstance(target, ast.Name) or target.id not in namespace:
        return None
    obj = namespace[target.id]
    for attr in reversed(parts):
        obj = getattr(obj, attr, None)
    if isinstance(obj, type) and issubclass(obj, BaseException):
        return obj.__name__
    # A helper that builds the error: `raise unsupported(key, value, why)`.
    returns = getattr(obj, "__annotations__", {}).get("return") if callable(obj) else None
    if isinstance(node, ast.Call) and isinstance(returns, type):
        if issubclass(returns, BaseException):
            return returns.__name__
    return None  # `raise e`: a caught exception raised again


def _is_abstract_stub(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return len(body) == 1 and isinstance(body[0], ast.Raise)


def raised_exceptions(function) -> list[str]:
    """The exception classes `function`'s own source raises, sorted, without repeats.

    Ignores `raise` with no argument or with a caught exception, and `NotImplementedError`
    in an abstract method (one whose body only raises it).
    """
    function = inspect.unwrap(function)
    code = getattr(function, "__code__", None)
    if code is None:
        return []
    try:
        source = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError):
        return []  # generated (a dataclass `__init__`)
    tree = ast.parse(source)
    definition = tree.body[0]
    if not isinstance(definition, ast.FunctionDef | ast.AsyncFunctionDef):
        return []
    namespace = {**vars(builtins), **function.__globals__}
    names = set()
    for node in ast.walk(definition):
        if isinstance(node, ast.Raise) and node.exc is not None:
            name = _exception_name(node.exc, namespace)
            if name is not None:
                names.add(name)
    abstract = getattr(function, "__isabstractmethod__", False) or _is_abstract_stub(definition)
    if abstract:
        names.discard("NotImplementedError")
    return sorted(names)


def _missing(names: list[str], *docstrings: str | None) -> list[str]:
    raises = [doc.split("**Raises:**", 1)[1] for doc in docstrings if doc and "**Raises:**" in doc]
    return [name for name in names if not any(re.search(rf"\b{name}\b", r) for r in raises)]


def _function_of(member):
    if isinstance(member, staticmethod | classmethod):
        return member.__func__
    if isinstance(member, property):
        return member.fget
    if isinstance(member, types.FunctionType):
        return member
    return getattr(member, "__wrapped__", None)  # e.g. an Equinox-wrapped method


def _own_classes(cls: type) -> list[type]:
    """`cls` and the bases it inherits from this project, in lookup order."""
    return [c for c in cls.__mro__ if c.__module__.split(".")[0] in _PACKAGES]


def undocumented_raises(obj, name: str) -> list[str]:
    """A line for each exception `obj` raises that its docstring does not name.

    **Arguments:**

    - `obj`: a function or a class (others have nothing to check).
    - `name`: its dotted path, for the messages.

    **Returns:** the problems found, empty when the docstrings are complete.
    """
    found = []

    def check(what: str, names: list[str], *docstrings: str | None) -> None:
        for exc in _missing(names, *docstrings):
            found.append(
                f"{what} raises {exc} but its docstring does not say so: add `{exc}` "
                f"under **Raises:** with the condition that raises it."
            )

    if inspect.isclass(obj):
        constructor, seen = [], set()
        for cls in _own_classes(obj):
            for attr, member in vars(cls).items():
                function = _function_of(member)
                if function is None or not inspect.isfunction(function):
                    continue
                if attr in seen and attr != "__check_init__":  # every one runs
                    continue
                seen.add(attr)
                if attr in _CONSTRUCTORS:
                    constructor += raised_exceptions(function)
                elif not attr.startswith("_") or attr == "__call__":
                    check(f"{name}.{attr}", raised_exceptions(function), function.__doc__)
        init = getattr(obj, "__init__", None)
        check(name, sorted(set(constructor)), obj.__doc__, getattr(init, "__doc__", None))
    elif callable(obj) and inspect.isfunction(inspect.unwrap(obj)):
        check(name, raised_exceptions(obj), inspect.unwrap(obj).__doc__)
    return found


_OBJECTS = documented_objects()


def test_names_found():
    assert "eqx_longctx.ShardingSpec" in _OBJECTS and "models.llama.from_hf" in _OBJECTS
    assert "eqx_longctx.data.load_corpus" in _OBJECTS  # the public path, not `._corpus`
    assert "eqx_longctx.train._config.check_train_config" in _OBJECTS  # a documented helper


@pytest.mark.parametrize("path", list(_OBJECTS))
def test_raises_documented(path):
    problems = undocumented_raises(_OBJECTS[path], path)
    assert not problems, "\n".join(problems)


def _undocumented(value):
    """Return `value`."""
    if value < 0:
        raise ValueError("negative")
    try:
        return value
    except TypeError as e:
        raise e  # a re-raise: not counted


class _Undocumented:
    """A class whose constructor and method raise without saying so.

    **Raises:** `TypeError` when `x` is not an int.
    """

    def __init__(self, x):
        if not isinstance(x, int):
            raise TypeError("x")
        if x < 0:
            raise ValueError("x")

    def method(self):
        """Documented."""
        raise KeyError("k")

    def abstract(self):
        """To be overridden: its `NotImplementedError` is not counted."""
        raise NotImplementedError


def test_checker_reports_undocumented():
    assert raised_exceptions(_undocumented) == ["ValueError"]  # not the re-raised TypeError
    assert raised_exceptions(_Undocumented.abstract) == []
    (problem,) = undocumented_raises(_undocumented, "dummy")
    assert "dummy raises ValueError" in problem and "**Raises:**" in problem
    problems = undocumented_raises(_Undocumented, "Dummy")
    assert len(problems) == 2
    assert any(p.startswith("Dummy.method raises KeyError") for p in problems)
    assert any(p.startswith("Dummy raises ValueError") for p in problems)
