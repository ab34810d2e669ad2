"""Expert parallelism: MoE routed experts split over `spec.expert_axis`, each token copy sent
to its expert's device by all-to-all and back. Everything is checked, forward and backward,
against the same layer (or model) with `spec=None`."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, make_mesh, pairwise_cover
from jax.sharding import NamedSharding, PartitionSpec

import eqx_longctx as el
from eqx_longctx._hlo import collectives
from eqx_longctx.nn import MoE
from models.deepseek import DeepSeek, DeepSeekConfig

DIM, HIDDEN, N_EXPERTS, TOP_K = 16, 8, 8, 2
ROUTING = {
    "greedy": dict(topk_method="greedy"),
    "group_limited_greedy": dict(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                 routed_scaling_factor=4.0),
    "noaux_tc": dict(topk_method="noaux_tc", n_group=2, topk_group=1, norm_topk_prob=True,
                     routed_scaling_factor=2.5),
}  # fmt: skip
# (shape, names): every mesh has a context axis; the batch is split over the axes before
# it, and a tensor axis holds the same tokens on each of its devices.
MESHES = {
    "expert2-context4": ((2, 4), ("expert", "context")),
    "expert4-context2": ((4, 2), ("expert", "context")),
    "data2-expert2-context2": ((2, 2, 2), ("data", "expert", "context")),
    "expert8": ((8, 1), ("expert", "context")),
    "expert2-context2-tensor2": ((2, 2, 2), ("expert", "context", "tensor")),
}
CASES = pairwise_cover(
    {
        "routing": list(ROUTING),
        "mesh": list(MESHES),
        "shared": [0, 1],
        "grouped_matmul": ["scan", "ragged_dot"],
    }
)


def ep_spec(mesh_name: str, axes: str = "explicit", **kw) -> el.ShardingSpec:
    shape, names = MESHES[mesh_name]
    tensor = "tensor" if "tensor" in names else None
    return el.ShardingSpec(make_mesh(shape, names, axes), "ring", "none", expert_axis="expert",
                           tensor_axis=tensor, **kw)  # fmt: skip


def make_moe(routing: str, spec=None, bias_scale: float = 0.1, **kw) -> MoE:
    """The same weights whatever the spec; a random selection bias for `noaux_tc`."""
    moe = MoE(DIM, HIDDEN, N_EXPERTS, TOP_K, key=jax.random.key(0), init_std=0.3, spec=spec,
              **ROUTING[routing], **kw)  # fmt: skip
    if moe.score_bias is not None:
        bias = bias_scale * jax.random.normal(jax.random.key(1), (N_EXPERTS,))
        moe = eqx.tree_at(lambda m: m.score_bias, moe, bias)
    return moe


def _loss_and_out(moe, x, cotangent):
    out = moe(x)
    return jnp.sum(out * cotangent), out


value_and_grads = jax.jit(jax.value_and_grad(_loss_and_out, argnums=(0, 1), has_aux=True))


def check_same(moe, ref, x, what: str):
    """Forward, and gradients w.r.t. every weight and the input, equal the reference's."""
    cotangent = jax.random.normal(jax.random.key(3), x.shape)
    (_, out), grads = value_and_grads(moe, x, cotangent)
    (_, ref_out), ref_grads = value_and_grads(ref, x, cotangent)
    assert_close(out, ref_out, what=f"{what}: output")
    flat, ref_flat = jax.tree.leaves(grads), jax.tree.leaves(ref_grads)
    assert len(flat) == len(ref_flat)
    for g, r in zip(flat, ref_flat, strict=True):
        if float(jnp.max(jnp.abs(r))) == 0:  # the selection bias has no gradient
            assert float(jnp.max(jnp.abs(g))) == 0, f"{what}: gradient should be zero"
        else:
            assert_close(g, r, factor=5, what=f"{what}: gradient {r.shape}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_moe_matches_replicated(case):
    kw = dict(n_shared=case["shared"], grouped_matmul=case["grouped_matmul"])
    spec = ep_spec(case["mesh"])
    x = jax.random.normal(jax.random.key(2), (spec.batch_parallel_size * 2, 8, DIM))
    check_same(make_moe(case["routing"], spec, **kw), make_moe(case["routing"], **kw), x,
               str(case))  # fmt: skip


@pytest.mark.parametrize("grouped_matmul", ["scan", "ragged_dot"])
def test_every_copy_to_one_device(grouped_matmul):
    """The worst case the dropless buffers are sized for: a selection bias sends every token
    copy of every device to experts 0 and 1, both on device 0 of the expert axis."""
    spec = ep_spec("expert4-context2")
    bias = jnp.zeros(N_EXPERTS).at[:2].set(100.0)
    moe, ref = (
        eqx.tree_at(lambda m: m.score_bias, make_moe("noaux_tc", s, grouped_matmul=grouped_matmul),
                    bias)
        for s in (spec, None)
    )  # fmt: skip
    x = jax.random.normal(jax.random.key(2), (4, 8, DIM))
    indices, _ = ref.route(x.reshape(-1, DIM))
    assert set(np.unique(indices).tolist()) == {0, 1}
    check_same(moe, ref, x, "every copy to device 0")


def _dense_routed(moe: MoE, tokens, keep):
    """Every expert on every token, summed with the routing weights of the kept copies."""
    indices, weights = moe.route(tokens)
    weights = jnp.where(keep, weights, 0.0)
    gates = jnp.zeros((tokens.shape[0], N_EXPERTS)).at[
        jnp.arange(tokens.shape[0])[:, None], indices].add(weights)  # fmt: skip
    h = jax.nn.silu(jnp.einsum("te,xef->txf", tokens, moe.w_gate))
    h = h * jnp.einsum("te,xef->txf", tokens, moe.w_up)
    return jnp.einsum("txf,xfe,tx->te", h, moe.w_down, gates)


@pytest.mark.parametrize("capacity_factor", [1.0, 2.0, 8.0])
def test_capacity_factor_drops_what_it_documents(capacity_factor):
    """Each device sends at most `ceil(capacity_factor * tokens * top_k / D)` copies to each
    device; beyond that, the copies of the higher experts, then of the later tokens, are
    dropped. A factor of `D` (8 here) drops nothing."""
    spec = ep_spec("expert8")
    moe = make_moe("noaux_tc", spec, bias_scale=1.0, capacity_factor=capacity_factor)
    ref = make_moe("noaux_tc", bias_scale=1.0)
    x = jax.random.normal(jax.random.key(2), (8, 16, DIM))
    out = jax.jit(lambda m, x: m(x))(moe, x)
    n_dev, local = 8, N_EXPERTS // 8
    expected, dropped = [], 0
    for row in np.asarray(x):  # device i holds batch row i
        indices, _ = ref.route(jnp.asarray(row))
        rows = np.asarray(indices).reshape(-1)
        order = np.argsort(rows, kind="stable")
        dest = rows[order] // local
        rank_sorted = np.arange(rows.size) - np.searchsorted(dest, dest)
        room = math.ceil(capacity_factor * rows.size / n_dev)
        keep = np.empty(rows.size, bool)
        keep[order] = rank_sorted < room
        dropped += int((~keep).sum())
        expected.append(_dense_routed(ref, jnp.asarray(row), keep.reshape(indices.shape)))
    assert (dropped > 0) == (capacity_factor < n_dev)
    assert_close(out, jnp.stack(expected), factor=5, what=f"capacity_factor={capacity_factor}")


# ---------------------------------------------------------------- compiled communication


def _expert_weight_shapes(moe: MoE) -> set[str]:
    return {f"f32[{','.join(map(str, w.shape))}]" for w in (moe.w_gate, moe.w_down)}


@pytest.mark.parametrize("fsdp", [False, True])
def test_tokens_travel_by_all_to_all_and_weights_stay(fsdp):
    """Forward: three all-to-alls over the expert axis (rows, their experts, results back);
    backward two more. No collective ever carries every expert's weights: with the weights
    stored split over (expert, fsdp), only the fsdp part is gathered."""
    names = ("fsdp", "expert", "context") if fsdp else ("data", "expert", "context")
    spec = el.ShardingSpec(jax.make_mesh((2, 2, 2), names), "ring", "none", expert_axis="expert",
                           fsdp_axis="fsdp" if fsdp else ())  # fmt: skip
    moe = make_moe("noaux_tc", spec, n_shared=1, grouped_matmul="scan")
    stored = PartitionSpec("expert", "fsdp" if fsdp else None, None)
    moe = eqx.tree_at(
        lambda m: (m.w_gate, m.w_up, m.w_down), moe,
        tuple(jax.device_put(w, NamedSharding(spec.mesh, stored))
              for w in (moe.w_gate, moe.w_up, moe.w_down)),
    )  # fmt: skip
    x = jax.random.normal(jax.random.key(2), (8, 16, DIM))
    full = _expert_weight_shapes(moe)
    for what, fn, n_all_to_all in (
        ("forward", lambda m, x: m(x), 3),
        ("gradient", jax.grad(lambda m, x: jnp.sum(m(x) ** 2), argnums=(0, 1)), 5),
    ):
        text = jax.jit(fn).lower(moe, x).compile().as_text()
        assert text is not None
        found = collectives(text)
        a2a = [c for c in found if c.op == "all-to-all"]
        assert len(a2a) == n_all_to_all and all(c.group == 2 for c in a2a), (what, found)
        gathers = [c for c in found if c.op == "all-gather"]
        assert bool(gathers) == fsdp, (what, found)  # the fsdp part of the local experts
        for line in text.splitlines():
            if any(op in line for op in ("all-gather", "all-reduce", "reduce-scatter")):
                assert not any(shape in line for shape in full), (what, line)


# ---------------------------------------------------------------- the whole model

MODEL = DeepSeekConfig.from_preset("tiny", n_layers=2, max_seq_len=64)


@pytest.fixture(scope="module")
def model_batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, MODEL.vocab_size, (4, 32)).astype(np.int32)
    model = DeepSeek(MODEL, key=jax.random.key(0))
    loss = eqx.filter_jit(eqx.filter_value_and_grad(_model_loss, has_aux=True))
    (_, logits), grads = loss(model, tokens)
    return tokens, logits, grads


