"""The Pallas kernels' VMEM: the estimator counts what the kernels declare, every TPU
generation's default blocks fit its budget with headroom (through the key sub-block), the
sub-block loop gives the oracle's numbers, and an exported TPU program asks Mosaic for the
budget (`vmem_limit_bytes`)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from eqx_longctx import flash_attention
from eqx_longctx import reference_attention as oracle
from eqx_longctx.kernels import (
    DEFAULT_BLOCK_SIZES,
    PallasBlockImpl,
    _vmem,
    pallas_flash_backward,
    pallas_flash_forward,
)
from eqx_longctx.kernels._blocks import make_config

MiB = 2**20


def _pallas_calls(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, list | tuple) else [param]:
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    yield from _pallas_calls(getattr(inner, "jaxpr", inner))


def _padded_bytes(shape, dtype) -> int:
    """A VMEM buffer's bytes: the minor dim padded to the 128 lanes."""
    *major, minor = shape
    return int(np.prod(major, dtype=int)) * (-(-minor // 128) * 128) * jnp.dtype(dtype).itemsize


def _declared(eqn) -> tuple[int, int]:
    """(double-buffered blocks, scratch) bytes a traced `pallas_call` declares."""
    gm = eqn.params["grid_mapping"]
    blocks = 0
    for bm in gm.block_mappings:
        shape = [getattr(b, "block_size", b) for b in bm.block_shape]
        shape = [s for s in shape if isinstance(s, int)]
        blocks += 2 * _padded_bytes(shape, bm.array_aval.dtype)
    invars = eqn.params["jaxpr"].invars
    scratch = invars[len(invars) - gm.num_scratch_operands :] if gm.num_scratch_operands else []
    return blocks, sum(_padded_bytes(v.aval.shape, v.aval.dtype) for v in scratch)


CASES = [  # (dtype, head_dim, v_head_dim, segments, block_q, block_k)
    (jnp.float32, 64, 64, False, 128, 256),
    (jnp.bfloat16, 128, 128, True, 256, 128),
    (jnp.float32, 192, 128, True, 128, 128),  # MLA
]


@pytest.mark.parametrize("dtype, d, dv, segments, bq, bk", CASES)
def test_estimated_buffers_are_what_the_kernels_declare(dtype, d, dv, segments, bq, bk):
    """Buffers and scratch of the estimate equal the blocks and scratch the traced forward,
    dQ and dK/dV `pallas_call`s declare (double-buffered, lanes padded)."""
    b, s, hq, hk = 1, 512, 2, 1
    q = jnp.zeros((b, s, hq, d), dtype)
    k, v = jnp.zeros((b, s, hk, d), dtype), jnp.zeros((b, s, hk, dv), dtype)
    pos = jnp.arange(s)[None]
    seg = (pos >= 100).astype(jnp.int32) if segments else None
    kw = dict(causal=True, block_q=bq, block_k=bk, interpret=True)

    def both(q, k, v):
        out, lse = pallas_flash_forward(q, k, v, pos, pos, seg, seg, **kw)
        delta = jnp.zeros(lse.shape, jnp.float32)
        return pallas_flash_backward(q, k, v, pos, pos, seg, seg, out, lse, delta, **kw)

    calls = list(_pallas_calls(jax.make_jaxpr(both)(q, k, v).jaxpr))
    assert [str(c.params["name"]) for c in calls] == [
        "eqx_longctx_flash_fwd", "eqx_longctx_flash_bwd_dq", "eqx_longctx_flash_bwd_dkv",
    ]  # fmt: skip
    for kernel, call in zip(_vmem.KERNELS, calls, strict=True):
        est = _vmem.vmem_estimate(
            kernel, block_q=bq, block_k=bk, block_k_compute=bk, head_dim=d, v_head_dim=dv,
            itemsize=jnp.dtype(dtype).itemsize, segments=segments, masked=True,
        )  # fmt: skip
        assert (est.buffers, est.scratch) == _declared(call), kernel


def test_estimate_grows_with_the_blocks_and_the_sub_block():
    base: dict = dict(head_dim=128, v_head_dim=128, itemsize=2, segments=True, masked=True)
    for kernel in _vmem.KERNELS:
        est = lambda bq, bk, bc, kernel=kernel: _vmem.vmem_estimate(  # noqa: E731
            kernel, block_q=bq, block_k=bk, block_k_compute=bc, **base
        )
        assert est(512, 1024, 256).temporaries < est(512, 1024, 512).temporaries
        assert est(512, 1024, 512).buffers == est(512, 1024, 256).buffers
        assert est(512, 512, 512).total < est(512, 1024, 512).total < est(1024, 1024, 512).total
        # Hand count, forward, 512 x 512, bf16, d=128, segments, one 512 sub-block.
    fwd = _vmem.vmem_estimate("forward", block_q=512, block_k=512, block_k_compute=512, **base)
    blocks = 3 * 512 * 128 * 2 + 2 * 512 * 128 * 4 + 2 * 8 * 512 * 4 + 512 * 128 * 2 + 8 * 512 * 4
    assert fwd.buffers == 2 * blocks
    assert fwd.scratch == 2 * 512 * 128 * 4 + 512 * 128 * 4
    assert fwd.temporaries == 6 * 512 * 512 * 4 + 512 * 256 * 2 + 2 * 512 * 128 * 4


@pytest.mark.parametrize("kind", sorted(DEFAULT_BLOCK_SIZES))
def test_default_blocks_fit_every_generation_with_headroom(kind):
    """At each generation's default blocks, every head dim up to 256 (and MLA's 192/128),
    both dtypes, with segment ids: the chosen key sub-block keeps all three kernels within
    3/4 of the generation's budget."""
    budget = _vmem.vmem_budget(kind)
    bq, bk = DEFAULT_BLOCK_SIZES[kind]
    chosen = set()
    for d, dv in ((64, 64), (128, 128), (192, 128), (256, 256)):
        for dtype in (jnp.float32, jnp.bfloat16):
            q = jax.ShapeDtypeStruct((1, 8 * bk, 1, d), dtype)
            seg = jax.ShapeDtypeStruct((1, 8 * bk), jnp.int32)
            cfg = make_config(q, q, seg, causal=True, window=None, scale=None,
                              block_q=bq, block_k=bk, interpret=True)  # fmt: skip
            it = jnp.dtype(dtype).itemsize
            bc = _vmem.key_sub_block(cfg, head_dim=d, v_head_dim=dv, itemsize=it, budget=budget)
            assert bk % bc == 0 and bc % 128 == 0
            for kernel in _vmem.KERNELS:
                est = _vmem.vmem_estimate(
                    kernel, block_q=bq, block_k=bk, block_k_compute=bc, head_dim=d,
                    v_head_dim=dv, itemsize=it, segments=True, masked=True,
                )  # fmt: skip
                assert est.total <= _vmem.VMEM_HEADROOM * budget, (kernel, d, dtype, bc)
            chosen.add(bc)
    # the whole key block where it fits; a smaller sub-block where it would not
    assert max(chosen) == bk or budget < 32 * MiB


def test_vmem_table_agrees_with_jax():
    """The fallback table holds the VMEM JAX's own chip info gives, where JAX has it."""
    for_chip = getattr(pltpu, "get_tpu_info_for_chip", None)
    if for_chip is None:
        pytest.skip("this JAX has no pltpu.get_tpu_info_for_chip")
    versions = {"TPU v4": "v4", "TPU v4 lite": "v4i", "TPU v5 lite": "v5e", "TPU v5e": "v5e",
                "TPU v5": "v5p", "TPU v5p": "v5p", "TPU v6 lite": "v6e", "TPU v6e": "v6e",
                "TPU7x": "7x"}  # fmt: skip
    assert set(versions) == set(_vmem.VMEM_CAPACITY)
    for kind, version in versions.items():
        info = for_chip(pltpu.ChipVersion(version), 1)
        assert _vmem.VMEM_CAPACITY[kind] == info.vmem_capacity_bytes, kind
    # this host is not a TPU: size for the smallest generation
    assert _vmem.vmem_capacity() == 16 * MiB and _vmem.vmem_budget() == 16 * MiB
    assert _vmem.vmem_budget("TPU v6 lite") == 32 * MiB


def _case(seed=0, b=2, s=512, hq=4, hk=2, d=64, dv=64, dtype=jnp.float32):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(ks[0], (b, s, hq, d), dtype)
    k = jax.random.normal(ks[1], (b, s, hk, d), dtype)
    v = jax.random.normal(ks[2], (b, s, hk, dv), dtype)
    seg = jnp.broadcast_to((jnp.arange(s) >= 300).astype(jnp.int32), (b, s))
    return q, k, v, seg


@pytest.mark.parametrize("sub, dv", [(128, 64), (None, 128)])
def test_key_sub_blocks_match_the_oracle(sub, dv, monkeypatch):
    """Key blocks of 512 walked in sub-blocks (128 asked for; or chosen under a budget cut
    so the whole block does not fit): out, lse and all gradients match the float32 oracle
    at the kernels' usual error levels, packed and causal, GQA, and MLA's wider v."""
    if sub is None:
        monkeypatch.setattr(_vmem, "vmem_budget", lambda kind=None: 7 * MiB)
    q, k, v, seg = _case(dv=dv)
    impl = PallasBlockImpl(128, 512, True, block_k_compute=sub)

    def loss(run):
        def f(q, k, v):
            out = run(q, k, v)
            return jnp.sum(out * jnp.cos(out)), out

        return jax.jit(jax.grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    ours = lambda q, k, v: flash_attention(  # noqa: E731
        q, k, v, causal=True, q_segment_ids=seg, kv_segment_ids=seg, impl=impl
    )[0]
    (g, out) = loss(ours)
    (g_ref, out_ref) = loss(lambda q, k, v: oracle(q, k, v, segment_ids=seg))
    np.testing.assert_allclose(out, out_ref, rtol=0, atol=2e-6)
    for got, want in zip(g, g_ref, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * float(jnp.max(jnp.abs(want))))
    cfg = make_config(q, k, seg, causal=True, window=None, scale=None, block_q=128,
                      block_k=512, interpret=True, block_k_compute=sub)  # fmt: skip
    chosen = _vmem.key_sub_block(cfg, head_dim=64, v_head_dim=dv, itemsize=4)
    assert chosen < 512  # the sub-block loop ran


def test_bad_sub_block_and_over_budget_raise(monkeypatch):
    q, k, v, seg = _case(s=256)
    pos = jnp.arange(256)[None].repeat(2, 0)
    run = lambda **kw: pallas_flash_forward(q, k, v, pos, pos, causal=True, interpret=True, **kw)  # noqa: E731
    for bad in (100, 384, 0):
        with pytest.raises(ValueError, match="block_k_compute must be a positive multiple"):
            run(block_q=128, block_k=512, block_k_compute=bad)
    monkeypatch.setattr(_vmem, "vmem_budget", lambda kind=None: MiB // 4)
    with pytest.raises(ValueError, match=r"need about .* MiB of VMEM .* budget is 0 MiB"):
        run(block_q=128, block_k=256)


def test_exported_kernels_ask_for_the_budget(monkeypatch):
    """Each Mosaic kernel of a TPU export carries the budget as its scoped VMEM size."""
    q = jax.ShapeDtypeStruct((1, 512, 2, 64), jnp.bfloat16)

    def sizes():
        def grads(q, k, v):  # a new function each time: no cached trace
            def loss(q, k, v):
                impl = PallasBlockImpl(128, 256)  # interpret=None: Mosaic lowered for TPU
                return flash_attention(q, k, v, causal=True, impl=impl)[0].sum()

            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

        exported = jax.export.export(jax.jit(grads), platforms=("tpu",))(q, q, q)
        return re.findall(r"memory_space\\22:1, \\22offset\\22: 0, \\22size\\22: (\d+)",
                          exported.mlir_module())  # fmt: skip

    assert sizes() == [str(16 * MiB)] * 3
    monkeypatch.setattr(_vmem, "vmem_budget", lambda kind=None: 24 * MiB)
    assert sizes() == [str(24 * MiB)] * 3
