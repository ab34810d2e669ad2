"""The planner knows linear-attention layers (Gated DeltaNet, Kimi Delta Attention).

- `eqx_longctx.linear.linear_attention_cost`: its bytes against the collectives of one
  GDN / KDA layer's forward + backward compiled on 8 fake devices (exact), its FLOPs
  against a hand count, and its errors.
- `plan_train_step` prices a hybrid's linear stacks by that model and its softmax stacks by
  the attention cost model; the step's memory against XLA's compiled step (within 20%)
  for the two hybrid families' tiny presets; the full model's stacks are paired with the
  local model's by kind, so a 48-layer hybrid traces one layer per kind.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import need_devices

import eqx_longctx as el
from eqx_longctx.linear import linear_attention_cost
from eqx_longctx.nn import GatedDeltaNet, KimiDeltaAttention
from eqx_longctx.plan import compiled_bytes, plan_train_step
from eqx_longctx.plan._compile import compile_train_step, trainer_run
from eqx_longctx.train import TrainConfig

TOLERANCE = 0.2
DIM, HEADS, HEAD_DIM = 128, 4, 32


def _layer(kind: str, spec):
    """A tiny GDN (2 key heads for 4 value heads) or KDA layer and `linear_attention_cost`'s
    shape arguments for it."""
    key = jax.random.key(0)
    if kind == "gdn":
        layer = GatedDeltaNet(DIM, HEADS, HEADS // 2, HEAD_DIM, HEAD_DIM, key=key, spec=spec)
        channels = (HEADS // 2 * HEAD_DIM, HEADS // 2 * HEAD_DIM, HEADS * HEAD_DIM)
        return layer, dict(gate="head", conv_channels=channels)
    layer = KimiDeltaAttention(DIM, HEADS, HEAD_DIM, key=key, spec=spec)
    return layer, dict(gate="channel", conv_channels=(HEADS * HEAD_DIM,) * 3)


# id: (layer, mesh, load balance, global batch, seq)
LAYER_CASES = {
    "gdn-context8-zigzag": ("gdn", {"context": 8}, "zigzag", 1, 2048),
    "kda-data2-context4-contiguous": ("kda", {"data": 2, "context": 4}, "none", 2, 2048),
    "gdn-context8-striped": ("gdn", {"context": 8}, "striped", 1, 2048),
}


@pytest.mark.parametrize("case", list(LAYER_CASES), ids=list(LAYER_CASES))
def test_layer_bytes_equal_the_compiled_collectives(case):
    """One layer's forward and backward (the gradient of its input, as the layer below
    needs) under a spec: every collective's bytes per device as the cost model predicts
    them (the summaries' all-gather and its reduce-scatter, the ids' all-gather, the three
    convolutions' halos, striped's all_to_all)."""
    need_devices(8)
    kind, mesh_shape, balance, batch, seq = LAYER_CASES[case]
    mesh = jax.make_mesh(tuple(mesh_shape.values()), tuple(mesh_shape))
    spec = el.ShardingSpec(mesh, load_balance=balance)
    layer, shape = _layer(kind, spec)
    params, static = eqx.partition(layer, eqx.is_array)

    def loss(x, ids):
        return eqx.combine(params, static)(x, ids, ids).sum()

    x = jax.ShapeDtypeStruct((batch, seq, DIM), jnp.float32)
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    shardings = (
        jax.NamedSharding(mesh, spec.activation_pspec()),
        jax.NamedSharding(mesh, spec.token_pspec()),
    )
    compiled = jax.jit(jax.grad(loss), in_shardings=shardings).lower(x, ids).compile()
    got = {op: b for op, b in el.collective_bytes(compiled).items() if b}
    cost = linear_attention_cost(
        spec, batch=batch, seq=seq, heads=HEADS, head_dim=HEAD_DIM, v_head_dim=HEAD_DIM,
        dtype_bytes=4, **shape,
    )  # fmt: skip
    assert cost.composition == "all_gather"  # small summaries: one collective
    assert got == cost.comm_train


def test_flops_are_the_chunked_forms_hand_count():
    """Per chunk of C tokens, row and head (GDN, one device): A and P (2 x 2 C^2 dk), the
    inverse by doubling (4 C^3 log2 C), W (2 C^2 (dk + dv)), P u (2 C^2 dv), three state
    products (6 C dk dv); 4 forwards with the backward; split over the sequence the values
    widen to dk + dv; KDA's decayed products cost 3 C^2 dk each."""
    c, dk, dv, seq, h = 64, 128, 128, 4096, 8
    hand = 2 * 2 * c * c * dk + 4 * c**3 * 6 + 2 * c * c * (dk + dv) + 2 * c * c * dv
    hand += 6 * c * dk * dv
    shape = dict(batch=1, seq=seq, heads=h, head_dim=dk, v_head_dim=dv, chunk=c)
    one = linear_attention_cost(None, gate="head", **shape)
    assert one.flops_forward == pytest.approx(h * seq / c * hand)
    assert one.flops_train == pytest.approx(4 * one.flops_forward)
    assert one.forward_fraction == pytest.approx(0.25)
    assert one.comm_train == {} and one.time_s == pytest.approx(one.compute_s)
    kda = linear_attention_cost(None, gate="channel", **shape)
    assert kda.flops_forward - one.flops_forward == pytest.approx(h * seq / c * 2 * c * c * dk)
    # MFU's count: causal pairs, the UT system by substitution, no augmented values.
    pairs = c * (c + 1) / 2
    model = 4 * pairs * dk + c * (c - 1) * (dk + dv) + 2 * pairs * dv + 6 * c * dk * dv
    assert one.model_flops_train == pytest.approx(3 * h * seq / c * model)
    assert one.model_flops_train < 3 * one.flops_forward


