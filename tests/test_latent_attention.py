"""MLA-style latent attention: K/V up-projected from a per-token latent, context-parallel.

The strategies move the latent (all-gather, ring) instead of per-head K/V. Checked forward
and backward (queries, latent and the up-projection's weights) against the oracle run on
the up-projected K/V, and the compiled communication is counted.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, random_segment_ids

import eqx_longctx as el
from eqx_longctx import collective_bytes

B, S, H, RANK, NOPE, ROPE, DV = 4, 64, 8, 16, 8, 4, 12


class UpProject(eqx.Module):
    """DeepSeek-style: per-head no-RoPE keys and values from the latent; RoPE key shared."""

    w_k: jax.Array
    w_v: jax.Array

    def __call__(self, latent):
        c, k_rope = latent
        k_nope = jnp.einsum("bsr,rhd->bshd", c, self.w_k)
        v = jnp.einsum("bsr,rhd->bshd", c, self.w_v)
        k_rope = jnp.broadcast_to(k_rope[:, :, None], (*k_rope.shape[:2], H, ROPE))
        return jnp.concatenate([k_nope, k_rope], axis=-1), v


def _inputs(seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    up = UpProject(
        jax.random.normal(ks[0], (RANK, H, NOPE)) / np.sqrt(RANK),
        jax.random.normal(ks[1], (RANK, H, DV)) / np.sqrt(RANK),
    )
    q = jax.random.normal(ks[2], (B, S, H, NOPE + ROPE))
    latent = (jax.random.normal(ks[3], (B, S, RANK)), jax.random.normal(ks[4], (B, S, ROPE)))
    seg = random_segment_ids(ks[5], B, S)
    return q, latent, up, seg


SPECS = [
    ("all_gather", (2, 4), ("data", "context"), None, "zigzag"),
    ("ring", (1, 8), ("data", "context"), None, "zigzag"),
    ("ring", (2, 4), ("data", "context"), None, "striped"),
    ("ulysses", (1, 8), ("data", "context"), None, "zigzag"),
    ("usp", (2, 4), ("ulysses", "context"), "ulysses", "none"),
]


@pytest.mark.parametrize("strategy,shape,names,ulysses,layout", SPECS)
@pytest.mark.parametrize("packed", [False, True])
def test_latent_attention_matches_oracle(strategy, shape, names, ulysses, layout, packed):
    _check_latent(strategy, shape, names, ulysses, layout, packed, "auto")


@pytest.mark.parametrize("strategy,shape,names,ulysses,layout", [SPECS[0], SPECS[1]])
def test_latent_attention_on_the_pallas_kernels(strategy, shape, names, ulysses, layout):
    _check_latent(strategy, shape, names, ulysses, layout, True, "pallas")


def _check_latent(strategy, shape, names, ulysses, layout, packed, impl):
    q, latent, up, seg = _inputs()
    seg = seg if packed else None
    mesh = jax.make_mesh(shape, names)
    spec = el.ShardingSpec(mesh, strategy, layout, ulysses_axis=ulysses, impl=impl)
    to, back = (lambda x: el.to_layout(x, spec)), (lambda x: el.from_layout(x, spec))
    ct = jax.random.normal(jax.random.PRNGKey(9), (B, S, H, DV))

    def ours(q, latent, up):
        lat = jax.tree.map(to, latent)
        out = el.latent_attention(
            to(q), lat, up, spec=spec, segment_ids=None if seg is None else to(seg)
        )
        return jnp.sum(back(out) * ct), back(out)

    def oracle(q, latent, up):
        k, v = up(latent)
        out = el.reference_attention(q, k, v, segment_ids=seg)
        return jnp.sum(out * ct), out

    (_, out), grads = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2), has_aux=True))(
        q, latent, up
    )
    (_, ref), ref_grads = jax.value_and_grad(oracle, argnums=(0, 1, 2), has_aux=True)(q, latent, up)
    assert_close(out, ref, what="forward")
    names_ = ["dq", "dc_kv", "dk_rope", "dw_k", "dw_v"]
    for name, a, b in zip(names_, jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        assert_close(a, b, what=name)


def test_single_device_latent_attention():
    q, latent, up, seg = _inputs(1)
    k, v = up(latent)
    out = el.latent_attention(q, latent, up, segment_ids=seg)
    assert_close(out, el.reference_attention(q, k, v, segment_ids=seg), what="forward")


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_only_the_latent_crosses_the_wire(strategy):
    """Forward collective bytes: latent + RoPE key per token, vs per-head K/V."""
    q, latent, up, _ = _inputs()
    spec = el.ShardingSpec(jax.make_mesh((1, 8), ("data", "context")), strategy, "zigzag")
    k, v = up(latent)
    latent_fn = jax.jit(lambda q, lat: el.latent_attention(q, lat, up, spec=spec))
    dense_fn = jax.jit(lambda q, k, v: el.attention(q, k, v, spec=spec))
    lat_bytes = sum(collective_bytes(latent_fn.lower(q, latent).compile()).values())
    dense_bytes = sum(collective_bytes(dense_fn.lower(q, k, v).compile()).values())
    n, positions = 8, 4  # positions (int32) travel with every shard
    per_token_latent = (RANK + ROPE) * 4 + positions
    per_token_dense = H * (NOPE + ROPE + DV) * 4 + positions
    expected = B * S * (n - 1) / n
    assert lat_bytes == pytest.approx(expected * per_token_latent, rel=0.01)
    assert dense_bytes == pytest.approx(expected * per_token_dense, rel=0.01)


def test_tensor_axis_is_refused():
    q, latent, up, _ = _inputs()
    mesh = jax.make_mesh((2, 2, 2), ("data", "context", "tensor"))
    spec = el.ShardingSpec(mesh, "ring", tensor_axis="tensor")
    with pytest.raises(ValueError, match="cannot shard heads over tensor_axis='tensor'"):
        el.latent_attention(q, latent, up, spec=spec)
