"""A profile reads as the model does: the compiled train step's and inference's operations
carry the names of the model's parts (`jax.named_scope`): the layer stack and each layer,
its attention (named by the strategy that runs it) and MLP, the loss; the prefill, the
decode step and its attention."""

import re

import jax
import numpy as np
import pytest
from helpers import make_mesh

import eqx_longctx as el
from eqx_longctx.data import Batch
from eqx_longctx.inference import lower_decode, lower_prefill
from eqx_longctx.train import loss_fn
from models.llama import Llama, LlamaConfig

CONFIG = LlamaConfig.from_preset("tiny", n_layers=2, dim=32, n_heads=4, n_kv_heads=1,
                                 hidden_dim=64, max_seq_len=64)  # fmt: skip


def scopes(compiled) -> set[str]:
    """Every path component of the compiled program's operation names."""
    names = re.findall(r'op_name="([^"]+)"', compiled.as_text())
    return {part.split("(")[-1].rstrip(")") for name in names for part in name.split("/")}


def batch(rows: int, seq: int) -> Batch:
    ids = np.zeros((rows, seq), np.int32)
    positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (rows, seq))
    return Batch(ids, ids, positions, ids, np.ones((rows, seq), np.float32))


@pytest.mark.parametrize("strategy", [None, "ring", "ulysses"])
def test_the_train_step_names_its_parts(strategy):
    spec = None
    if strategy is not None:
        spec = el.ShardingSpec(make_mesh((2, 4), ("data", "context")), strategy, "zigzag")
    model = Llama(CONFIG, key=jax.random.key(0), spec=spec)
    b = batch(2, 64)
    if spec is not None:
        b = Batch(*(el.to_layout(x, spec, axis=1) for x in b))
    step = jax.jit(lambda m, b: jax.grad(lambda m: loss_fn(m, b)[0])(m))
    found = scopes(step.lower(model, b).compile())
    attention = "flash_attention" if strategy is None else f"{strategy}_attention"
    for name in ("layer_stack", "layer", "attention", attention, "mlp", "loss", "cross_entropy"):
        assert name in found, (name, sorted(found)[:40])


def test_inference_names_its_parts():
    spec = el.ShardingSpec(make_mesh((4,), ("context",)), "ring", "zigzag")
    model = Llama(CONFIG, key=jax.random.key(0), spec=spec)
    prefill = scopes(lower_prefill(model, batch=1, max_len=32).compile())
    decode = scopes(lower_decode(model, batch=1, max_len=32).compile())
    assert {"prefill", "layer_stack", "ring_attention", "mlp"} <= prefill, sorted(prefill)
    assert {"decode_step", "layer_stack", "decode_attention", "mlp"} <= decode, sorted(decode)
