"""Which way the imports run: the strategies sit on the block contract and never import an
implementation of it (XLA or Pallas), so swapping the block function never touches one."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
STRATEGIES = ("_all_gather.py", "_ulysses.py", "_ring.py", "_usp.py")
IMPLEMENTATIONS = ("_impls", "_local", "_tiles", "kernels", "_reference")


def _imports(path: pathlib.Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            out.append("." * node.level + (node.module or ""))
            out += ["." * node.level + (node.module or "") + "." + a.name for a in node.names]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return out


def test_strategies_import_no_implementation():
    folder = ROOT / "eqx_longctx" / "attention"
    offenders = {}
    for name in STRATEGIES:
        bad = [
            m
            for m in _imports(folder / name)
            if any(part in IMPLEMENTATIONS for part in m.replace(".", " ").split())
        ]
        if bad:
            offenders[name] = bad
    assert not offenders, offenders


def test_the_check_sees_an_implementation_import(tmp_path):
    fake = tmp_path / "_ring.py"
    fake.write_text("from ._impls import XlaBlockImpl\nfrom ..kernels import PallasBlockImpl\n")
    found = [
        m for m in _imports(fake) if any(p in IMPLEMENTATIONS for p in m.replace(".", " ").split())
    ]
    assert len(found) == 4
