"""MLA-style latent attention: K/V up-projected from a per-token latent, context-parallel.

The strategies move the latent (all-gather, ring) instead of per-head K/V. Checked forward
and backward (queries, latent and the up-projection's weights) against the oracle run on
the up-projected K/V, and the compiled communication is counted. Under a tensor axis the
heads split over it (the up-projection's weights by their logical axes, the latent whole).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, random_segment_ids
from jaxtyping import Array, Float

import eqx_longctx as el
from eqx_longctx import collective_bytes
from eqx_longctx._hlo import collectives
from eqx_longctx.nn import MultiHeadLatentAttention, RoPE

B, S, H, RANK, NOPE, ROPE, DV = 4, 64, 8, 16, 8, 4, 12


class UpProject(eqx.Module):
    """DeepSeek-style: per-head no-RoPE keys and values from the latent; RoPE key shared."""

    w_k: Float[Array, "kv_lora_rank heads head_dim"]  # logical axes: heads split over tensor
    w_v: Float[Array, "kv_lora_rank heads v_head_dim"]

    def __call__(self, latent):
        c, k_rope = latent
        k_nope = jnp.einsum("bsr,rhd->bshd", c, self.w_k)
        v = jnp.einsum("bsr,rhd->bshd", c, self.w_v)
        k_rope = jnp.broadcast_to(k_rope[:, :, None], (*k_nope.shape[:3], ROPE))
        return jnp.concatenate([k_nope, k_rope], axis=-1), v


def _inputs(seed=0, heads=H):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    up = UpProject(
        jax.random.normal(ks[0], (RANK, heads, NOPE)) / np.sqrt(RANK),
        jax.random.normal(ks[1], (RANK, heads, DV)) / np.sqrt(RANK),
    )
    q = jax.random.normal(ks[2], (B, S, heads, NOPE + ROPE))
    latent = (jax.random.normal(ks[3], (B, S, RANK)), jax.random.normal(ks[4], (B, S, ROPE)))
    seg = random_segment_ids(ks[5], B, S)
    return q, latent, up, seg


SPECS = [
    ("all_gather", (2, 4), ("data", "context"), None, "zigzag"),
    ("ring", (1, 8), ("data", "context"), None, "zigzag"),
    ("ring", (2, 4), ("data", "context"), None, "striped"),
    ("ulysses", (1, 8), ("data", "context"), None, "zigzag"),
    ("usp", (2, 4), ("ulysses", "context"), "ulysses", "none"),
    # A tensor axis splits the heads (8 -> 4 per shard), and Ulysses splits them again.
    ("ring", (2, 4), ("tensor", "context"), None, "zigzag"),
    ("all_gather", (2, 2, 2), ("data", "tensor", "context"), None, "striped"),
    ("ulysses", (2, 4), ("tensor", "context"), None, "zigzag"),
    ("usp", (2, 2, 2), ("tensor", "ulysses", "context"), "ulysses", "zigzag"),
]


# Pairwise in packing, not SPECS x (unpacked, packed): each spec runs one of the two, so
# that every strategy, layout and tensor-or-not meets both (usp/none twice: the only
# contiguous layout); 8 fewer cases, ~35 s of one core.
PACKED = [True, False, True, False, True, True, False, True, False]
CASES = [(*s, p) for s, p in zip(SPECS, PACKED, strict=True)] + [(*SPECS[4], False)]


def _case_id(case) -> str:
    strategy, shape, names, _, layout, packed = case
    mesh = "x".join(f"{n}{d}" for n, d in zip(names, shape, strict=True))
    return f"{strategy}-{mesh}-{layout}-{'packed' if packed else 'unpacked'}"


@pytest.mark.parametrize(
    "strategy,shape,names,ulysses,layout,packed", CASES, ids=[_case_id(c) for c in CASES]
)
def test_latent_attention_matches_oracle(strategy, shape, names, ulysses, layout, packed):
    _check_latent(strategy, shape, names, ulysses, layout, packed, "auto")


@pytest.mark.parametrize("strategy,shape,names,ulysses,layout", [SPECS[0], SPECS[1]])
def test_latent_attention_on_the_pallas_kernels(strategy, shape, names, ulysses, layout):
    _check_latent(strategy, shape, names, ulysses, layout, True, "pallas")


def _check_latent(strategy, shape, names, ulysses, layout, packed, impl):
    q, latent, up, seg = _inputs()
    seg = seg if packed else None
    mesh = jax.make_mesh(shape, names)
    tensor = "tensor" if "tensor" in names else None
    spec = el.ShardingSpec(
        mesh, strategy, layout, ulysses_axis=ulysses, tensor_axis=tensor, impl=impl
    )
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
@pytest.mark.parametrize("tensor", [1, 2])
def test_only_the_latent_crosses_the_wire(strategy, tensor):
    """Forward collective bytes: latent + RoPE key per token, vs per-head K/V. Under a
    tensor axis the up-projection's weights stay split over heads (nothing gathers them) and
    each tensor shard moves the whole latent around its own ring."""
    q, latent, up, _ = _inputs()
    n = 8 // tensor
    mesh = jax.make_mesh((tensor, n), ("tensor", "context"))
    spec = el.ShardingSpec(mesh, strategy, "zigzag", tensor_axis="tensor")
    k, v = up(latent)
    latent_fn = jax.jit(lambda q, lat: el.latent_attention(q, lat, up, spec=spec))
    dense_fn = jax.jit(lambda q, k, v: el.attention(q, k, v, spec=spec))
    lat_bytes = sum(collective_bytes(latent_fn.lower(q, latent).compile()).values())
    dense_bytes = sum(collective_bytes(dense_fn.lower(q, k, v).compile()).values())
    positions = 4  # positions (int32) travel with every shard
    per_token_latent = (RANK + ROPE) * 4 + positions
    per_token_dense = H // tensor * (NOPE + ROPE + DV) * 4 + positions
    expected = B * S * (n - 1) / n
    assert lat_bytes == pytest.approx(expected * per_token_latent, rel=0.01)
    assert dense_bytes == pytest.approx(expected * per_token_dense, rel=0.01)


def _tensor_spec(strategy="ring", tensor=2):
    mesh = jax.make_mesh((tensor, 8 // tensor), ("tensor", "context"))
    return el.ShardingSpec(mesh, strategy, tensor_axis="tensor")


def test_heads_must_divide_over_the_tensor_axis():
    q, latent, up, _ = _inputs(heads=6)
    with pytest.raises(
        ValueError,
        match=r"tensor_axis 'tensor' has 4 devices and shards the heads, so q_heads and "
        r"kv_heads must be divisible by 4; got q_heads=6, kv_heads=6\. Use a smaller tensor",
    ):
        el.latent_attention(q, latent, up, spec=_tensor_spec(tensor=4))
    # Ulysses splits each tensor shard's heads again: 4 heads / tensor 2 = 2, not over 4.
    q, latent, up, _ = _inputs(heads=4)
    with pytest.raises(
        ValueError,
        match=r"strategy='ulysses' over axis 'context' \(size 4\) needs num_heads divisible by "
        r"4, got 2 \(q_heads=4 over tensor axis of size 2\)",
    ):
        el.latent_attention(q, latent, up, spec=_tensor_spec("ulysses"))


class _Unnamed(eqx.Module):
    w_k: jax.Array
    w_v: jax.Array

    def __call__(self, latent):
        return UpProject(self.w_k, self.w_v)(latent)


def test_up_projection_needs_logical_axes_under_a_tensor_axis():
    q, latent, up, _ = _inputs()
    spec = _tensor_spec()
    with pytest.raises(ValueError, match=r"tensor_axis='tensor' \(2 devices\) splits the up-proj.*"
                       r"_Unnamed\.w_k .*declares no logical axes"):  # fmt: skip
        el.latent_attention(q, latent, _Unnamed(up.w_k, up.w_v), spec=spec)
    with pytest.raises(ValueError, match=r"runs each device's 4 of the 8 K/V heads, but "
                       r"up_project.* makes 8\. Make up_project an Equinox module"):  # fmt: skip
        el.latent_attention(q, latent, lambda lat: up(lat), spec=spec)


def test_mla_layer_under_tensor_moves_the_latent_and_reduces_once():
    """The MLA layer on tensor=2 x context=4, forward: the ring moves the latent, the RoPE
    key and positions together (3 hops); the row-parallel output projection ends in one all-reduce
    over the 2 tensor shards; nothing gathers a weight or per-head K/V."""
    spec = _tensor_spec()
    dim, batch, seq = 32, 2, 64
    layer = el.init_sharded(
        lambda: MultiHeadLatentAttention(
            dim, H, kv_lora_rank=RANK, q_lora_rank=24, qk_nope_head_dim=NOPE,
            qk_rope_head_dim=ROPE, v_head_dim=DV, rope=RoPE(ROPE, 10000.0, interleaved=True),
            key=jax.random.key(0), spec=spec,
        ),
        spec,
    )  # fmt: skip
    x = jax.device_put(jnp.ones((batch, seq, dim)), spec.sharding(spec.activation_pspec()))
    pos = el.to_layout(np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq)), spec)
    pos = jax.device_put(pos, spec.sharding(spec.token_pspec()))
    fn = spec.auto_axes(lambda m, x, p: m(x, p), spec.activation_pspec())
    found = collectives(jax.jit(fn).lower(layer, x, pos).compile())
    tokens = batch * seq // 4  # per device
    hops = sorted((c.op, c.result_bytes, c.count, c.group) for c in found)
    assert hops == sorted([
        # the latent, the shared RoPE key and the positions, one array (`_pack.together`)
        ("collective-permute", tokens * (RANK + ROPE + 1) * 4, 3, 8),
        ("all-reduce", tokens * dim * 4, 1, 2),  # wo over the tensor axis
    ]), found  # fmt: skip
