"""The strategy cost model against what XLA compiles, and the choices `"auto"` makes.

Every entry of `CASES` is compiled (never run) on the 8 fake CPU devices, forward and
forward + backward; the collective bytes counted in the HLO and the compiled memory analysis
must agree with `plan`'s prediction within `TOLERANCE`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close

import eqx_longctx as el
from eqx_longctx._hlo import collective_bytes, collectives
from eqx_longctx.attention import _context_parallel
from eqx_longctx.attention._block import BlockOptions
from eqx_longctx.attention._choose import choose_strategy, explain, plan
from eqx_longctx.attention._cost import STRATEGY_ORDER
from eqx_longctx.attention._ring import _kv_identity
from eqx_longctx.plan import compiled_attention, compiled_memory, main

TOLERANCE = 0.2
LOSS_BYTES = 64  # the scalar loss of value_and_grad is summed over devices (an all-reduce)

# id: (strategy, mesh axes, ulysses axis, (batch, seq, q_heads, kv_heads, head_dim, v_head_dim),
#      segment ids, load balance)
CASES = {
    "all_gather-gqa": (
        "all_gather",
        {"data": 2, "context": 4},
        None,
        (2, 512, 8, 2, 16, 16),
        False,
        "zigzag",
    ),
    "ulysses-gqa": (
        "ulysses",
        {"data": 2, "context": 4},
        None,
        (2, 512, 8, 2, 16, 16),
        False,
        "zigzag",
    ),
    "ring-gqa": ("ring", {"data": 2, "context": 4}, None, (2, 512, 8, 2, 16, 16), False, "zigzag"),
    "usp-2x4": (
        "usp",
        {"ulysses": 2, "context": 4},
        "ulysses",
        (2, 512, 8, 2, 16, 16),
        False,
        "zigzag",
    ),
    "all_gather-mqa-segments": (
        "all_gather",
        {"context": 8},
        None,
        (1, 1024, 4, 1, 32, 16),
        True,
        "striped",
    ),
    "ulysses-mqa-segments": (
        "ulysses",
        {"context": 8},
        None,
        (1, 1024, 8, 1, 32, 16),
        True,
        "striped",
    ),
    "ring-mqa-segments": ("ring", {"context": 8}, None, (1, 1024, 4, 1, 32, 16), True, "none"),
    "usp-4x2-segments": (
        "usp",
        {"ulysses": 4, "context": 2},
        "ulysses",
        (1, 1024, 4, 2, 32, 16),
        True,
        "zigzag",
    ),
}
PASSES = {"fwd": False, "fwd+bwd": True}


def _mesh(axes: dict):
    return jax.make_mesh(tuple(axes.values()), tuple(axes))


def _spec(case: str, strategy: str | None = None) -> el.ShardingSpec:
    name, axes, ulysses, _, _, layout = CASES[case]
    return el.ShardingSpec(
        _mesh(axes), strategy=strategy or name, load_balance=layout, ulysses_axis=ulysses
    )


def _shape(case: str) -> dict:
    b, s, hq, hk, d, dv = CASES[case][3]
    return dict(
        batch=b,
        seq=s,
        q_heads=hq,
        kv_heads=hk,
        head_dim=d,
        v_head_dim=dv,
        segment_ids=CASES[case][4],
    )


@functools.cache
def _measured(case: str, backward: bool) -> tuple[dict, int]:
    compiled = compiled_attention(_spec(case), backward=backward, **_shape(case))
    return collective_bytes(compiled), compiled_memory(compiled)


@pytest.mark.parametrize("pass_", PASSES)
@pytest.mark.parametrize("case", CASES)
def test_communication_matches_hlo(case, pass_):
    backward = PASSES[pass_]
    measured, _ = _measured(case, backward)
    cost = plan(_spec(case), **_shape(case)).costs[CASES[case][0]]
    predicted = cost.comm_train if backward else cost.comm_forward
    assert sum(predicted.values()) > 0
    for op, want in predicted.items():
        got = measured[op]
        if want == 0:
            assert got <= (LOSS_BYTES if op == "all-reduce" else 0), (op, got)
        else:
            assert abs(got - want) <= TOLERANCE * want, f"{op}: HLO {got} vs model {want}"


@pytest.mark.parametrize("pass_", PASSES)
@pytest.mark.parametrize("case", CASES)
def test_memory_matches_memory_analysis(case, pass_):
    backward = PASSES[pass_]
    _, measured = _measured(case, backward)
    cost = plan(_spec(case), **_shape(case)).costs[CASES[case][0]]
    predicted = cost.memory_train if backward else cost.memory_forward
    assert abs(predicted - measured) <= TOLERANCE * measured, (predicted, measured)


# ---- the HLO counter on hand-written text ----------------------------------------------------

HLO = """\
HloModule m, is_scheduled=true, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  ROOT %s = f32[] add(%x, %y)
}

%body (p: (s32[], f32[2,8])) -> (s32[], f32[2,8]) {
  %cp = f32[2,8]{1,0} collective-permute(%v), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  ROOT %t = (s32[], f32[2,8]) tuple(%i, %cp)
}

