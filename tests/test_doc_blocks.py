"""Every code example a user copies from README.md and docs/ runs.

- The fenced `python` blocks of one Markdown file run in order in one fresh interpreter
  with 8 fake CPU devices, as a user pastes them into a notebook. A failure names the file
  and the line its block starts on; the traceback's line numbers are the file's own.
- A block that is deliberately a fragment (a signature, pseudo-code) carries the fence
  option `title="Sketch: ..."`: the docs render it as a visible title bar over the block,
  and it is not run. Keep those few.
- The shell commands of the project's CLIs (`python -m eqx_longctx.train`, `.plan`,
  `.generate`) in `bash` (or unlabelled) blocks are parsed by the CLI's own parser
  and checked against the mesh on fake devices (`helpers.check_cli_commands`, as the
  recipes in examples/ are): none may be refused.

No Markdown-testing plugin does this: pytest-markdown-docs, pytest-codeblocks, mktestdocs
and pytest-examples exec each block inside the pytest process (no fresh interpreter per
file, no device count of its own) and know nothing of shell commands.
"""

import dataclasses
import json
import math
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
from helpers import CHILD_XLA_FLAGS, ROOT, check_cli_commands

MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PYTHON = ("python", "py", "python3")
SHELL = ("bash", "sh", "shell", "console", "")
CLI_MODULES = ("eqx_longctx.train", "eqx_longctx.plan", "eqx_longctx.generate")
SCRIPTS = {  # console scripts
    "eqx-longctx-train": "eqx_longctx.train",
    "eqx-longctx-generate": "eqx_longctx.generate",
}
_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_SKETCH = re.compile(r'\btitle="Sketch\b')


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced code block: its file, the line of its opening fence (1-based), its
    language, the rest of its info string and its code (dedented to its fence)."""

    path: pathlib.Path
    line: int
    lang: str
    options: str
    code: str

    @property
    def where(self) -> str:
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{path}:{self.line}"

    @property
    def sketch(self) -> bool:
        return bool(_SKETCH.search(self.options))


def fenced_blocks(path: pathlib.Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, nested ones (in an admonition or a list)
    included."""
    blocks, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, fence = len(m["indent"]), m["fence"]
        lang, _, options = m["info"].strip().partition(" ")
        close = re.compile(rf"^ *{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        pad = " " * indent
        code = "\n".join(s[indent:] if s.startswith(pad) else s.lstrip() for s in lines[i + 1 : j])
        blocks.append(Block(path, i + 1, lang.lower(), options, code + "\n"))
        i = j + 1
    return blocks


def python_blocks(path: pathlib.Path) -> list[Block]:
    return [b for b in fenced_blocks(path) if b.lang in PYTHON and not b.sketch]


def cli_commands(block: Block) -> list[list[str]]:
    """The project's CLI commands in a shell block, each `[module, *flags]`: lines joined
    at a trailing backslash, comments dropped, each command ending at `&&`, `;`, `|`, ..."""
    commands = []
    for line in block.code.replace("\\\n", " ").splitlines():
        if not any(name in line for name in (*CLI_MODULES, *SCRIPTS)):
            continue  # prose or other commands (an unlabelled block may be a diagram)
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words = list(lexer)
        for i, word in enumerate(words):
            if word in SCRIPTS:
                module, start = SCRIPTS[word], i + 1
            elif (
                re.fullmatch(r"python[\d.]*", word)
                and words[i + 1 : i + 2] == ["-m"]
                and words[i + 2 : i + 3] != []
                and words[i + 2] in CLI_MODULES
            ):
                module, start = words[i + 2], i + 3
            else:
                continue
            end = start
            while end < len(words) and not set(words[end]) <= set("&|;<>()"):
                end += 1
            commands.append([module, *words[start:end]])
    return commands


# Runs the blocks ([path, where, line, code], in order) in one namespace; the code is
# compiled under the Markdown file's path with its lines shifted to the file's, so a
# traceback shows the file's own line numbers and text.
RUNNER = r"""
import json, sys, traceback
namespace = {"__name__": "__main__"}
for path, where, line, code in json.load(sys.stdin):
    try:
        exec(compile("\n" * line + code, path, "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        print(f"\n{where}: the python block starting on this line failed", file=sys.stderr)
        sys.exit(1)
"""


def run_blocks(blocks: list[Block], cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """Run `blocks` in one fresh interpreter with 8 fake CPU devices, in `cwd`."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(
        XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {CHILD_XLA_FLAGS}",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(ROOT),
        MPLBACKEND="Agg",
    )
    payload = [[str(b.path), b.where, b.line, b.code] for b in blocks]
    return subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=json.dumps(payload),
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


RUNNABLE = [p for p in MARKDOWN if python_blocks(p)]


@pytest.mark.parametrize("path", RUNNABLE, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(path, tmp_path):
    result = run_blocks(python_blocks(path), tmp_path)
    assert result.returncode == 0, result.stderr[-6000:]


def test_cli_commands_are_accepted():
    found = [
        (b, c)
        for p in MARKDOWN
        for b in fenced_blocks(p)
        if b.lang in SHELL
        for c in cli_commands(b)
    ]
    assert {c[0] for _, c in found} == set(CLI_MODULES), "the docs show every CLI"
    devices = max(_devices(flags) for _, (_, *flags) in found)
    refusals = check_cli_commands([c for _, c in found], devices=devices)
    refused = [
        f"{b.where}: {shlex.join(c)}\n  {r}" for (b, c), r in zip(found, refusals, strict=True) if r
    ]
    assert not refused, "\n".join(refused)


def _devices(flags: list[str]) -> int:
    """The devices a command's mesh needs (`--devices`, else the product of `--mesh`)."""
    named = dict(zip(flags, flags[1:], strict=False))
    if "--devices" in named:
        return int(named["--devices"])
    mesh = named.get("--mesh", "data=2,context=4")
    return math.prod(int(size) for _, _, size in (axis.partition("=") for axis in mesh.split(",")))


def test_collector(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# t\n\n```python\nx = 1\n```\n\n"
        '!!! note\n    ```python title="Sketch: a signature"\n    def f(x): ...\n    ```\n\n'
        "- item\n\n    ````py\n    y = x + 1\n    ````\n\n"
        "```bash\n# comment\npip install -e . && python -m eqx_longctx.train --mesh \\\n"
        "    context=8 --steps 2  # trailing\neqx-longctx-train --devices 1; ls\n```\n"
    )
    blocks = fenced_blocks(doc)
    assert [(b.line, b.lang, b.sketch) for b in blocks] == [
        (3, "python", False), (8, "python", True), (14, "py", False), (18, "bash", False),
    ]  # fmt: skip
    assert [b.code for b in python_blocks(doc)] == ["x = 1\n", "y = x + 1\n"]
    assert cli_commands(blocks[3]) == [
        ["eqx_longctx.train", "--mesh", "context=8", "--steps", "2"],
        ["eqx_longctx.train", "--devices", "1"],
    ]
    assert _devices(["--mesh", "expert=8,context=32"]) == 256 and _devices([]) == 8


def test_a_broken_block_names_its_file_and_line(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(
        "Text.\n\n```python\nx = 1\n```\n\nMore.\n\n```python\ny = x\nz = undefined_name\n```\n"
    )
    result = run_blocks(python_blocks(doc), tmp_path)
    assert result.returncode == 1
    assert f"{doc}:9: the python block starting on this line failed" in result.stderr
    assert f'File "{doc}", line 11' in result.stderr and "z = undefined_name" in result.stderr


def test_examples_are_found_and_sketches_few():
    blocks = [b for p in MARKDOWN for b in fenced_blocks(p) if b.lang in PYTHON]
    readme = python_blocks(ROOT / "README.md")
    assert len(readme) >= 2 and len(RUNNABLE) >= 4, [b.where for b in blocks]
    sketches = [b.where for b in blocks if b.sketch]
    assert len(sketches) <= 3, f"make these runnable: {sketches}"
