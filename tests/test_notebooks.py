"""Every notebook runs top to bottom (its code cells, in order, in a fresh interpreter) and
checks what it shows: a notebook without an assertion could print a wrong number and pass."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
# A bare `assert` statement or a `numpy.testing.assert_*` call, at the start of a line.
ASSERTION = re.compile(r"^\s*(assert\b|(np\.)?testing\.assert_\w+\()", re.MULTILINE)


def code_of(path):
    cells = json.loads(path.read_text())["cells"]
    return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_asserts(path):
    assert ASSERTION.search(code_of(path)), (
        f"{path.name} asserts nothing: add `assert` statements (with messages) next to the "
        "numbers, shapes and equalities its cells show, so a wrong result fails the test"
    )


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
    script = tmp_path / f"{path.stem}.py"
    script.write_text(code_of(path))
    env_root = pathlib.Path(__file__).parent.parent
    # The repository on the path, as in a notebook started there (installed or not).
    path = os.pathsep.join(filter(None, [str(env_root), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, str(script)], cwd=env_root, capture_output=True, text=True,
        timeout=600, env=dict(os.environ, PYTHONPATH=path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
