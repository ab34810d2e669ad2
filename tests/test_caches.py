"""`clear_caches` lets go of every compiled program JAX and the library keep, and nothing
but compile time is lost: results after it equal those before."""

import json
import subprocess
import sys

import jax
import numpy as np

import eqx_longctx as el
from eqx_longctx.attention._block import _jitted
from eqx_longctx.data import load_datasets
from eqx_longctx.train import TrainConfig, Trainer
from eqx_longctx.train._step_cache import _STEP_CACHE

SMALL_MODEL = {"dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "hidden_dim": 64}


def _losses(run_dir, datasets):
    config = TrainConfig(
        model_overrides=SMALL_MODEL, seq_len=32, batch_size=4, steps=2, lr=1e-2,
        warmup_steps=1, run_dir=str(run_dir), checkpoint_every=1000, eval_every=1000,
        eval_batches=1, progress=False, devices=1,
    )  # fmt: skip
    trainer = Trainer(config, datasets=datasets)
    trainer.run()
    trainer.close()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r.get("split") == "train"]


def test_clear_caches_empties_every_cache_and_results_stay(tmp_path):
    datasets = load_datasets(None, seq_len=32, max_bytes=40_000, val_fraction=0.1)
    q, k, v = jax.random.normal(jax.random.PRNGKey(0), (3, 1, 64, 2, 16))
    traces = []
    double = jax.jit(lambda x: traces.append(x) or 2 * x)
    double(np.float32(1.0))
    double(np.float32(1.0))
    before = np.asarray(el.attention(q, k, v))
    losses = _losses(tmp_path / "a", datasets)
    assert len(_STEP_CACHE) > 0 and _jitted.cache_info().currsize > 0
    assert len(traces) == 1  # the second call reused the compiled program

    el.clear_caches()

    assert len(_STEP_CACHE) == 0 and _jitted.cache_info().currsize == 0
    double(np.float32(1.0))
    assert len(traces) == 2  # JAX's cache was emptied: traced and compiled again
    # Compiled again, the same programs give the same numbers.
    np.testing.assert_array_equal(np.asarray(el.attention(q, k, v)), before)
    assert _losses(tmp_path / "b", datasets) == losses and len(losses) == 2


def test_clear_caches_does_not_import_the_trainer():
    """A process that never trained does not pay for the trainer's imports (orbax) to clear."""
    code = (
        "import sys, eqx_longctx as el; el.clear_caches(); "
        "assert 'eqx_longctx.train' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
