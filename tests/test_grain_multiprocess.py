"""GrainBatches with real processes: 2 processes x 4 CPU devices (gloo over localhost) each
feed only their part, and the global arrays equal the single-process old path."""

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

from helpers import CHILD_XLA_FLAGS

ROOT = Path(__file__).resolve().parents[1]

WORKER = textwrap.dedent(
    """
    import json, sys
    import jax

    pid, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid,
        initialization_timeout=60,
    )
    import numpy as np
    from eqx_longctx import ShardingSpec, to_layout
    from eqx_longctx.data import GrainBatches, GrainEvalBatches, PackedDataset
    from jax.experimental import multihost_utils

    rng = np.random.default_rng(0)
    docs = ["".join(rng.choice(list("abcdef \\n"), rng.integers(1, 90))) for _ in range(40)]
    ds = PackedDataset.from_documents(docs, 32, seed=5)
    specs = {
        "data2_context4": ((2, 4), ("data", "context"), {}),
        "context8_striped": ((8,), ("context",), {"load_balance": "striped"}),
        "usp": ((2, 4), ("ulysses", "context"), {"strategy": "usp", "ulysses_axis": "ulysses"}),
        "fsdp4_context2": ((4, 2), ("fsdp", "context"), {"fsdp_axis": "fsdp"}),
    }
    result = {}
    for name, (sizes, names, kwargs) in specs.items():
        spec = ShardingSpec(jax.make_mesh(sizes, names), **kwargs)
        batches = GrainBatches(ds, batch_size=4, seed=5, spec=spec)
        evals = GrainEvalBatches(ds, batch_size=4, spec=spec)
        checks, shards = [], 0
        for got, want in [(batches.get(s), ds.batch(s, 4)) for s in (0, 9)] + [
            (evals.get(len(evals) - 1), list(ds.eval_batches(4))[-1])
        ]:
            for x, w in zip(got, want, strict=True):
                w = to_layout(np.asarray(w), spec, axis=1)
                sharding = spec.sharding(spec.token_pspec())
                checks.append(x.shape == w.shape and x.sharding == sharding)
                for shard in x.addressable_shards:  # only this process's devices
                    checks.append(np.array_equal(np.asarray(shard.data), w[shard.index]))
                    shards += 1
            # The whole global array, gathered from both processes.
            full = multihost_utils.process_allgather(got.tokens, tiled=True)
            checks.append(np.array_equal(full, to_layout(np.asarray(want.tokens), spec, axis=1)))
        for _ in range(3):
            next(batches)
        result[name] = {
            "ok": bool(all(checks)),
            "shards": shards,
            "rows": batches.part.rows.tolist(),
            "slots": len(batches.part.slots),
            "state": batches.get_state(),
        }
    Path = __import__("pathlib").Path
    Path(out).write_text(json.dumps(result))
    jax.distributed.shutdown()
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_feed_their_parts(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": CHILD_XLA_FLAGS}
    env.pop("JAX_NUM_CPU_DEVICES", None)
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(p), str(port), str(tmp_path / f"out{p}.json")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for p in range(2)
    ]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=240)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    for proc, log in zip(procs, logs, strict=True):
        assert proc.returncode == 0, log[-3000:]
    out = [json.loads((tmp_path / f"out{p}.json").read_text()) for p in range(2)]
    for name in out[0]:
        assert out[0][name]["ok"] and out[1][name]["ok"], name
        assert out[0][name]["shards"] == out[1][name]["shards"] == 3 * 5 * 4  # 4 devices each
        # The iterator state is the same on both processes: the step, not the process.
        assert out[0][name]["state"] == out[1][name]["state"]
        assert out[0][name]["state"]["grain"] == {"next_index": 3}
    # Each process read only its rows / its sequence slots.
    assert out[0]["data2_context4"]["rows"] == [0, 1] and out[1]["data2_context4"]["rows"] == [2, 3]
    assert out[0]["context8_striped"]["slots"] == 16 == out[1]["context8_striped"]["slots"]
    assert out[0]["fsdp4_context2"]["rows"] == [0, 1] and out[1]["fsdp4_context2"]["rows"] == [2, 3]