def _model_loss(model, tokens):
    logits = model(tokens)
    return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0]), logits


@pytest.mark.parametrize(
    "shape,names,axes",
    [
        ((2, 4), ("expert", "context"), "explicit"),
        ((2, 2, 2), ("data", "expert", "context"), "auto"),
        ((4, 2), ("expert", "context"), "auto"),
    ],
)
def test_deepseek_matches_replicated(model_batch, shape, names, axes):
    tokens, ref_logits, ref_grads = model_batch
    assert MODEL.n_routed_experts % shape[names.index("expert")] == 0
    spec = el.ShardingSpec(make_mesh(shape, names, axes), "ring", "zigzag", expert_axis="expert")
    model = DeepSeek(MODEL, key=jax.random.key(0), spec=spec)
    lay = lambda a: el.to_layout(a, spec)  # noqa: E731
    loss = eqx.filter_jit(eqx.filter_value_and_grad(_model_loss, has_aux=True))
    (_, logits), grads = loss(model, lay(tokens))
    assert_close(el.from_layout(logits, spec), ref_logits, factor=5, what="logits")
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        if float(jnp.max(jnp.abs(r))) == 0:
            assert float(jnp.max(jnp.abs(g))) == 0
        else:
            assert_close(g, r, factor=5, what=f"gradient {r.shape}")
    if axes == "explicit":  # the MoE layer's tokens travel by all-to-all (ring: no other)
        text = jax.jit(lambda m, t: m(t)).lower(model, lay(tokens)).compile().as_text()
        assert text is not None
        a2a = [c for c in collectives(text) if c.op == "all-to-all"]
        assert len(a2a) == 3 and all(c.group == 2 for c in a2a), a2a