def test_cost_errors_name_the_rule():
    shape = dict(batch=1, seq=64, heads=2, head_dim=8, v_head_dim=8)
    with pytest.raises(ValueError, match="gate must be one of"):
        linear_attention_cost(None, gate="scalar", **shape)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk must be an int >= 1"):
        linear_attention_cost(None, gate="head", chunk=0, **shape)
    need_devices(8)
    spec = el.ShardingSpec(jax.make_mesh((8,), ("context",)))
    with pytest.raises(ValueError, match="must split over"):
        linear_attention_cost(spec, gate="head", **{**shape, "seq": 60})


# id: (family, mesh, load balance, remat, seq, batch)
STEP_CASES = {
    "qwen3_next-context8-zigzag-none": ("qwen3_next", "context=8", "zigzag", "none", 4096, 1),
    "kimi_linear-data2-context4-none": ("kimi_linear", "data=2,context=4", "none", "none", 4096, 2),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", list(STEP_CASES), ids=list(STEP_CASES))
def test_step_memory_is_within_tolerance_of_compiled(case):
    """The trainer's step of a tiny hybrid (DeltaNet or KDA stacks beside softmax stacks,
    dense and MoE) compiled on 8 fake devices: the planner's per-device bytes within 20%."""
    need_devices(8)
    family, mesh, balance, remat, seq, batch = STEP_CASES[case]
    run = trainer_run(
        TrainConfig(
            model=family,
            preset="tiny",
            seq_len=seq,
            batch_size=batch,
            devices=8,
            mesh=mesh,
            strategy="ring",
            load_balance=balance,
            remat=remat,
            run_dir="unused",
            progress=False,
        )  # fmt: skip
    )
    plan = plan_train_step(
        run.family, run.config, run.placement.spec, batch=batch, seq=seq, remats=(remat,),
        strategies=("ring",),
    )  # fmt: skip
    predicted = plan.row("ring", remat)
    compiled = compiled_bytes(compile_train_step(run))
    ratio = predicted.device / compiled.device
    assert abs(ratio - 1) <= TOLERANCE, (case, ratio, predicted.breakdown(), compiled)


@pytest.mark.parametrize("family", ["qwen3_next", "kimi_linear"])
def test_linear_stacks_are_priced_by_the_linear_model(family):
    """The tiny hybrids on a context=8 ring: the linear stacks' time and FLOPs are
    `linear_attention_cost`'s, the softmax stacks' the attention cost model's; the model
    FLOPs add the linear layers' MFU count; a layer of each kind is traced, not each run."""
    need_devices(8)
    fam = el.model_family(family)
    config = fam.config.from_preset("tiny")
    spec = el.ShardingSpec(jax.make_mesh((8,), ("context",)))
    seq = 8192
    plan = plan_train_step(fam, config, spec, batch=1, seq=seq, remats=("none",),
                           strategies=("ring",))  # fmt: skip
    row = plan.row("ring", "none")
    model = eqx.filter_eval_shape(fam.model, config, key=jax.random.key(0), spec=spec)
    from eqx_longctx.plan._activations import stacks
    from eqx_longctx.plan._step_time import stack_linear

    linear = stack_linear(stacks(model))
    assert any(v is not None for v in linear.values()) and any(v is None for v in linear.values())
    n_linear = sum(s.n_layers for p, s in stacks(model).items() if linear[p] is not None)
    shape = next(v for v in linear.values() if v is not None)
    assert shape["gate"] == ("head" if family == "qwen3_next" else "channel")
    cost = linear_attention_cost(spec, batch=1, seq=seq, **shape, dtype_bytes=4)
    hq, _, d, dv = fam.attention_shape(config)
    softmax = plan.model_flops - 6 * fam.active_params(config) * seq
    one = linear_attention_cost(None, batch=1, seq=seq, **shape).model_flops_train
    n_softmax = config.n_layers - n_linear
    assert softmax == pytest.approx(
        n_linear * one + n_softmax * 3 * 2 * (d + dv) * hq * seq * (seq + 1) / 2
    )
    assert row.attention_s > n_linear * cost.time_s


def test_a_48_layer_hybrid_traces_one_layer_per_kind():
    """Qwen3-Next-80B's 48 layers run as 24 stacks; the local model has one layer per kind
    (DeltaNet and softmax, both MoE), and each full stack is priced by its kind's."""
    fam = el.model_family("qwen3_next")
    big = fam.presets["qwen3-next-80b-a3b"]
    local = fam.local_config(big, tensor=1, expert=1)
    assert local.n_layers == 2 and set(local.kinds) == set(big.kinds)
    from eqx_longctx.plan._activations import stack_activations

    per = stack_activations(fam, big, batch=1, seq=512)
    assert len(per) == 24 and sum(s.n_layers for s in per) == 48
    linear = {s.saved["none"] for s in per[0::2]}
    softmax = {s.saved["none"] for s in per[1::2]}
    assert len(linear) == 1 and len(softmax) == 1 and linear != softmax
    kimi = el.model_family("kimi_linear")
    k48 = kimi.presets["kimi-linear-48b-a3b"]
    assert kimi.local_config(k48).n_layers == 3  # KDA dense, KDA MoE, MLA MoE
    assert math.isfinite(per[0].saved["full"])
