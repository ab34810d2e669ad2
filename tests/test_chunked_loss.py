"""The chunked loss (`eqx_longctx.nn.chunked_cross_entropy`, the trainer's default): equal
to softmax cross-entropy written out in NumPy (float64) with the vocabulary split over 1, 2
and 4 devices; loss and gradients equal to the whole-logits loss (float32, 1e-6 relative)
for both families on one device and under fsdp, tensor and context meshes; a train
step at a 128K vocabulary holds no whole logits; bad settings are clear errors."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train import SEQ, SMALL_MODEL
from test_train_sharded import DEEPSEEK, family_of

from eqx_longctx import ShardingSpec, model_family
from eqx_longctx.data import load_datasets, place_batch
from eqx_longctx.nn import _loss as loss_module
from eqx_longctx.nn import chunked_cross_entropy
from eqx_longctx.run import placement_from_flags
from eqx_longctx.train import TrainConfig, loss_fn, make_optimizer, make_train_step
from eqx_longctx.train._step import lower_train_step

VOCAB = 260  # splits over a tensor axis of 2 or 4
LLAMA = model_family("llama").config.from_preset("tiny", vocab_size=VOCAB, **SMALL_MODEL)
TIED = dataclasses.replace(LLAMA, tie_embeddings=True)


def _oracle(hidden, weight, targets, mask):
    """Softmax cross-entropy of the whole logits, float64 NumPy, summed over the mask."""
    logits = np.asarray(hidden, np.float64) @ np.asarray(weight, np.float64)
    top = logits.max(-1, keepdims=True)
    lse = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[..., 0]
    picked = np.take_along_axis(logits, np.asarray(targets)[..., None], -1)[..., 0]
    return float(((lse - picked) * np.asarray(mask)).sum())


def _mesh(shape: dict[str, int], explicit: bool):
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    return jax.make_mesh(tuple(shape.values()), tuple(shape), axis_types=(kind,) * len(shape))


@pytest.mark.parametrize(
    ("shape", "explicit", "chunk"),
    [
        (None, False, 5),
        ({"tensor": 4, "context": 2}, False, 3),
        ({"data": 2, "tensor": 2, "context": 2}, True, None),
        ({"tensor": 2, "context": 4}, True, 64),
    ],
)
def test_equals_numpy_softmax_cross_entropy(shape, explicit, chunk):
    """Vocabulary shards of 260 / 4 = 65 ids: every target shard is hit, the chunks do not
    divide a device's 2 x 16 tokens (padding), and a row of masked tokens counts nothing."""
    rng = np.random.default_rng(0)
    b, s, e = 4, 32, 16
    hidden = rng.normal(size=(b, s, e)).astype(np.float32)
    weight = rng.normal(size=(e, VOCAB)).astype(np.float32) * 2.0
    targets = rng.integers(0, VOCAB, size=(b, s)).astype(np.int32)
    mask = (rng.random((b, s)) < 0.8).astype(np.float32)
    mask[1] = 0.0
    spec = None
    if shape is not None:
        batch_axis = "data" if "data" in shape else None
        spec = ShardingSpec(_mesh(shape, explicit), batch_axis=batch_axis, tensor_axis="tensor")
    total, count = chunked_cross_entropy(
        jnp.asarray(hidden), jnp.asarray(weight), jnp.asarray(targets), jnp.asarray(mask),
        spec=spec, chunk_tokens=chunk,
    )  # fmt: skip
    expected = _oracle(hidden, weight, targets, mask)
    np.testing.assert_allclose(float(total), expected, rtol=2e-6)
    assert float(count) == mask.sum()


@pytest.fixture(scope="module")
def batch_source():
    return load_datasets(None, seq_len=SEQ, max_bytes=100_000, val_fraction=0.1)[0]


def _loss_and_grads(placement, config, batch_source, loss_chunk):
    fam = family_of(config)
    model = placement.build_model(lambda spec: fam.model(config, key=jax.random.key(0), spec=spec))
    batch = place_batch(batch_source.batch(0, 8), placement.spec)
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss(p):
        return loss_fn(eqx.combine(p, static), batch, loss_chunk=loss_chunk)[0]

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return float(value), jax.tree.leaves(grads)


@pytest.mark.parametrize(
    ("devices", "mesh", "config", "chunk"),
    [
        (1, None, LLAMA, 7),
        (1, None, TIED, None),
        (1, None, DEEPSEEK, 24),
        (8, "fsdp=2,context=4", LLAMA, 7),
        (8, "tensor=2,fsdp=2,context=2", TIED, 7),
    ],
)
def test_loss_and_gradients_equal_whole_logits(batch_source, devices, mesh, config, chunk):
    """The trainer's loss in chunks (`7` and `24`: several per device, padded; `None`: the
    automatic one) against the whole logits of the model's call, float32, 1e-6."""
    placement = placement_from_flags(devices, mesh, vocab_size=config.vocab_size)
    whole, whole_grads = _loss_and_grads(placement, config, batch_source, 0)
    chunked, grads = _loss_and_grads(placement, config, batch_source, chunk)
    assert abs(chunked - whole) <= 1e-6 * abs(whole)
    for got, want in zip(grads, whole_grads, strict=True):
        scale = float(jnp.max(jnp.abs(want)))
        assert float(jnp.max(jnp.abs(got - want))) <= 1e-6 * scale + 1e-12


