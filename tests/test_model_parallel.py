"""The Llama model gives the same logits and gradients under every strategy and layout."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, packed_rows
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import eqx_longctx as el
from eqx_longctx.data import Batch, place_batch
from models.llama import PRESETS, Llama

CONFIG = dataclasses.replace(
    PRESETS["tiny"], dim=64, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=8, hidden_dim=96
)
# (strategy, mesh shape, axis names, ulysses axis)
MESHES = [
    ("all_gather", (2, 4), ("data", "context"), None),
    ("ring", (2, 4), ("data", "context"), None),
    ("ring", (1, 8), ("data", "context"), None),
    ("ulysses", (1, 8), ("data", "context"), None),
    ("usp", (2, 4), ("ulysses", "context"), "ulysses"),
]


@pytest.fixture(scope="module")
def packed():
    return packed_rows(CONFIG.vocab_size)


def _loss(model, tokens, pos, seg):
    logits = model(tokens, pos, seg)
    return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])


# Every strategy with zig-zag, and every layout on the ring (the attention table covers the
# rest of the product; here the point is the model around attention). The ring's zig-zag
# runs on 2x4 only: 1x8 has striped, and a second zig-zag ring (~15 s of one core) ran no
# path of the model's that those two do not.
CASES = [(*m, "zigzag") for m in MESHES if m is not MESHES[2]] + [
    (*MESHES[1], "none"),
    (*MESHES[2], "striped"),
]


@pytest.mark.parametrize("strategy,shape,names,ulysses,load_balance", CASES)
def test_same_logits_and_grads_as_one_device(packed, strategy, shape, names, ulysses, load_balance):
    tokens, pos, seg = packed
    model = Llama(CONFIG, key=jax.random.PRNGKey(0))
    ref_logits = model(tokens, pos, seg)
    ref_grads = eqx.filter_grad(_loss)(model, tokens, pos, seg)

    mesh = jax.make_mesh(shape, names)
    spec = el.ShardingSpec(mesh, strategy, load_balance, ulysses_axis=ulysses)
    sharded = Llama(CONFIG, key=jax.random.PRNGKey(0), spec=spec)
    lay = lambda x: el.to_layout(x, spec)  # noqa: E731
    logits = eqx.filter_jit(lambda m, t, p, s: m(t, p, s))(sharded, lay(tokens), lay(pos), lay(seg))
    assert_close(el.from_layout(logits, spec), ref_logits, what="logits")
    grads = eqx.filter_jit(eqx.filter_grad(_loss))(sharded, lay(tokens), lay(pos), lay(seg))
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        assert_close(a, b, factor=5, what="parameter gradient")


def test_default_positions_follow_the_layout():
    """Without explicit positions, each token's RoPE position is its original index."""
    tokens = np.random.default_rng(1).integers(0, CONFIG.vocab_size, (2, 32)).astype(np.int32)
    model = Llama(CONFIG, key=jax.random.PRNGKey(0))
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "context"))  # Auto axes
    spec = el.ShardingSpec(mesh, "ring", "zigzag")
    sharded = Llama(CONFIG, key=jax.random.PRNGKey(0), spec=spec)
    logits = jax.jit(lambda m, t: m(t))(sharded, el.to_layout(tokens, spec))
    assert_close(el.from_layout(logits, spec), model(tokens), what="logits")


def test_place_batch_lays_out_and_shards():
    mesh = jax.make_mesh((2, 4), ("data", "context"))
    spec = el.ShardingSpec(mesh, "ring", "striped")
    host = Batch(*(np.arange(2 * 16, dtype=np.int32).reshape(2, 16) + i for i in range(5)))
    batch = place_batch(host, spec)
    assert batch.tokens.sharding.spec == spec.token_pspec()
    np.testing.assert_array_equal(
        np.asarray(el.from_layout(np.asarray(batch.tokens), spec)), host.tokens
    )
    with pytest.raises(ValueError, match="divisible by 4"):
        place_batch(Batch(*(np.zeros((2, 10), np.int32) for _ in range(5))), spec)


# ---------------------------------------------------------------- DeepSeek on a tensor axis


def test_trainer_and_planner_accept_deepseek_on_a_tensor_axis():
    """`--model deepseek --mesh tensor=2,context=4`: the trainer's placement checks and
    builds it (MLA's per-head weights split over tensor, the latent projection whole), and
    the planner plans it with fewer parameter bytes per device than without the axis. The
    logits and gradients are checked in tests/test_partition.py."""
    from eqx_longctx.run import placement_from_flags

    deepseek = el.model_family("deepseek")
    config = deepseek.config.from_preset("tiny", vocab_size=259)
    placement = placement_from_flags(8, "tensor=2,context=4", vocab_size=config.vocab_size)
    placement.check_run(8, 64, config)
    model = placement.build_model(lambda spec: deepseek.model(config, key=jax.random.key(0),
                                                             spec=spec))  # fmt: skip
    attn = model.moe_layers.layers.attn
    for weight, pspec in (
        (attn.wq_b, P(None, None, "tensor", None)),
        (attn.wkv_b, P(None, None, "tensor", None)),
        (attn.wo, P(None, "tensor", None, None)),
        (attn.wq_a, P()),
        (attn.wkv_a, P()),
    ):
        assert weight.sharding.is_equivalent_to(NamedSharding(placement.mesh, pspec), weight.ndim)

    config = deepseek.config.from_preset("tiny", vocab_size=256, max_seq_len=8192)
    params = {}
    for mesh in ({"tensor": 2, "context": 4}, {"data": 2, "context": 4}):
        devices = np.array(jax.devices()).reshape(tuple(mesh.values()))
        spec = el.ShardingSpec(Mesh(devices, tuple(mesh)), "ring",
                               tensor_axis="tensor" if "tensor" in mesh else None)  # fmt: skip
        plan = el.plan_train_step("deepseek", config, spec, batch=2, seq=8192, remats=("full",))
        row = plan.row("ring", "full")
        assert all(np.isfinite(v) and v >= 0 for v in row.breakdown().values()), row
        params[tuple(mesh)] = row.breakdown()["params"]
    assert params[("tensor", "context")] < 0.75 * params[("data", "context")], params
