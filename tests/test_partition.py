"""Weights sharded by the logical-axis rules table (FSDP, tensor): same numbers, 1/N bytes."""

import dataclasses
import math
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, packed_rows
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, Float

import eqx_longctx as el
from models.deepseek import PRESETS as DS_PRESETS
from models.deepseek import DeepSeek
from models.deepseek import from_hf as ds_from_hf
from models.deepseek import to_hf as ds_to_hf
from models.llama import PRESETS, Llama, from_hf, to_hf

CONFIG = dataclasses.replace(
    PRESETS["tiny"], vocab_size=256, dim=64, n_layers=3, n_heads=8, n_kv_heads=2, head_dim=8,
    hidden_dim=96,
)  # fmt: skip
P = PartitionSpec


def _mesh(shape, names, explicit=True):
    if explicit:
        return jax.make_mesh(shape, names)
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


@pytest.fixture(scope="module")
def packed():
    return packed_rows(CONFIG.vocab_size)


@pytest.fixture(scope="module")
def reference(packed):
    model = Llama(CONFIG, key=jax.random.key(0))
    return model, model(*packed), eqx.filter_grad(_loss)(model, *packed)


def _paths_and_shapes(tree):
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(jax.tree_util.keystr(p), leaf.shape, leaf.dtype) for p, leaf in leaves]


def _loss(model, tokens, pos, seg):
    logits = model(tokens, pos, seg)
    return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])


# (name, mesh shape, axis names, ShardingSpec keywords, explicit mesh)
PLANS = [
    ("fsdp", (2, 4), ("fsdp", "context"), dict(fsdp_axis="fsdp"), True),
    ("tensor", (4, 2), ("context", "tensor"), dict(tensor_axis="tensor"), True),
    ("data_fsdp_context", (2, 2, 2), ("data", "fsdp", "context"), dict(fsdp_axis="fsdp"), False),
    ("weights_over_context", (8,), ("context",), dict(fsdp_axis="context"), True),
    ("fsdp_and_context", (2, 4), ("fsdp", "context"), dict(fsdp_axis=("fsdp", "context")), False),
    ("fsdp_tensor", (2, 2, 2), ("fsdp", "context", "tensor"),
     dict(fsdp_axis="fsdp", tensor_axis="tensor"), True),
    ("usp_fsdp", (2, 2, 2), ("fsdp", "ulysses", "context"),
     dict(fsdp_axis=("fsdp", "ulysses"), ulysses_axis="ulysses", strategy="usp"), True),
]  # fmt: skip


