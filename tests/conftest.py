"""Test harness: 8 fake CPU devices, set before any array exists, and a quicker backend
compile (inherited by every subprocess a test starts)."""

import os
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

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


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
