"""MkDocs hook: the API reference must document every public name.

A public name is one listed in a package's `__all__` or, without one, re-exported with
`from ._x import Name as Name`. Each must resolve to an object that a `::: path` directive
under `docs/api/` documents (under any of its names, so `models.llama.Llama3RopeScaling` is
covered by `::: eqx_longctx.nn.Llama3RopeScaling`). A missing one is a warning, which
`mkdocs build --strict` turns into a failed build.
"""

import ast
import logging
import re
from pathlib import Path

PACKAGES = (
    "eqx_longctx",
    "eqx_longctx.nn",
    "eqx_longctx.data",
    "eqx_longctx.train",
    "eqx_longctx.evals",
    "eqx_longctx.kernels",
    "models",
    "models.llama",
    "models.deepseek",
)
_DIRECTIVE = re.compile(r"^::: +(\S+)", re.MULTILINE)
log = logging.getLogger("mkdocs.hooks.api_coverage")


def public_names(source: str, package: str, is_init: bool) -> dict[str, str]:
    """The names a module exports: its `__all__`, else its `X as X` imports.

    **Returns:** each name with the path it is defined under (`eqx_longctx.attention` is
    the function `eqx_longctx.attention.attention`, not the subpackage of that name).
    """
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return {name: f"{package}.{name}" for name in ast.literal_eval(node.value)}
    names = {}
    for node in tree.body:
        if not isinstance(node, ast.ImportFrom):
            continue
        parts = package.split(".")
        base = parts[: len(parts) - node.level + (1 if is_init else 0)] if node.level else []
        origin = ".".join(base + ([node.module] if node.module else []))
        for alias in node.names:
            if alias.asname == alias.name and not alias.name.startswith("_"):
                names[alias.name] = f"{origin}.{alias.name}"
    return names


def on_pre_build(config) -> None:
    root = Path(config["config_file_path"]).parent
    import griffe  # here, not at the top: tests import `public_names` without the docs extra

    loader = griffe.GriffeLoader(search_paths=[str(root)])
    for top in {p.split(".")[0] for p in PACKAGES}:
        loader.load(top)
    loader.resolve_aliases(implicit=True, external=False)
    modules = loader.modules_collection

    def target(path: str) -> str | None:
        try:
            obj = modules[path]
        except KeyError:
            return None
        return obj.final_target.path if obj.is_alias else obj.path

    api = Path(config["docs_dir"]) / "api"
    documented = {
        target(path)
        for page in sorted(api.glob("*.md"))
        for path in _DIRECTIVE.findall(page.read_text())
    } - {None}
    for package in PACKAGES:
        module = modules[package]
        source = Path(module.filepath).read_text()
        for name, origin in public_names(source, package, module.is_init_module).items():
            if target(origin) not in documented:
                log.warning(
                    f"API reference: `{package}.{name}` is public but no "
                    f"`::: {package}.{name}` directive under docs/api/ documents it."
                )