def test_hidden_states_and_head_weight_give_the_logits():
    model = model_family("llama").model(TIED, key=jax.random.key(1))
    tokens = jnp.arange(2 * 16, dtype=jnp.int32).reshape(2, 16) % VOCAB
    hidden = model.hidden_states(tokens)
    assert hidden.shape == (2, 16, TIED.dim)
    logits = jnp.einsum("bse,ev->bsv", hidden, model.head_weight())
    np.testing.assert_allclose(logits, model(tokens), rtol=1e-6, atol=1e-6)


def test_the_automatic_chunk_splits_a_large_vocabulary(monkeypatch):
    """With `LOSS_CHUNK_BYTES` at 8 tokens' logits the automatic chunk is 8 tokens: 64
    tokens in 8 chunks, still equal to the oracle."""
    monkeypatch.setattr(loss_module, "LOSS_CHUNK_BYTES", 8 * VOCAB * 4)
    assert loss_module.loss_chunk_tokens(VOCAB, 64) == 8
    rng = np.random.default_rng(1)
    hidden = rng.normal(size=(2, 32, 8)).astype(np.float32)
    weight = rng.normal(size=(8, VOCAB)).astype(np.float32)
    targets = rng.integers(0, VOCAB, size=(2, 32)).astype(np.int32)
    mask = np.ones((2, 32), np.float32)
    total, _ = chunked_cross_entropy(*map(jnp.asarray, (hidden, weight, targets, mask)))
    np.testing.assert_allclose(float(total), _oracle(hidden, weight, targets, mask), rtol=2e-6)


def test_a_step_at_a_128k_vocabulary_holds_no_whole_logits():
    """One device, 16K tokens, vocabulary 131072: the whole logits are 8 GiB of float32;
    the chunked step's compiled temporaries are smaller than them by far, the whole-logits
    step's larger (measured: 0.49 against 16.2 GiB)."""
    fam = model_family("llama")
    seq, vocab = 16384, 131072
    config = fam.config.from_preset(
        "tiny", vocab_size=vocab, max_seq_len=seq, dim=64, n_layers=1, n_heads=4,
        n_kv_heads=2, hidden_dim=128,
    )  # fmt: skip
    placement = placement_from_flags(1, None)
    optimizer = make_optimizer(1e-3, 1, 10)
    model = placement.abstract_model(
        lambda spec: fam.model(config, key=jax.random.key(0), spec=spec)
    )
    opt_state = placement.abstract_opt_state(optimizer, model)
    batch = placement.abstract_batch(1, seq)
    logits = seq * vocab * 4

    def temp(loss_chunk):
        lowered = lower_train_step(optimizer, model, opt_state, batch, loss_chunk=loss_chunk)
        return lowered.compile().memory_analysis().temp_size_in_bytes

    chunked, whole = temp(None), temp(0)
    assert whole > logits
    assert chunked < logits / 8
    assert whole - chunked >= logits


def test_bad_loss_chunk_is_a_clear_error():
    with pytest.raises(ValueError, match=r"loss_chunk \(--loss-chunk.*got -1"):
        make_train_step(make_optimizer(1e-3, 1, 10), loss_chunk=-1)
    with pytest.raises(ValueError, match="--loss-chunk.*at least 0"):
        TrainConfig(loss_chunk=-1)
    with pytest.raises(ValueError, match=r"an int >= 1\) or None.*got 0"):
        chunked_cross_entropy(
            jnp.zeros((1, 4, 2)), jnp.zeros((2, 3)), jnp.zeros((1, 4), jnp.int32),
            jnp.ones((1, 4)), chunk_tokens=0,
        )  # fmt: skip


def test_shape_mismatch_is_a_clear_error():
    """Our own check (what a caller without runtime type checking meets; under pytest the
    jaxtyping annotations would stop it first)."""
    unchecked = getattr(chunked_cross_entropy, "__wrapped__", chunked_cross_entropy)
    with pytest.raises(ValueError, match=r"weight \[embed, vocab\].*weight \(3, 2\)"):
        unchecked(
            jnp.zeros((1, 4, 2)), jnp.zeros((3, 2)), jnp.zeros((1, 4), jnp.int32),
            jnp.ones((1, 4)),
        )  # fmt: skip