# ---------------------------------------------------------------- errors


def test_experts_not_divisible_by_expert_axis_raises():
    spec = ep_spec("expert4-context2")
    with pytest.raises(ValueError, match=r"expert_axis 'expert' of size 4.*n_experts=6"):
        MoE(DIM, HIDDEN, 6, TOP_K, key=jax.random.key(0), spec=spec)
    with pytest.raises(ValueError, match=r"n_experts must be divisible by 4"):
        DeepSeek(DeepSeekConfig.from_preset("tiny", n_routed_experts=6, n_group=1),
                 key=jax.random.key(0), spec=spec)  # fmt: skip


@pytest.mark.parametrize("capacity_factor", [0.0, -1.0])
def test_bad_capacity_factor_raises(capacity_factor):
    with pytest.raises(ValueError, match=r"capacity_factor > 0.*got capacity_factor="):
        MoE(DIM, HIDDEN, N_EXPERTS, TOP_K, key=jax.random.key(0), capacity_factor=capacity_factor)


def test_batch_not_divisible_over_the_expert_axis_raises():
    moe = make_moe("greedy", ep_spec("expert4-context2"))
    with pytest.raises(ValueError, match=r"'expert' \(4\).*divisible by 4; got batch=2"):
        moe(jnp.zeros((2, 8, DIM)))
