"""Every notebook runs top to bottom (its code cells, in order, in a fresh interpreter)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
    cells = json.loads(path.read_text())["cells"]
    code = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    script = tmp_path / f"{path.stem}.py"
    script.write_text(code)
    env_root = pathlib.Path(__file__).parent.parent
    # The repository on the path, as in a notebook started there (installed or not).
    path = os.pathsep.join(filter(None, [str(env_root), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, str(script)], cwd=env_root, capture_output=True, text=True,
        timeout=600, env=dict(os.environ, PYTHONPATH=path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