%cond (p: (s32[], f32[2,8])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[2,8]) -> bf16[2,8] {
  %a2a = (f32[1,8]{1,0}, f32[1,8]{1,0}, f32[1,8]{1,0}, /*index=3*/f32[1,8]{1,0}) all-to-all(%a0, %a1, %a2, %a3), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}
  %w = (s32[], f32[2,8]) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %ags = (f32[2,8]{1,0}, f32[8,8]{1,0}) all-gather-start(%a), channel_id=3, replica_groups=[2,4]<=[8], dimensions={0}
  %agd = f32[8,8]{1,0} all-gather-done(%ags)
  %ar = f32[2,8]{1,0} all-reduce(%a), replica_groups={}, to_apply=%add
  %mrs = f32[1,8]{1,0} reduce-scatter(%a), channel_id=4, replica_groups=mesh['data'=2,'context'=4] {'context'}, dimensions={0}, to_apply=%add
  ROOT %rs = bf16[2,8]{1,0} reduce-scatter(%y), replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, to_apply=%add
}
"""  # noqa: E501


def test_collective_bytes_parses_tuples_loops_async_and_groups():
    got = collective_bytes(HLO)
    assert got["all-to-all"] == 4 * 32 * 3 // 4  # four f32[1,8] pieces, 3 of 4 arrive
    assert got["collective-permute"] == 3 * 64  # inside a while body that runs 3 times
    assert got["all-gather"] == 256 * 3 // 4  # the -start's result, iota groups of 4
    assert got["all-reduce"] == 2 * 64 * 7 // 8  # empty groups: all 8 devices
    # a bf16 shard from 3 peers, and an f32 one over the 'context' axis (mesh form) of size 4
    assert got["reduce-scatter"] == 32 * 3 + 32 * 3
    runs = {c.op: c.count for c in collectives(HLO)}
    assert runs["collective-permute"] == 3 and runs["all-to-all"] == 1


# ---- balance, feasibility, choices ---------------------------------------------------------


def _context_spec(n: int, strategy: str = "auto", layout: str = "zigzag") -> el.ShardingSpec:
    mesh = jax.make_mesh((n,), ("context",), devices=jax.devices()[:n])
    return el.ShardingSpec(mesh, strategy=strategy, load_balance=layout)


SHAPE = dict(batch=1, seq=16384, q_heads=8, kv_heads=2, head_dim=64)


@pytest.mark.parametrize(
    "layout,lo,hi", [("none", 1.6, 1.9), ("zigzag", 1.0, 1.01), ("striped", 1.0, 1.05)]
)
def test_causal_balance_follows_the_layout(layout, lo, hi):
    costs = plan(_context_spec(4, layout=layout), **SHAPE).costs
    for name in ("all_gather", "ring"):
        assert lo <= costs[name].balance <= hi, (name, costs[name].balance)
    assert costs["ulysses"].balance == pytest.approx(1.0)  # every device sees every token
    flat = plan(_context_spec(4, layout=layout), causal=False, **SHAPE).costs["ring"]
    assert flat.balance == pytest.approx(1.0)


def test_ulysses_is_infeasible_and_never_chosen_when_heads_do_not_divide():
    p = plan(_context_spec(8), batch=1, seq=16384, q_heads=12, kv_heads=4, head_dim=64)
    assert not p.costs["ulysses"].feasible
    assert "not divisible by ulysses degree 8" in p.costs["ulysses"].reason
    assert p.strategy != "ulysses"
    assert p.costs["usp"].feasible and not p.costs["usp"].runnable  # what-if only: no axis


def test_all_gather_chosen_when_kv_is_small_next_to_compute():
    p = plan(_context_spec(8), batch=1, seq=32768, q_heads=32, kv_heads=1, head_dim=128)
    assert p.strategy == "all_gather", p.explain()


def test_ring_chosen_when_gathered_kv_exceeds_the_budget():
    shape = dict(batch=1, seq=524288, q_heads=12, kv_heads=4, head_dim=128)
    free = plan(_context_spec(8), memory_budget_bytes=2**40, **shape)
    assert free.strategy == "all_gather", free.explain()
    gathered, ring = free.costs["all_gather"].memory_train, free.costs["ring"].memory_train
    assert ring < gathered
    tight = plan(_context_spec(8), memory_budget_bytes=(ring + gathered) // 2, **shape)
    assert tight.strategy == "ring"
    assert "memory budget" in tight.reason


def test_fixed_strategy_is_kept_and_usp_planned_on_its_axes():
    spec = el.ShardingSpec(
        _mesh({"ulysses": 2, "context": 4}), strategy="usp", ulysses_axis="ulysses"
    )
    p = plan(spec, **SHAPE)
    assert p.strategy == "usp" and "fixed" in p.reason
    assert p.costs["usp"].degree == "u2 x r4"
    assert p.costs["usp"].runnable and p.costs["ring"].runnable  # ring over both axes


def test_shapes_no_strategy_can_run_are_reported():
    p = plan(_context_spec(8), batch=1, seq=1000, q_heads=8, kv_heads=2, head_dim=64)
    assert not any(c.feasible for c in p.costs.values())
    assert "seq=1000 not divisible by 16" in p.costs["ring"].reason


def test_explain_table_lists_every_strategy_and_the_choice():
    text = explain(_context_spec(8), **SHAPE)
    for name in STRATEGY_ORDER:
        assert name in text
    assert "chosen:" in text


def test_auto_spec_runs_the_chosen_strategy():
    spec = _context_spec(4)
    b, s, hq, hk, d = 1, 256, 4, 2, 16
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(kq, (b, s, hq, d))
    k = jax.random.normal(kk, (b, s, hk, d))
    v = jax.random.normal(kv, (b, s, hk, d))
    assert choose_strategy(spec, q, k).strategy in STRATEGY_ORDER
    to, back = (lambda x: el.to_layout(x, spec)), (lambda x: el.from_layout(x, spec))
    out = back(jax.jit(lambda q, k, v: el.attention(q, k, v, spec=spec))(to(q), to(k), to(v)))
    assert_close(out, el.reference_attention(q, k, v), what="auto")


def test_auto_with_a_ulysses_axis_runs_over_both_sequence_axes():
    """With a ulysses axis, "auto" may pick USP; any other pick runs over both axes."""
    spec = el.ShardingSpec(
        _mesh({"ulysses": 2, "context": 4}), strategy="auto", ulysses_axis="ulysses"
    )
    kq, kk, kv, ks = jax.random.split(jax.random.PRNGKey(1), 4)
    q = jax.random.normal(kq, (2, 64, 8, 8))
    k = jax.random.normal(kk, (2, 64, 2, 8))
    v = jax.random.normal(kv, (2, 64, 2, 8))
    seg = jnp.sort(jax.random.randint(ks, (2, 64), 0, 3), axis=1)
    costs = choose_strategy(spec, q, k).costs
    assert all(costs[name].runnable for name in STRATEGY_ORDER)
    to, back = (lambda x: el.to_layout(x, spec)), (lambda x: el.from_layout(x, spec))
    expected = el.reference_attention(q, k, v, segment_ids=seg)
    out = jax.jit(lambda q, k, v, s: el.attention(q, k, v, spec=spec, segment_ids=s))(
        to(q), to(k), to(v), to(seg)
    )
    assert_close(back(out), expected, what="auto")
    for name in STRATEGY_ORDER:  # whatever auto could pick runs correctly on this spec
        options = BlockOptions.make(True, None, None, q.shape[-1])
        run = functools.partial(_context_parallel, spec, name, options=options, impl="xla")
        out = jax.jit(lambda q, k, v, s, run=run: run(q, (k, v), _kv_identity, (), s))(
            to(q), to(k), to(v), to(seg)
        )
        assert_close(back(out), expected, what=name)


def test_cli_prints_the_table_and_the_choice(capsys):
    main(
        [
            "--mesh",
            "data=2,context=4",
            "--strategy",
            "auto",
            "--load-balance",
            "zigzag",
            "--batch",
            "2",
            "--seq",
            "32768",
            "--heads",
            "32",
            "--kv-heads",
            "8",
            "--head-dim",
            "128",
        ]
    )
    text = capsys.readouterr().out
    assert "mesh data=2,context=4" in text and "chosen:" in text
    assert np.isfinite(plan(_context_spec(4), **SHAPE).costs["ring"].time_s)
    assert jnp.dtype(jnp.float32).name in text


def test_sharding_imports_nothing_from_attention():
    """`_sharding.py` sits below `attention/` (which imports it): no import goes back up.
    The planner's table is `eqx_longctx.explain(spec, ...)`, not a `ShardingSpec` method."""
    import ast
    import pathlib

    tree = ast.parse(pathlib.Path(el._sharding.__file__).read_text())
    imported = [
        node.module or ""
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level > 0
    ]
    assert not [m for m in imported if m.startswith("attention")], imported
    assert not hasattr(el.ShardingSpec, "explain")
    assert "chosen:" in el.explain(_context_spec(8), **SHAPE)


def test_validation_does_not_run_the_chooser():
    """The dispatcher resolves "auto" (`_choose.resolve_strategy`) and the validator checks
    the strategy chosen: `_validate.py` imports nothing of the chooser, so the attention
    package has no cycle `_choose -> _validate -> _choose`."""
    import ast
    import pathlib

    from eqx_longctx.attention import _validate

    tree = ast.parse(pathlib.Path(_validate.__file__).read_text())
    imported = {
        (node.module or "").lstrip(".")
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level == 1
    }
    assert not imported & {"_choose", "_cost", "_explain", "_plan"}, imported
    q = jax.ShapeDtypeStruct((1, 64, 4, 8), jnp.float32)
    spec = _context_spec(8, "ulysses")  # 4 heads over 8 devices
    with pytest.raises(ValueError, match="needs num_heads divisible by 8, got 4"):
        _validate.check_spec_inputs(spec, q, q, "ulysses")
    _validate.check_spec_inputs(spec, q, q, "ring")
