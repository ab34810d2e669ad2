"""No collective of a compiled train step runs beside a loop that holds collectives.

XLA:CPU (jaxlib 0.10) orders a device's collectives only by when they start, and each
blocks a thread of a pool sized to the device count while it waits for its peers. A
collective with no data dependence on such a loop (the layer stack's `while`) may run beside
it, in a different order on different devices, and the devices can then wait for each other
for ever: Ulysses training on `data=2,context=4` under `remat="full"` hung and aborted after
40 s ("Termination timeout ... all reduce") in most runs. The step's token count, byte count
and output-head gradient were such collectives, and under the ring the backward's first hop
beside the recomputed forward's hops; they are now ordered against the loop. These tests
read the compiled programs for any such pair, which the deadlock itself shows only now and
then, and run Ulysses training to its end.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_train_sharded import LLAMA, assert_same_run, family_of, run_steps

from eqx_longctx.run import placement_from_flags
from eqx_longctx.train import make_optimizer
from eqx_longctx.train._step import lower_train_step

_COLLECTIVE = re.compile(
    r"(all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute)(-start)?$"
)
_CALLED = re.compile(
    r"(?:body|condition|to_apply|calls|true_computation|false_computation)=%([\w.\-]+)"
)


def _computations(text: str) -> dict[str, list[tuple[str, str, list[str], list[str]]]]:
    """Each computation of an HLO module's text: its instructions as (name, opcode,
    operands and control predecessors, computations it calls)."""
    comps = {}
    pattern = r"\n(?:ENTRY )?%?([\w.\-]+) (?:\([^\n]*\) -> [^\n]*)?\{\n(.*?)\n\}"
    for comp in re.finditer(pattern, text, re.S):
        insts = []
        for line in comp.group(2).split("\n"):
            m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.*)", line)
            if not m:
                continue
            name, rest = m.groups()
            op = re.search(r"\s([a-z\-]+)\(", rest)
            args = rest[op.end() :] if op else ""
            depth, end = 1, 0
            while end < len(args) and depth:
                depth += {"(": 1, ")": -1}.get(args[end], 0)
                end += 1
            operands = re.findall(r"%([\w.\-]+)", args[:end])
            control = re.search(r"control-predecessors=\{([^}]*)\}", rest)
            if control:
                operands += re.findall(r"%([\w.\-]+)", control.group(1))
            called = _CALLED.findall(rest)
            branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
            if branches:
                called += re.findall(r"%([\w.\-]+)", branches.group(1))
            insts.append((name, op.group(1) if op else "?", operands, called))
        comps[comp.group(1)] = insts
    return comps


def concurrent_collectives(text: str) -> list[tuple[str, str]]:
    """Pairs `(collective or loop, loop)` of one computation where the loop (a `while`,
    `conditional` or `call` whose computations hold a collective) and the other depend on
    each other in neither direction."""
    comps = _computations(text)
    holds: dict[str, bool] = {}

    def has_collective(name: str) -> bool:
        if name not in holds:
            holds[name] = False  # a computation does not call itself
            holds[name] = any(
                _COLLECTIVE.match(op) or any(has_collective(c) for c in called)
                for _, op, _, called in comps.get(name, [])
            )
        return holds[name]

    pairs = []
    for insts in comps.values():
        before: dict[str, set[str]] = {}
        for name, _, operands, _ in insts:
            before[name] = set().union(*[before[d] | {d} for d in operands if d in before])
        loops = [
            n
            for n, op, _, called in insts
            if op in ("while", "conditional", "call") and any(map(has_collective, called))
        ]
        others = [n for n, op, _, _ in insts if _COLLECTIVE.match(op)] + loops
        for a in others:
            for b in loops:
                if a != b and b not in before[a] and a not in before[b] and (b, a) not in pairs:
                    pairs.append((a, b))
    return pairs


def test_the_check_finds_a_collective_beside_a_loop():
    """A psum that nothing orders against a loop of psums is found; one that feeds the
    loop is not."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))

    def program(ordered: bool):
        def local(a, b):
            total = jax.lax.psum(jnp.sum(b), "x")
            start = a + total if ordered else a
            loop = jax.lax.fori_loop(0, 3, lambda i, c: c + jax.lax.psum(c, "x"), start)
            return loop, total

        mapped = jax.shard_map(local, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=(P("x"), P()))
        args = (jnp.ones(8), jnp.ones(8))
        return jax.jit(mapped).lower(*args).compile().as_text()

    assert len(concurrent_collectives(program(ordered=False))) == 1
    assert concurrent_collectives(program(ordered=True)) == []


STEPS = [
    ("data=2,context=4", "all_gather", {}),
    ("data=2,context=4", "ulysses", {}),
    ("data=2,context=4", "all_gather", {"loss_chunk": 0}),
    ("data=2,context=4", "ulysses", {"grad_accum": 2}),
    ("data=2,context=4", "ring", {}),
    ("ulysses=2,context=4", "usp", {}),
]


@pytest.mark.parametrize(("mesh", "strategy", "options"), STEPS)
def test_no_collective_runs_beside_the_layer_loop(mesh, strategy, options):
    config = dataclasses.replace(LLAMA, remat="full")
    placement = placement_from_flags(8, mesh, strategy)
    optimizer = make_optimizer(1e-2, 1, 8)
    family = family_of(config)
    model = placement.abstract_model(
        lambda spec: family.model(config, key=jax.random.key(0), spec=spec)
    )
    state = placement.abstract_opt_state(optimizer, model)
    batch = placement.abstract_batch(8, 64)
    shardings = placement.step_shardings(optimizer, model)
    lowered = lower_train_step(optimizer, model, state, batch, shardings=shardings, **options)
    assert concurrent_collectives(lowered.compile().as_text()) == []


@pytest.fixture(scope="module")
def datasets():
    from test_train_sharded import SEQ

    from eqx_longctx.data import load_datasets

    return load_datasets(None, seq_len=SEQ, max_bytes=300_000, val_fraction=0.1)


def test_ulysses_training_under_full_remat_equals_all_gather(datasets):
    """The run that used to hang: Ulysses on data=2,context=4 with every layer recomputed,
    three steps, equal to the same steps under all_gather (losses, parameters, Adam's
    moments: float32 tolerances)."""
    config = dataclasses.replace(LLAMA, remat="full")
    runs = [
        run_steps(placement_from_flags(8, "data=2,context=4", strategy), datasets, 3, config=config)
        for strategy in ("ulysses", "all_gather")
    ]
    assert np.all(np.isfinite(runs[0][0]))
    assert_same_run(*runs)
