"""The `ringattention` package (Ring Attention authors' pure-JAX ring) beside our ring, for
`context_parallel.py --sections d`: same shapes, same 8 fake devices, contiguous layout."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from eqx_longctx import ShardingSpec, attention


def _loss(fn):
    return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a)), argnums=(0, 1, 2)))


def ring_attention_package(q, k, v, calls: dict) -> float | None:
    """Add the Ring Attention authors' pure-JAX ring (`pip install ringattention flax`) to
    `calls`, on the same shapes and 8 fake devices, in the contiguous layout its causal mask
    assumes, beside our ring in that layout. Returns its max error against one device."""
    import types

    import jax.extend
    import jax.lib

    if not hasattr(jax.lib, "xla_bridge"):  # removed from JAX; the package still imports it
        backend = types.SimpleNamespace(get_backend=jax.extend.backend.get_backend)
        jax.lib.xla_bridge = backend  # pyright: ignore[reportAttributeAccessIssue]
    try:
        from ringattention import ringattention as their_ring
    except ImportError as e:
        print(f"ringattention is not installed ({e}): skipped (pip install ringattention flax).")
        return None
    mesh = jax.make_mesh((8,), ("context",))
    chunk = min(512, q.shape[1] // 8)
    blockwise = dict(
        causal_block_size=1, query_chunk_size=chunk, key_chunk_size=chunk, deterministic=True,
        dropout_rng=None, attn_pdrop=0.0, dtype=jnp.float32, precision=None, prevent_cse=True,
        policy=jax.checkpoint_policies.nothing_saveable,
    )  # fmt: skip
    pspec = PartitionSpec(None, "context", None, None)

    def theirs(q, k, v):
        def local(q, k, v):
            bias = jnp.zeros((q.shape[0], 1, 1, k.shape[1]), jnp.float32)
            return their_ring(q, k, v, bias, None, None, "context", True, blockwise)

        return jax.shard_map(
            local, mesh=mesh, in_specs=(pspec,) * 3, out_specs=pspec, check_vma=False
        )(q, k, v)

    contiguous = ShardingSpec(mesh, strategy="ring", load_balance="none")

    def ours_none(q, k, v):
        return attention(q, k, v, spec=contiguous)

    args = tuple(jax.device_put(x, NamedSharding(mesh, pspec)) for x in (q, k, v))
    calls[("theirs", "fwd")] = (jax.jit(theirs), args)
    calls[("theirs", "f+b")] = (_loss(theirs), args)
    calls[("ring none", "fwd")] = (jax.jit(ours_none), args)
    calls[("ring none", "f+b")] = (_loss(ours_none), args)
    return float(jnp.max(jnp.abs(jax.jit(theirs)(*args) - attention(q, k, v))))
