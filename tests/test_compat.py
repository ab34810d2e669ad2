"""JAX's private modules are used in one place (`eqx_longctx/_compat.py`), only inside
functions, and `import eqx_longctx` survives their names moving."""

import ast
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("eqx_longctx", "models")


def _private_imports(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jax._src"):
            yield node
        elif isinstance(node, ast.Import) and any(
            a.name.startswith("jax._src") for a in node.names
        ):
            yield node
        elif isinstance(node, ast.Attribute) and node.attr == "_src":
            yield node


def test_private_jax_only_in_the_compat_module():
    offenders = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name == "_compat.py" and path.parent.name == "eqx_longctx":
                continue
            for node in _private_imports(ast.parse(path.read_text())):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"jax._src used outside eqx_longctx/_compat.py: {offenders}"


def test_compat_imports_private_jax_only_inside_functions():
    tree = ast.parse((ROOT / "eqx_longctx" / "_compat.py").read_text())
    top_level = [n for n in tree.body if list(_private_imports(n))]
    top_level = [n for n in top_level if not isinstance(n, ast.FunctionDef)]
    assert not top_level, [n.lineno for n in top_level]
    functions = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert sum(1 for f in functions if list(_private_imports(f))) >= 5


def test_import_survives_private_names_moving():
    # Every private name the compat module reaches for is deleted before the packages are
    # imported; importing (and building the CLIs' parsers) must not touch them.
    script = textwrap.dedent(
        """
        import importlib, sys
        import jax
        gone = {}
        for module, name in [
            ("jax._src.ad_checkpoint", "saved_residuals"),
            ("jax._src.distributed", "global_state"),
            ("jax._src.cloud_tpu_init", "running_in_cloud_tpu_vm"),
        ]:
            m = importlib.import_module(module)
            gone[m, name] = getattr(m, name)
            delattr(m, name)
        sys.modules["jax._src.clusters.cloud_tpu_cluster"] = None  # importing it raises
        import eqx_longctx, eqx_longctx.nn, eqx_longctx.train, eqx_longctx.data
        import eqx_longctx.kernels, models
        import eqx_longctx.plan
        from eqx_longctx import _compat
        try:
            _compat.saved_residuals(lambda x: x, 1.0)
        except (ImportError, AttributeError):
            print("MOVED-OK")
        for (m, name), value in gone.items():
            setattr(m, name, value)  # JAX's own exit handlers use them
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "MOVED-OK" in out.stdout