@pytest.mark.parametrize("name,shape,names,kw,explicit", PLANS, ids=[p[0] for p in PLANS])
def test_sharded_weights_same_logits_and_grads(packed, reference, name, shape, names, kw, explicit):
    model, ref_logits, ref_grads = reference
    spec = el.ShardingSpec(_mesh(shape, names, explicit), **{"strategy": "ring", **kw})
    sharded = el.init_sharded(lambda: Llama(CONFIG, key=jax.random.key(0), spec=spec))
    # Same key, same parameters (bit for bit) and the same pytree, whatever the spec: only
    # placement differs. The reference is built under jit too: an eager build rounds the
    # init scale's product differently (1 ulp).
    ref_arrays = jax.jit(lambda: eqx.filter(Llama(CONFIG, key=jax.random.key(0)), eqx.is_array))()
    arrays = eqx.filter(sharded, eqx.is_array)
    assert _paths_and_shapes(arrays) == _paths_and_shapes(ref_arrays)
    for a, b in zip(jax.tree.leaves(arrays), jax.tree.leaves(ref_arrays), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for leaf, sharding in zip(
        jax.tree.leaves(arrays), jax.tree.leaves(el.param_shardings(sharded)), strict=True
    ):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
    lay = lambda x: el.to_layout(x, spec)  # noqa: E731
    inputs = tuple(lay(x) for x in packed)
    logits = eqx.filter_jit(lambda m, t, p, s: m(t, p, s))(sharded, *inputs)
    assert_close(el.from_layout(logits, spec), ref_logits, what="logits")
    grads = eqx.filter_jit(eqx.filter_grad(_loss))(sharded, *inputs)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        assert_close(a, b, factor=5, what="parameter gradient")


def test_device_zero_holds_one_nth_of_the_weights():
    mesh = _mesh((2, 4), ("fsdp", "context"))
    spec = el.ShardingSpec(mesh, fsdp_axis=("fsdp", "context"))
    model = el.init_sharded(lambda: Llama(CONFIG, key=jax.random.key(0), spec=spec))
    leaves = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    total = sum(x.nbytes for x in leaves)
    on_device0 = sum(x.addressable_shards[0].data.nbytes for x in leaves)
    assert on_device0 == el.param_bytes_per_device(model)
    assert abs(on_device0 / (total / 8) - 1) < 0.05, (on_device0, total)
    # A long-context run with a batch of 1 shards its weights over the context axis itself.
    el.ShardingSpec(_mesh((8,), ("context",)), fsdp_axis="context").check_batch(1)


def test_each_layer_is_gathered_inside_the_scan():
    """FSDP gathers one layer at a time: no all-gather produces the whole stack."""
    mesh = _mesh((2, 4), ("fsdp", "context"), explicit=False)
    spec = el.ShardingSpec(mesh, fsdp_axis="fsdp")
    model = el.init_sharded(lambda: Llama(CONFIG, key=jax.random.key(0), spec=spec))
    tokens = jax.device_put(np.zeros((2, 64), np.int32), spec.sharding(spec.token_pspec()))
    params, static = eqx.partition(model, eqx.is_array)
    step = jax.jit(jax.grad(lambda p, t: _loss(eqx.combine(p, static), t, None, None)))
    text = step.lower(params, tokens).compile().as_text()
    gathers = re.findall(r"= (f32\[[\d,]*\])[^ ]* all-gather", text)
    assert gathers, "FSDP weights are never gathered"
    stacked = [g for g in gathers if g.startswith(f"f32[{CONFIG.n_layers},")]
    assert not stacked, f"whole-stack all-gathers: {stacked}"


def test_logical_axes_come_from_the_annotations():
    model = eqx.filter_eval_shape(Llama, CONFIG, key=jax.random.key(0))
    axes = el.logical_axes(model)
    assert axes.embed == P("vocab", "embed")
    assert axes.layers.layers.attn.wq == P("layers", "embed", "q_heads", "head_dim")
    assert axes.layers.layers.mlp.w_down == P("layers", "hidden", "embed")
    assert axes.norm.weight == P("dim")
    mesh = _mesh((2, 2, 2), ("fsdp", "context", "tensor"))
    spec = el.ShardingSpec(mesh, fsdp_axis="fsdp", tensor_axis="tensor")
    pspecs = el.param_pspecs(model, spec)
    assert pspecs.layers.layers.attn.wq == P(None, "fsdp", "tensor", None)  # column-parallel
    assert pspecs.layers.layers.attn.wo == P(None, "tensor", None, "fsdp")  # row-parallel
    assert pspecs.embed == P("tensor", "fsdp")
    assert pspecs.lm_head == P("fsdp", "tensor")
    gathered = el.param_pspecs(model, spec, gathered=True)
    assert gathered.layers.layers.mlp.w_gate == P(None, None, "tensor")
    rules = el.ShardingRules.for_spec(spec.replace(rules={"vocab": None}))
    assert rules.mesh_axes("vocab") == () and rules.mesh_axes("embed") == ("fsdp",)


def test_mla_up_projections_take_fsdp_as_a_fallback():
    # wq_b / wkv_b have no `embed` dimension: their low-rank input splits over fsdp instead,
    # while wq_a [embed, q_lora_rank] keeps fsdp on embed (a mesh axis splits one dimension).
    config = dataclasses.replace(DS_PRESETS["tiny"], q_lora_rank=12, kv_lora_rank=16)
    model = eqx.filter_eval_shape(DeepSeek, config, key=jax.random.key(0))
    spec = el.ShardingSpec(_mesh((2, 4), ("fsdp", "context")), fsdp_axis="fsdp")
    attn = el.param_pspecs(model, spec).moe_layers.layers.attn
    assert attn.wq_b == P(None, "fsdp", None, None)
    assert attn.wkv_b == P(None, "fsdp", None, None)
    assert attn.wq_a == P(None, "fsdp", None)
    gathered = el.param_pspecs(model, spec, gathered=True).moe_layers.layers.attn
    assert gathered.wq_b == P(None, None, None, None)
    # A size that does not divide stays whole (no error): q_lora_rank 12 over fsdp x context.
    wide = el.ShardingSpec(_mesh((2, 4), ("fsdp", "context")), fsdp_axis=("fsdp", "context"))
    wide_attn = el.param_pspecs(model, wide).moe_layers.layers.attn
    assert wide_attn.wq_b == P(None, None, None, None)
    assert wide_attn.wkv_b == P(None, ("fsdp", "context"), None, None)
    # Named in the rules, a fallback axis is an ordinary entry: whole, or a hard split.
    whole = el.param_pspecs(model, spec.replace(rules={"kv_lora_rank": None}))
    assert whole.moe_layers.layers.attn.wkv_b == P(None, None, None, None)
    hard = spec.replace(rules={"q_lora_rank": "fsdp"})
    with pytest.raises(ValueError, match=r"'fsdp' is used twice.*'embed' and 'q_lora_rank'"):
        el.param_pspecs(model, hard)
    full = el.param_bytes_per_device(model, el.ShardingSpec(spec.mesh))
    assert el.param_bytes_per_device(model, spec) < 0.55 * full


@pytest.mark.parametrize("q_lora_rank", [None, 48])
def test_mla_splits_heads_over_tensor_and_keeps_the_latent_whole(q_lora_rank):
    # DeepSeek's tensor parallelism: every per-head weight (query and K/V up-projections,
    # output) splits over heads; the down-projection to the latent and the RoPE key (wkv_a),
    # the query latent (wq_a) and their norms are whole on every tensor shard.
    config = dataclasses.replace(DS_PRESETS["tiny"], vocab_size=256, q_lora_rank=q_lora_rank)
    model = eqx.filter_eval_shape(DeepSeek, config, key=jax.random.key(0))
    spec = el.ShardingSpec(
        _mesh((2, 2, 2), ("fsdp", "tensor", "context")), fsdp_axis="fsdp", tensor_axis="tensor"
    )
    for stack in ("dense_layers", "moe_layers"):
        attn = getattr(el.param_pspecs(model, spec), stack).layers.attn
        if q_lora_rank is None:
            assert attn.wq == P(None, "fsdp", "tensor", None)
        else:
            assert attn.wq_a == P(None, "fsdp", None)
            assert attn.q_norm.weight == P(None, None)
            assert attn.wq_b == P(None, "fsdp", "tensor", None)  # q_lora_rank: fsdp fallback
        assert attn.wkv_a == P(None, "fsdp", None)
        assert attn.kv_norm.weight == P(None, None)
        assert attn.wkv_b == P(None, "fsdp", "tensor", None)
        assert attn.wo == P(None, "tensor", None, "fsdp")  # row-parallel: reduced over tensor
        gathered = getattr(el.param_pspecs(model, spec, gathered=True), stack).layers.attn
        assert gathered.wkv_b == P(None, None, "tensor", None)
        assert gathered.wkv_a == P(None, None, None)
    fsdp_only = el.ShardingSpec(spec.mesh, fsdp_axis="fsdp")
    heads_bytes = sum(
        math.prod(w.shape) * 4
        for stack in (model.dense_layers, model.moe_layers)
        for w in (stack.layers.attn.wq, stack.layers.attn.wq_b, stack.layers.attn.wkv_b,
                  stack.layers.attn.wo)
        if w is not None
    )  # fmt: skip
    saved = el.param_bytes_per_device(model, fsdp_only) - el.param_bytes_per_device(model, spec)
    assert saved >= heads_bytes // 4  # at least half of each fsdp shard of the head weights


DS_PLANS = [
    ("fsdp_context", (2, 4), ("fsdp", "context"), dict(fsdp_axis=("fsdp", "context"))),
    ("fsdp_expert", (2, 2, 2), ("fsdp", "expert", "context"),
     dict(fsdp_axis="fsdp", expert_axis="expert")),
    # MLA's heads over a tensor axis (the latent whole on each shard), with every other axis:
    # pairwise, the tensor axis beside ring is fsdp_tensor's and expert_tensor's (a
    # tensor_ring case alone, ~30 s of one core, ran nothing they do not).
    ("tensor_ulysses", (2, 2, 2), ("data", "tensor", "context"),
     dict(tensor_axis="tensor", strategy="ulysses", load_balance="striped")),
    ("fsdp_tensor", (2, 2, 2), ("fsdp", "tensor", "context"),
     dict(fsdp_axis="fsdp", tensor_axis="tensor")),
    ("expert_tensor", (2, 2, 2), ("expert", "tensor", "context"),
     dict(expert_axis="expert", tensor_axis="tensor")),
]  # fmt: skip


DS_CONFIG = dataclasses.replace(DS_PRESETS["tiny"], vocab_size=256)


def _ds_loss(model, tokens):
    logits = model(tokens)
    return jnp.mean(jax.nn.logsumexp(logits, -1)), logits


# One compiled step gives the logits and the parameter gradients.
_ds_logits_and_grads = eqx.filter_jit(eqx.filter_grad(_ds_loss, has_aux=True))


@pytest.fixture(scope="module")
def ds_reference():
    """The one-device model's tokens, logits and parameter gradients."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, DS_CONFIG.vocab_size, (4, 64)).astype(np.int32)
    grads, logits = _ds_logits_and_grads(DeepSeek(DS_CONFIG, key=jax.random.key(0)), tokens)
    return tokens, logits, grads


@pytest.mark.parametrize("name,shape,names,kw", DS_PLANS, ids=[p[0] for p in DS_PLANS])
def test_deepseek_sharded_same_logits_and_grads(ds_reference, name, shape, names, kw):
    tokens, ref_logits, ref_grads = ds_reference
    spec = el.ShardingSpec(_mesh(shape, names), **kw)
    sharded = el.init_sharded(lambda: DeepSeek(DS_CONFIG, key=jax.random.key(0), spec=spec))
    grads, logits = _ds_logits_and_grads(sharded, el.to_layout(tokens, spec))
    assert_close(el.from_layout(logits, spec), ref_logits)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        assert_close(a, b, factor=5, what="parameter gradient")


def test_offload_remat_gives_the_same_gradients(packed, reference):
    _, _, ref_grads = reference
    config = dataclasses.replace(CONFIG, remat="offload")
    model = Llama(config, key=jax.random.key(0))
    grads = eqx.filter_jit(eqx.filter_grad(_loss))(model, *packed)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        assert_close(a, b, factor=5, what="parameter gradient")


@pytest.mark.parametrize("family", ["llama", "deepseek"])
def test_from_hf_reads_each_tensor_into_its_shards(tmp_path, family):
    if family == "llama":
        config, cls, save, load = CONFIG, Llama, to_hf, from_hf
    else:
        config = dataclasses.replace(DS_PRESETS["tiny"], vocab_size=256)
        cls, save, load = DeepSeek, ds_to_hf, ds_from_hf
    model = cls(config, key=jax.random.key(0))
    save(model, tmp_path)
    spec = el.ShardingSpec(_mesh((2, 4), ("fsdp", "context")), fsdp_axis=("fsdp", "context"))
    loaded = load(tmp_path, spec=spec)
    leaves = jax.tree.leaves(eqx.filter(loaded, eqx.is_array))
    for leaf, sharding, original in zip(
        leaves,
        jax.tree.leaves(el.param_shardings(loaded)),
        jax.tree.leaves(eqx.filter(model, eqx.is_array)),
        strict=True,
    ):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(original))
    assert sum(x.addressable_shards[0].data.nbytes for x in leaves) == el.param_bytes_per_device(
        loaded
    )


# ---- errors ---------------------------------------------------------------------------


class _Unnamed(eqx.Module):
    w: jax.Array


class _UnknownAxis(eqx.Module):
    w: Float[Array, "embed banana"]


class _WrongRank(eqx.Module):
    w: Float[Array, "embed hidden"]


def test_rules_errors():
    mesh = _mesh((2, 2, 2), ("fsdp", "context", "tensor"))
    model = eqx.filter_eval_shape(Llama, CONFIG, key=jax.random.key(0))
    twice = el.ShardingSpec(mesh, fsdp_axis="fsdp", rules={"vocab": "fsdp"})
    with pytest.raises(ValueError, match=r"Llama.embed: mesh axis 'fsdp' is used twice"):
        el.param_pspecs(model, twice)
    odd = eqx.filter_eval_shape(
        Llama, dataclasses.replace(CONFIG, vocab_size=259), key=jax.random.key(0)
    )
    tensor = el.ShardingSpec(mesh, tensor_axis="tensor")
    with pytest.raises(ValueError, match=r"'vocab' has size 259.*tensor=2.*\(e.g. 260"):
        el.param_pspecs(odd, tensor)
    with pytest.raises(ValueError, match="rules.*'nope'.*not an axis of the mesh"):
        el.param_pspecs(model, el.ShardingSpec(mesh, rules={"vocab": "nope"}))
    spec = el.ShardingSpec(mesh, fsdp_axis="fsdp")
    with pytest.raises(ValueError, match="declares no logical axes"):
        el.param_pspecs(_Unnamed(jnp.zeros((4, 4))), spec)
    with pytest.raises(ValueError, match="'banana', which the rules table does not map"):
        el.param_pspecs(_UnknownAxis(jnp.zeros((4, 4))), spec)
    with pytest.raises(ValueError, match="annotation and the array disagree in rank"):
        el.logical_axes(_WrongRank(jnp.zeros((2, 4, 4))))
    with pytest.raises(ValueError, match="param_shardings needs a ShardingSpec"):
        el.param_shardings(model)


def test_spec_errors():
    mesh = _mesh((2, 2, 2), ("fsdp", "context", "tensor"))
    with pytest.raises(ValueError, match="fsdp_axis=.*'nope', which is not an axis"):
        el.ShardingSpec(mesh, fsdp_axis="nope")
    with pytest.raises(ValueError, match="'tensor' is used twice, as fsdp_axis and tensor_axis"):
        el.ShardingSpec(mesh, fsdp_axis="tensor", tensor_axis="tensor")
    with pytest.raises(ValueError, match="names an axis twice"):
        el.ShardingSpec(mesh, fsdp_axis=("fsdp", "fsdp"))
    with pytest.raises(TypeError, match="fsdp_axis must be a mesh axis name"):
        el.ShardingSpec(mesh, fsdp_axis=3)
    with pytest.raises(ValueError, match="'expert'.*is not an axis of the mesh"):
        el.ShardingSpec(mesh, expert_axis="expert")
    spec = el.ShardingSpec(mesh, fsdp_axis="fsdp")
    assert spec.batch_axes == ("fsdp",)
    with pytest.raises(ValueError, match=r"batch is split over 'fsdp' \(2\).*batch=3.*'context'"):
        spec.check_batch(3)
    spec = el.ShardingSpec(mesh, fsdp_axis=("fsdp", "context"))
    assert spec.batch_axes == ("fsdp",) and spec.token_pspec() == P("fsdp", "context")
