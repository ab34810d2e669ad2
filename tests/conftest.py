"""Test harness: 8 fake CPU devices, set before any array exists, and a quicker backend
compile (inherited by every subprocess a test starts)."""

import os

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
if "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
