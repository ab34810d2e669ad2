"""Ring hops with the Pallas kernels move no K/V through a transpose: with head dims that
are multiples of 128 the kernels read K/V (and write dK/dV) in the model's own
`[batch, seq, heads * dim]` layout, the query side is laid out once per ring, and the dQ
kernel adds into its accumulator in place. Counted in the program lowered for a TPU from
this host (the kernels' bodies are Mosaic, so every transpose left is the wrapper's)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import need_devices

from eqx_longctx import ShardingSpec, attention, from_layout, to_layout
from eqx_longctx import reference_attention as oracle
from eqx_longctx.kernels import PallasBlockImpl

B, S, HQ, HK = 1, 2048, 8, 2


def _program(d, n=4, kv_heads=HK):
    mesh = jax.make_mesh((n,), ("context",), devices=jax.devices()[:n])
    spec = ShardingSpec(mesh=mesh, strategy="ring", load_balance="zigzag")

    def fwd(q, k, v):
        return attention(q, k, v, spec=spec, causal=True, impl="pallas")

    def grads(q, k, v):
        loss = lambda q, k, v: jnp.sum(fwd(q, k, v).astype(jnp.float32))  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    q = jax.ShapeDtypeStruct((B, S, HQ, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, S, kv_heads, d), jnp.bfloat16)
    export = lambda f: jax.export.export(jax.jit(f), platforms=("tpu",))(q, kv, kv)  # noqa: E731
    return export(fwd).mlir_module(), export(grads).mlir_module()


def _transposed(text) -> list[str]:
    """The operand types of every transpose in a StableHLO module."""
    return re.findall(r"stablehlo\.transpose.*?: \((tensor<[^>]*>)\)", text)


@pytest.mark.parametrize("n", [4, 8])
def test_ring_moves_no_kv_through_a_transpose(n):
    need_devices(n)
    shard = S // n
    fwd, grad = _program(128, n)
    kv_like = re.compile(rf"tensor<1x(\d+x)?{HK}x{shard}x128|tensor<1x{shard}x{HK}x128")
    for text in (fwd, grad):
        assert text.count("tpu_custom_call") > 0
        assert not [t for t in _transposed(text) if kv_like.search(t)]
    # Left, once per ring: the queries in and the output out (forward); in the gradient the
    # forward's queries in, output and lse out, the backward's queries, dout, lse and delta
    # in and dq out (and the small int [nq, nk] block tables, not counted).
    big = lambda text: [t for t in _transposed(text) if "xi32>" not in t]  # noqa: E731
    assert len(big(fwd)) == 2
    assert len(big(grad)) == 8
    # The dQ kernel writes over its accumulator (one aliased operand per dQ call).
    calls = [line for line in grad.splitlines() if "tpu_custom_call" in line]
    aliased = [line for line in calls if "output_operand_aliases" in line]
    assert len(calls) == 8 and len(aliased) == 3  # fwd x2; dq, dk/dv x3 (own, scan, last)


def test_narrow_heads_still_transpose_kv_unless_one():
    """Head dim 64 cannot be a 128-lane column block: K/V go heads-major per hop, except
    with one K/V head (MQA), whose 64 lanes are the whole minor dim."""
    need_devices(4)
    for kv_heads, transposed in ((HK, True), (1, False)):
        fwd, _ = _program(64, kv_heads=kv_heads)
        kv_like = re.compile(rf"tensor<1x{S // 4}x{kv_heads}x64")
        assert bool([t for t in _transposed(fwd) if kv_like.search(t)]) == transposed


@pytest.mark.parametrize("d, kv_heads", [(128, 2), (64, 1)])
def test_ring_with_pallas_matches_the_oracle(d, kv_heads):
    """What runs here (interpret mode), flat K/V (128-wide heads, one 64-wide head): out and
    gradients. (Heads-major K/V under a ring: `tests/test_impls.py`.)"""
    need_devices(4)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("context",))  # Auto axes
    spec = ShardingSpec(mesh=mesh, strategy="ring", load_balance="zigzag")
    ks = jax.random.split(jax.random.PRNGKey(d), 4)
    s = 512  # 128 tokens a device
    q = jax.random.normal(ks[0], (1, s, 4, d))
    k, v = (jax.random.normal(kk, (1, s, kv_heads, d)) for kk in ks[1:3])
    w = jax.random.normal(ks[3], (1, s, 4, d))
    impl = PallasBlockImpl(128, 128, True)

    def loss(run):
        def f(*a):
            out = run(*a)
            return jnp.sum(out * w), out

        return jax.jit(jax.grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)[::-1]

    def ring(q, k, v):  # natural token order in and out, the spec's zig-zag inside
        lay = lambda x: to_layout(x, spec)  # noqa: E731
        return from_layout(attention(lay(q), lay(k), lay(v), spec=spec, causal=True, impl=impl),
                           spec)  # fmt: skip

    got = loss(ring)
    want = loss(lambda q, k, v: oracle(q, k, v))
    np.testing.assert_allclose(got[0], want[0], rtol=0, atol=2e-6)
    for g, r in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(g, r, rtol=0, atol=2e-5 * float(jnp.max(jnp.abs(r))))
