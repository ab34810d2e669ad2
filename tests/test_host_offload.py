"""Host offload of the training state (`--host-offload`): AdamW's moments (and the
parameters) live in host memory between steps and the updates are unchanged, on one device
and under fsdp and context meshes; the trainer checkpoints and resumes such a run; the
planner counts the offloaded state in host memory; bad names are clear errors."""

import equinox as eqx
import jax
import numpy as np
import pytest
from test_train import SEQ
from test_train_sharded import LLAMA, family_of

from eqx_longctx.data import load_datasets, place_batch
from eqx_longctx.plan import plan_train_step
from eqx_longctx.run import placement_from_flags
from eqx_longctx.train import (
    TrainConfig,
    Trainer,
    make_optimizer,
    make_train_step,
    to_host,
)


@pytest.fixture(scope="module")
def datasets():
    return load_datasets(None, seq_len=SEQ, max_bytes=300_000, val_fraction=0.1)


def _memory_kinds(tree) -> set[str]:
    return {x.sharding.memory_kind for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))}


def _three_steps(placement, datasets, offload):
    fam = family_of(LLAMA)
    optimizer = make_optimizer(1e-2, 1, 8, eps=1e-4)
    model = placement.build_model(lambda spec: fam.model(LLAMA, key=jax.random.key(0), spec=spec))
    opt_state = placement.init_opt_state(optimizer, model)
    shardings = placement.step_shardings(optimizer, model)
    if "opt_state" in offload:
        opt_state = to_host(opt_state)
    if "params" in offload:
        model = to_host(model)
    step = make_train_step(optimizer, shardings=shardings, host_offload=offload)
    losses = []
    for i in range(3):
        batch = place_batch(datasets[0].batch(i, 8), placement.spec)
        model, opt_state, metrics = step(model, opt_state, batch)
        losses.append(float(metrics["loss"]))
    return losses, model, opt_state


@pytest.mark.parametrize(("devices", "mesh"), [(1, None), (8, "fsdp=2,context=4")])
def test_offloaded_state_gives_the_same_updates(datasets, devices, mesh):
    placement = placement_from_flags(devices, mesh)
    losses, model, _ = _three_steps(placement, datasets, ())
    for offload in (("opt_state",), ("opt_state", "params")):
        got_losses, got_model, got_state = _three_steps(placement, datasets, offload)
        assert _memory_kinds(got_state) == {"pinned_host"}
        assert _memory_kinds(got_model) == {"pinned_host" if "params" in offload else "device"}
        np.testing.assert_allclose(got_losses, losses, rtol=1e-6)
        for got, want in zip(jax.tree.leaves(got_model), jax.tree.leaves(model), strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)


def test_trainer_offloads_checkpoints_and_resumes(tmp_path, datasets):
    """A run with both offloaded, stopped after 2 steps and resumed without offload, ends
    where the same 3 steps without offload end."""
    base = dict(steps=3, batch_size=8, seq_len=SEQ, devices=8, mesh="fsdp=2,context=4",
                checkpoint_every=2, eval_every=100, final_eval_batches=1, eval_batches=1,
                progress=False, model_overrides={"dim": 64, "n_layers": 2, "n_heads": 4,
                                                 "n_kv_heads": 2, "hidden_dim": 128})  # fmt: skip
    plain = Trainer(TrainConfig(run_dir=str(tmp_path / "plain"), **base), datasets=datasets)
    plain.run()
    offloaded = TrainConfig(run_dir=str(tmp_path / "off"), host_offload="opt_state,params", **base)
    first = Trainer(offloaded, datasets=datasets)
    assert _memory_kinds(first.opt_state) == {"pinned_host"}
    first.run(stop_at=2)
    resumed = TrainConfig(run_dir=str(tmp_path / "off"), resume=True, **base)
    second = Trainer(resumed, datasets=datasets)
    assert second.step == 2 and _memory_kinds(second.opt_state) == {"device"}
    second.run()
    for got, want in zip(jax.tree.leaves(second.model), jax.tree.leaves(plain.model), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_the_planner_counts_offloaded_state_in_host_memory():
    spec = placement_from_flags(8, "context=8", "ring").spec
    kw = dict(batch=1, seq=8192, remats=("full",), strategies=("ring",))
    plain = plan_train_step("llama", LLAMA, spec, **kw).row("ring", "full")
    off = plan_train_step("llama", LLAMA, spec, host_offload=("opt_state",), **kw).row(
        "ring", "full"
    )
    assert off.host == plain.host + plain.opt_state
    fixed = plain.params + plain.grads + plain.batch + plain.activations
    assert off.device == max(
        fixed + max(plain.layer_backward, plain.logits),
        plain.params + plain.grads + plain.opt_state + plain.batch,
    )
    assert off.device <= plain.device - plain.opt_state + plain.params + plain.grads
    both = plan_train_step("llama", LLAMA, spec, host_offload=("opt_state", "params"), **kw)
    assert both.row("ring", "full").host == off.host + plain.params


@pytest.mark.parametrize("bad", ["adam", "opt_state,opt_state", "params,"])
def test_bad_host_offload_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="--host-offload takes distinct names among"):
        TrainConfig(host_offload=bad)
    with pytest.raises(ValueError, match=r"host_offload \(--host-offload\)"):
        make_train_step(make_optimizer(1e-3, 1, 10), host_offload=tuple(bad.split(",")))
