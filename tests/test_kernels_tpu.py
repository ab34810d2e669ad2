"""The Pallas kernels on the TPU's own terms, without a TPU: TPU interpret mode (VMEM/SMEM,
scalar prefetch and DMAs simulated, race detector on), the Mosaic lowering
(`jax.export(platforms=("tpu",))`) and calls inside `jax.shard_map`; every case through
`block_attention` with a `PallasBlockImpl`, as the library runs them. Cases, oracle and
helpers: `test_kernels.py`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import need_devices
from test_kernels import (
    CASES,
    check_close,
    check_lse,
    kwargs,
    loss_weights,
    make_case,
    oracle,
    oracle_kwargs,
    outputs_and_grads,
    pallas_block,
)

from eqx_longctx.kernels import race_detecting_interpret


@pytest.fixture
def race_detectors(monkeypatch):
    """Every race detector TPU interpret mode creates (one per kernel run). JAX exposes
    the detector only as `interpret_pallas_call.races`, replaced by each kernel run."""
    from eqx_longctx._compat import pallas_interpret_module

    ipc = pallas_interpret_module()

    made = []
    original = ipc.RaceDetectionState

    def recording(*args, **kw):
        made.append(original(*args, **kw))
        return made[-1]

    monkeypatch.setattr(ipc, "RaceDetectionState", recording)
    return made


# The default blocks of v5p / v6e (512 x 1024) over three query and two key blocks, ragged
# (so padded, segment ids on) and packed: empty, partial and full pairs at full block size.
_DEFAULT_BLOCKS = dict(sq=1300, sk=1300, hq=2, hk=1, d=128, dv=128, bq=512, bk=1024,
                       segments=([700, 600],) * 2)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, cores",
    [
        ("segments_mqa_ragged", 1),
        ("ring_hop_gqa", 2),
        ("bf16_window_ragged", 1),
        ("default_blocks", 2),
    ],  # fmt: skip
)
def test_tpu_interpret_mode_matches_oracle_without_races(name, cores, race_detectors):
    """VMEM/SMEM scratch, scalar prefetch and the skipped-block re-pointing run in TPU
    interpret mode, with fresh buffers NaN-filled and the race detector on; with 2 cores
    the "parallel" grid axes are split between them (wrong semantics give wrong grads).
    One case runs a generation's default blocks."""
    case = _DEFAULT_BLOCKS if name == "default_blocks" else CASES[name]
    dtype = case.get("dtype", jnp.float32)
    q, k, v, qp, kp, qs, ks = make_case(case)
    kw = kwargs(case) | dict(interpret=race_detecting_interpret(cores))
    w = loss_weights(case)
    (out, lse), grads = outputs_and_grads(
        lambda q, k, v: pallas_block(q, k, v, qp, kp, qs, ks, **kw), *w, q, k, v
    )
    assert len(race_detectors) == 3  # forward, dQ, dK/dV
    assert not any(r.races_found for r in race_detectors)
    (ref_out, ref_lse), ref_grads = outputs_and_grads(
        lambda q, k, v: oracle(q, k, v, qp, kp, qs, ks, **oracle_kwargs(case)), *w, q, k, v
    )
    check_close(out, ref_out, dtype, "out")
    check_lse(lse, ref_lse, dtype)
    for name_, g, r in zip("qkv", grads, ref_grads, strict=True):
        check_close(g, r, dtype, f"d{name_}")


@pytest.mark.parametrize(
    "dtype, segments, window", [(jnp.bfloat16, True, 300), (jnp.float32, False, None)]
)
def test_kernels_lower_to_mosaic_for_tpu(dtype, segments, window):
    """Forward, dQ and dK/dV lower through Pallas' Mosaic (TPU) lowering, block shapes and
    index maps included, without a TPU (`jax.export` for platform "tpu"). GQA, v_head_dim
    != head_dim and a ragged length are in the shape."""
    b, s, hq, hk, d, dv = 1, 1000, 4, 2, 128, 256
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    ids = jax.ShapeDtypeStruct((b, s), jnp.int32)

    def grads(q, k, v, qp, kp, qs, ks):
        def loss(q, k, v):
            out, lse = pallas_block(
                q, k, v, qp, kp, qs if segments else None, ks if segments else None,
                causal=True, window=window, block_q=256, block_k=512, interpret=False,
                max_live_blocks=None if window is None else 3,
            )  # fmt: skip
            return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

        return jax.grad(loss, (0, 1, 2))(q, k, v)

    exported = jax.export.export(jax.jit(grads), platforms=("tpu",))(
        spec(b, s, hq, d), spec(b, s, hk, d), spec(b, s, hk, dv), ids, ids, ids, ids
    )
    # With a bound on the live blocks each kernel is there twice: the cut grid and the
    # whole one it falls back to when the schedule overflows the bound.
    assert exported.mlir_module().count("tpu_custom_call") == (3 if window is None else 6)


def test_inside_shard_map():
    """Strategies call the kernels inside `jax.shard_map`: interpret mode with
    `check_vma=False` (JAX 0.10's interpreter rejects scalar prefetch under
    `check_vma=True`), and the TPU lowering with `check_vma=True` (the kernel outputs vary
    over the axes their inputs vary over)."""
    from jax.sharding import PartitionSpec as P

    need_devices(4)
    case = dict(sq=128, sk=128, b=4, hq=2, hk=1)
    q, k, v, qp, kp, _, _ = make_case(case)
    mesh = jax.make_mesh((4,), ("ctx",), devices=jax.devices()[:4])

    def local(q, k, v, qp, kp, interpret=True):
        def loss(q, k, v):
            out, lse = pallas_block(
                q, k, v, qp, kp, causal=True, block_q=128, block_k=128, interpret=interpret
            )
            return jnp.sum(out) + jnp.sum(lse), out

        (_, out), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
        return out, *grads

    specs = (P("ctx"),) * 5
    sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=specs[:4],
                                    check_vma=False))  # fmt: skip
    args = [jax.device_put(x, jax.NamedSharding(mesh, P("ctx"))) for x in (q, k, v, qp, kp)]
    for a, b in zip(sharded(*args), jax.jit(local)(q, k, v, qp, kp), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)

    compiled = functools.partial(local, interpret=False)
    with_vma = jax.jit(jax.shard_map(compiled, mesh=mesh, in_specs=specs, out_specs=specs[:4]))
    exported = jax.export.export(with_vma, platforms=("tpu",))(*args)
    assert exported.mlir_module().count("tpu_custom_call") == 3
