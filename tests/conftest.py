"""Test harness: 8 fake CPU devices, set before any array exists, and a quicker backend
compile (inherited by every subprocess a test starts)."""

import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# The tests compile far more than they run, and most of a compile on CPU is LLVM's: its -O0
# halves compile-bound tests (test_partition's DeepSeek cases: 108 -> 62 s). XLA's own HLO
# passes (fusion, buffer assignment, collectives: what tests inspect) are unchanged.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

# One persistent compilation cache for the run, shared by the xdist workers and every
# subprocess a test starts: a program one test compiled (over 0.5 s) is loaded by the next.
# Keys cover the program, the flags and the versions, so a cache left by an earlier run only
# skips work. Measured: four compile-heavy test files 229 -> 210 s from an empty cache;
# test_plan's memory analyses hold for executables loaded from it.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"eqx_longctx_tests_jax_cache_{os.getuid()}"
    )
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
