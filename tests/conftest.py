"""Test harness: 8 fake CPU devices, set before any array exists, and a quicker backend
compile (inherited by every subprocess a test starts)."""

import fnmatch
import os
import pathlib
import re
import subprocess
import sys


def _xla_accepts(flag: str) -> bool:
    """Whether this jaxlib's XLA knows `flag`. XLA aborts a process whose `XLA_FLAGS` holds
    a flag it does not know (JAX 0.12 has no `--xla_cpu_use_fusion_emitters`), so a child
    process tries it (about 1.5 s, once per test process)."""
    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    return subprocess.run(probe, env=env, capture_output=True, timeout=120).returncode == 0


os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# The tests compile far more than they run, and most of a compile on CPU is LLVM's: its -O0
# halves compile-bound tests (test_partition's DeepSeek cases: 108 -> 62 s). XLA's own HLO
# passes (fusion, buffer assignment, collectives: what tests inspect) are unchanged.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
# The next largest part is XLA:CPU's MLIR fusion emitters; the older emitter they replace
# compiles the same fusions sooner (that DeepSeek case: 20 -> 14 s; the ring oracle cases
# 76 -> 58 s). Fusion decisions, buffers and collectives are XLA's and do not change.
# JAX 0.12's XLA has only the new emitters, and no flag to choose.
if "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"] and _xla_accepts(
    "--xla_cpu_use_fusion_emitters=false"
):
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"

# Not used: JAX's persistent compilation cache (one directory per session, shared by the
# xdist workers and their child processes through JAX_COMPILATION_CACHE_DIR, every program
# written). CI starts from an empty cache, so only reuse within a run counts, and there it
# saved nothing reliable. CPU seconds (user + sys) of `pytest -n 2` without / with, runs
# alternated on this 2-core machine: the trainer files (test_train, _train_sharded,
# _grad_accum, _host_offload) 201 / 202 and 212 / 216 while it was quiet, 255 / 228 under
# other users' load; the attention grids (test_context_parallel, _window, _zigzag_halves,
# _impls, _latent_attention) 449 / 466; the files that start processes (test_export,
# _generate_cli, _preemption, _multihost, _multihost_examples, _grain_multiprocess) 284,
# 284 / 291, 241, and 277, 279 with the cache in the child processes alone. About 40% of
# the entries were read again, but writing every program costs about what those reads
# save. No test failed with it, and with a warm cache (every program read back) the
# compile-bound files took half the CPU (753 -> 356 s): it pays across runs, which CI's
# fresh clone does not have.

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

FULL_ENV = "EQX_LONGCTX_FULL_TESTS"
FULL_TIER = pathlib.Path(__file__).with_name("full_tier.txt")


def pytest_addoption(parser):
    parser.addoption(
        "--full", action="store_true", default=False,
        help=f"also run the full tier: the cases listed in {FULL_TIER.name} or marked `full` "
        f"(or set {FULL_ENV}=1)",
    )  # fmt: skip


def full_tier_regex(pattern: str) -> "re.Pattern[str]":
    """A `full_tier.txt` line as a regex over node ids: `*` matches anything, every other
    character (the brackets of parameter ids too) only itself."""
    return re.compile(fnmatch.translate(re.sub(r"([\[\]])", r"[\1]", pattern)))


def _full_tier_patterns() -> list[str]:
    """The node-id patterns of `full_tier.txt` (`*` a wildcard, brackets literal)."""
    lines = (line.strip() for line in FULL_TIER.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark the full tier's cases and skip them unless `--full` asks for them.

    The default tier is what CI runs: every grid keeps a cover of its factors (each value of
    each factor at least once), every end-to-end command runs at least once. The full tier
    (`full_tier.txt`, and tests marked `full`) adds the rest of each grid and the repeats of
    long runs under other settings; run it before a release or after touching a strategy.
    A line of `full_tier.txt` that names no collected test is an error when whole files
    are collected (a renamed test must be renamed there too).
    """
    patterns = _full_tier_patterns()
    regexes = [full_tier_regex(p) for p in patterns]
    used = [False] * len(patterns)
    for item in items:
        for i, regex in enumerate(regexes):
            if regex.match(item.nodeid):
                used[i] = True
                item.add_marker(pytest.mark.full)
                break
    whole_files = not any("::" in a for a in config.args) and not config.option.keyword
    files = {item.nodeid.split("::")[0] for item in items}
    stale = [p for p, u in zip(patterns, used, strict=True)
             if not u and p.split("::")[0] in files]  # fmt: skip
    if whole_files and stale:
        raise pytest.UsageError(
            f"{FULL_TIER.name} names tests that were not collected (renamed or removed? "
            f"update the file): {stale}"
        )
    if config.getoption("--full") or os.environ.get(FULL_ENV, "") not in ("", "0"):
        return
    skip = pytest.mark.skip(reason="full tier: run with --full (the default tier covers it)")
    for item in items:
        if item.get_closest_marker("full") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each test module.

    A test worker compiles thousands of programs, and XLA:CPU maps each one's code into
    memory. Kept in JAX's and the library's caches, they added up to the kernel's limit on
    memory mappings (`vm.max_map_count`, 65,530 here) about 870 tests into a worker, and the
    next compile crashed inside LLVM (a segfault or abort, with no message). Emptying the
    caches between modules (`eqx_longctx.clear_caches`) holds a worker well under the
    limit; a module rarely reuses another's programs, so it costs little compile time.
    """
    yield
    # Imported here, not at the top: jaxtyping's import hook must see the library first.
    from eqx_longctx import clear_caches

    clear_caches()
