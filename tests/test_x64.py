"""`jax_enable_x64` changes nothing: a tiny Llama's jitted logits, its greedy `generate` tokens
and attention's gradients are those of the default 32-bit mode, in float32 (int32 tokens),
with `impl="auto"` on one device and under a ring/zig-zag spec on 8 fake devices, and with
the Pallas kernels (interpret mode), whose logsumexp stays float32 and whose output keeps
the input's dtype (bfloat16 too).

x64 is a process-wide flag read when arrays are made, so each mode runs in its own child
process (the two at once), which writes its results to an `.npz` file."""

import os
import subprocess
import sys

import numpy as np
from helpers import CHILD_XLA_FLAGS, ROOT, assert_close, need_devices

# argv: the output path. Every case in one process: its imports and start are half its time.
_CHILD = """
import sys
import jax
import jax.numpy as jnp
import numpy as np
import eqx_longctx as el
from models.llama import Llama, LlamaConfig

res = {"int_dtype": np.array(str(jnp.arange(2).dtype))}
keys = jax.random.split(jax.random.key(0), 5)
q = jax.random.normal(keys[0], (2, 64, 4, 16), jnp.float32)
k = jax.random.normal(keys[1], (2, 64, 2, 16), jnp.float32)
v = jax.random.normal(keys[2], (2, 64, 2, 16), jnp.float32)
ct = jax.random.normal(keys[3], (2, 64, 4, 16), jnp.float32)
seg = jnp.broadcast_to(jnp.arange(64) // 24, (2, 64))  # int64 under x64, as users make them
tokens = jax.random.randint(keys[4], (2, 16), 0, 259, dtype=jnp.int32)
mesh = jax.make_mesh((2, 4), ("data", "context"))
ring = el.ShardingSpec(mesh, strategy="ring", load_balance="zigzag")


def grads(case, loss):
    dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    res.update({f"{case}/dq": dq, f"{case}/dk": dk, f"{case}/dv": dv})


for case, spec in (("one", None), ("ring", ring)):  # impl="auto"
    model = Llama(LlamaConfig.from_preset("tiny", n_layers=1), key=keys[4], spec=spec)
    res[f"{case}/logits"] = jax.jit(lambda m, t: m(t))(model, tokens)
    res[f"{case}/tokens"] = el.generate(model, tokens[:, :8], max_new_tokens=3)
    grads(case, lambda q, k, v: jnp.sum(el.attention(q, k, v, spec=spec, segment_ids=seg) * ct))


def pallas_loss(q, k, v):
    out, lse = el.flash_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, impl="pallas")
    res["pallas/lse_dtype"] = np.array(str(lse.dtype))
    return jnp.sum(out * ct) + jnp.sum(lse * ct[..., 0])


grads("pallas", pallas_loss)
half = [x.astype(jnp.bfloat16) for x in (q, k, v)]
res["pallas/bf16_out_dtype"] = np.array(str(el.flash_attention(*half, impl="pallas")[0].dtype))
np.savez(sys.argv[1], **{name: np.asarray(x) for name, x in res.items()})
"""

_TIMEOUT_S = 300


def _run_both(tmp_path) -> tuple[dict, dict]:
    """`_CHILD` in two processes at once, x64 off and on: their results."""
    procs = {}
    for x64 in ("0", "1"):
        env = dict(
            os.environ,
            PYTHONPATH=str(ROOT),
            JAX_PLATFORMS="cpu",
            JAX_ENABLE_X64=x64,
            XLA_FLAGS=CHILD_XLA_FLAGS + " --xla_force_host_platform_device_count=8",
        )
        path = tmp_path / f"x64_{x64}.npz"
        procs[x64] = (
            subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(path)],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            ),
            path,
        )
    results = []
    try:
        for x64, (proc, path) in procs.items():
            log, _ = proc.communicate(timeout=_TIMEOUT_S)
            assert proc.returncode == 0, f"x64={x64} child failed:\n{log[-4000:]}"
            results.append(dict(np.load(path)))
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    return results[0], results[1]


def test_x64_gives_the_32_bit_results(tmp_path):
    need_devices(8)
    base, wide = _run_both(tmp_path)
    assert str(base["int_dtype"]) == "int32" and str(wide["int_dtype"]) == "int64"
    for case in ("one", "ring"):
        logits, tokens = f"{case}/logits", f"{case}/tokens"
        assert wide[logits].dtype == np.float32, logits
        assert_close(wide[logits], base[logits], factor=0.05, what=logits)
        assert wide[tokens].dtype == np.int32, tokens
        np.testing.assert_array_equal(wide[tokens], base[tokens], err_msg=tokens)
    assert str(wide["pallas/lse_dtype"]) == "float32"
    assert str(wide["pallas/bf16_out_dtype"]) == "bfloat16"
    for case in ("one", "ring", "pallas"):
        for name in (f"{case}/dq", f"{case}/dk", f"{case}/dv"):
            assert wide[name].dtype == np.float32, name
            assert_close(wide[name], base[name], factor=0.5, what=name)
