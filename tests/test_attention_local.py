"""Single-device attention against the naive float32 oracle, forward and gradients."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, random_segment_ids

from eqx_longctx import attention, flash_attention, reference_attention
from eqx_longctx.attention._cost import _flash
from eqx_longctx.attention._tiles import TILE_BYTES, head_tile

# (q_heads, kv_heads): MHA, GQA, MQA
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
# (seq, head_dim, v_head_dim, block): lengths that are and are not block multiples
SHAPES = [(64, 16, 16, 16), (100, 16, 8, 32), (77, 8, 24, 16)]

# The full product of mask x segments x shape (where blocks, padding and masks meet), each
# with one head type, turning so that each head type meets every mask, segmenting and shape
# (the heads only group queries over K/V heads, the same whatever the mask; the full product
# with heads took 24 more cases, ~100 s of one core).
CASES = [
    pytest.param(
        h, c, s, shape, id=f"{h}-{'causal' if c else 'full'}-{'seg' if s else 'noseg'}-{shape[0]}"
    )
    for (i, shape), c, s in itertools.product(enumerate(SHAPES), [True, False], [False, True])
    for h in [tuple(HEADS)[(i + c + 2 * s) % len(HEADS)]]
]


def _inputs(heads, shape, dtype, seed=0):
    hq, hk = HEADS[heads]
    seq, d, dv, _ = shape
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(ks[0], (2, seq, hq, d), dtype)
    k = jax.random.normal(ks[1], (2, seq, hk, d), dtype)
    v = jax.random.normal(ks[2], (2, seq, hk, dv), dtype)
    seg = random_segment_ids(ks[3], 2, seq)
    ct = jax.random.normal(ks[4], (2, seq, hq, dv), jnp.float32)
    return q, k, v, seg, ct


def _ours(causal, seg, block, tile_bytes=TILE_BYTES):
    def f(q, k, v):
        out, _ = flash_attention(
            q,
            k,
            v,
            q_segment_ids=seg,
            kv_segment_ids=seg,
            causal=causal,
            block_q=block,
            block_k=block,
            tile_bytes=tile_bytes,
        )
        return out

    return f


def _oracle(causal, seg):
    return lambda q, k, v: reference_attention(q, k, v, causal=causal, segment_ids=seg)


def _check(f, r, q, k, v, ct, dtype, what):
    assert_close(f(q, k, v), r(q, k, v), dtype, what=f"{what} forward")
    loss = lambda fn: lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * ct)
    ours = jax.grad(loss(f), argnums=(0, 1, 2))(q, k, v)
    ref = jax.grad(loss(r), argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", ours, ref, strict=True):
        assert_close(a, b, dtype, what=f"{what} d{name}")


@pytest.mark.parametrize("heads,causal,segmented,shape", CASES)
def test_float32_against_oracle(heads, causal, segmented, shape):
    q, k, v, seg, ct = _inputs(heads, shape, jnp.float32)
    seg = seg if segmented else None
    f = jax.jit(_ours(causal, seg, shape[3]))
    _check(f, _oracle(causal, seg), q, k, v, ct, jnp.float32, "f32")


# (q_heads, kv_heads, heads per score tile): one K/V head per tile, whole GQA groups, and
# GQA groups split over tiles that share one K/V tile (their dK/dV are added).
HEAD_TILES = [(4, 4, 1), (8, 2, 4), (8, 2, 2), (8, 1, 2), (6, 3, 1)]


@pytest.mark.parametrize("hq,hk,heads_per_tile", HEAD_TILES)
def test_head_tiles_against_oracle(hq, hk, heads_per_tile):
    seq, d, dv, block = 80, 16, 8, 32
    tile_bytes = 2 * heads_per_tile * block * block * 4  # batch 2
    hk_tile, g_tile = head_tile(2, hk, hq // hk, block, block, tile_bytes)
    assert hk_tile * g_tile == heads_per_tile
    ks = jax.random.split(jax.random.PRNGKey(3), 5)
    q = jax.random.normal(ks[0], (2, seq, hq, d))
    k = jax.random.normal(ks[1], (2, seq, hk, d))
    v = jax.random.normal(ks[2], (2, seq, hk, dv))
    seg = random_segment_ids(ks[3], 2, seq)
    ct = jax.random.normal(ks[4], (2, seq, hq, dv))
    f = jax.jit(_ours(True, seg, block, tile_bytes))
    _check(f, _oracle(True, seg), q, k, v, ct, jnp.float32, f"{heads_per_tile}-head tiles")


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("segmented", [False, True])
def test_bfloat16_against_float32_oracle(heads, segmented):
    shape = SHAPES[1]
    q, k, v, seg, ct = _inputs(heads, shape, jnp.bfloat16)
    seg = seg if segmented else None
    f = jax.jit(_ours(True, seg, shape[3]))
    out = f(q, k, v)
    assert out.dtype == jnp.bfloat16
    # The oracle sees the same bf16-rounded inputs, computed in float32.
    up = lambda x: x.astype(jnp.float32)
    r = lambda q, k, v: reference_attention(up(q), up(k), up(v), causal=True, segment_ids=seg)
    _check(f, r, q, k, v, ct, jnp.bfloat16, "bf16")


def test_public_attention_matches_oracle_and_default_scale():
    q, k, v, seg, _ = _inputs("gqa", (96, 16, 16, 0), jnp.float32)
    out = attention(q, k, v, segment_ids=seg)
    assert_close(out, reference_attention(q, k, v, segment_ids=seg), what="attention")
    scaled = attention(q, k, v, causal=False, scale=0.3)
    assert_close(scaled, reference_attention(q, k, v, causal=False, scale=0.3), what="scale")


def test_logsumexp_matches_oracle():
    q, k, v, seg, _ = _inputs("gqa", SHAPES[1], jnp.float32)
    _, lse = flash_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, block_q=32, block_k=32)
    hq, hk = HEADS["gqa"]
    kr = jnp.repeat(k, hq // hk, axis=2)
    s = jnp.einsum("bshd,bthd->bhst", q, kr) / np.sqrt(q.shape[-1])
    n = q.shape[1]
    mask = (jnp.arange(n)[:, None] >= jnp.arange(n)[None]) & (
        seg[:, None, :, None] == seg[:, None, None, :]
    )
    expected = jax.nn.logsumexp(jnp.where(mask, s, -jnp.inf), axis=-1).transpose(0, 2, 1)
    assert_close(lse, expected, what="lse")


def test_logsumexp_cotangent_is_honoured():
    """Merging two halves of the keys by logsumexp must differentiate like the whole."""
    q, k, v, _, ct = _inputs("mha", (64, 8, 8, 16), jnp.float32)

    def merged(q, k, v):
        pos = jnp.broadcast_to(jnp.arange(64), (2, 64))
        parts = [
            flash_attention(
                q,
                k[:, sl],
                v[:, sl],
                q_positions=pos,
                kv_positions=pos[:, sl],
                block_q=16,
                block_k=16,
            )
            for sl in (slice(0, 32), slice(32, 64))
        ]
        (o1, l1), (o2, l2) = parts
        lse = jnp.logaddexp(l1, l2)
        w1 = jnp.where(jnp.isfinite(l1), jnp.exp(l1 - lse), 0.0)[..., None]
        w2 = jnp.where(jnp.isfinite(l2), jnp.exp(l2 - lse), 0.0)[..., None]
        return w1 * o1 + w2 * o2

    _check(jax.jit(merged), _oracle(True, None), q, k, v, ct, jnp.float32, "merged")


def test_fully_masked_rows_are_zero_not_nan():
    q, k, v, _, _ = _inputs("mha", (32, 8, 8, 8), jnp.float32)
    qpos = jnp.zeros((2, 32), jnp.int32)
    kvpos = jnp.full((2, 32), 5, jnp.int32)  # every key is in every query's future
    out, lse = flash_attention(q, k, v, q_positions=qpos, kv_positions=kvpos, block_q=8, block_k=8)
    assert np.all(np.asarray(out) == 0.0)
    assert np.all(np.isneginf(np.asarray(lse)))
    g = jax.grad(lambda q: flash_attention(q, k, v, q_positions=qpos, kv_positions=kvpos)[0].sum())(
        q
    )
    assert np.all(np.isfinite(np.asarray(g)))


def test_causal_blocks_are_skipped():
    """The compiled forward computes about half the score blocks under the causal mask."""
    q, k, v, _, _ = _inputs("mha", (256, 16, 16, 32), jnp.float32)
    calls = []

    def count(empty):
        calls.append(bool(empty))

    from eqx_longctx.attention import _local

    original = _local._block_is_empty

    def spy(*args):
        empty = original(*args)
        jax.debug.callback(count, empty)
        return empty

    _local._block_is_empty = spy
    try:
        flash_attention(q, k, v, block_q=32, block_k=32)[0].block_until_ready()
    finally:
        _local._block_is_empty = original
    n = 256 // 32
    assert len(calls) == n * n
    assert sum(not c for c in calls) == n * (n + 1) // 2


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(q=(2, 8, 6, 4), k=(2, 8, 4, 4), v=(2, 8, 4, 4)), "multiple of kv_heads"),
        (dict(q=(2, 8, 4, 8), k=(2, 8, 2, 4), v=(2, 8, 2, 4)), "same head_dim"),
        (dict(q=(2, 8, 4, 4), k=(2, 8, 2, 4), v=(2, 9, 2, 4)), "same sequence length"),
        (dict(q=(2, 8, 4, 4), k=(3, 8, 2, 4), v=(3, 8, 2, 4)), "same batch size"),
        (dict(q=(8, 4, 4), k=(8, 2, 4), v=(8, 2, 4)), "rank 4"),
    ],
)
def test_bad_shapes_raise(kwargs, match):
    arrays = {n: jnp.zeros(s) for n, s in kwargs.items()}
    with pytest.raises(ValueError, match=match):
        attention(arrays["q"], arrays["k"], arrays["v"])


def test_bad_segment_ids_raise():
    q = jnp.zeros((2, 8, 4, 4))
    with pytest.raises(ValueError, match=r"segment_ids must have shape \[batch, seq\]"):
        attention(q, q, q, segment_ids=jnp.zeros((2, 7), jnp.int32))
    with pytest.raises(ValueError, match="segment_ids must be integers"):
        attention(q, q, q, segment_ids=jnp.zeros((2, 8), jnp.float32))


@pytest.mark.parametrize(
    "tile_bytes", [2**20, TILE_BYTES], ids=["four_head_tiles", "one_head_tile"]
)
def test_remat_recomputes_the_forward_instead_of_storing_scores(tile_bytes):
    """Under `jax.checkpoint` (every LayerStack remat policy but "none") the gradient must
    not store the forward's per-block scores: JAX used to partially evaluate the loops over
    head tiles inside the custom VJP and keep O(seq^2) floats (413 MiB of temporaries at 8K
    tokens, four tiles, against 43 MiB without checkpoint)."""
    s, h = 4096, 4
    q = jax.ShapeDtypeStruct((1, s, h, 64), jnp.float32)
    seg = jax.ShapeDtypeStruct((1, s), jnp.int32)

    def temporaries(checkpoint: bool) -> int:
        def loss(q, k, v, seg):
            def attend(q, k, v):
                out, _ = flash_attention(
                    q, k, v, q_segment_ids=seg, kv_segment_ids=seg, block_q=512, block_k=512,
                    tile_bytes=tile_bytes,
                )  # fmt: skip
                return out

            return (jax.checkpoint(attend) if checkpoint else attend)(q, k, v).sum()

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        return grad.lower(q, q, q, seg).compile().memory_analysis().temp_size_in_bytes

    plain, remat = temporaries(False), temporaries(True)
    scores = s * s * h * 4  # every score of the sequence once, float32
    assert remat < plain + scores // 4, (remat / 2**20, plain / 2**20)


@pytest.mark.parametrize("seq", [4096, 4000])  # whole key blocks, and keys padded to them
def test_forward_reads_keys_and_values_in_place(seq):
    """The forward copies K/V out block by block, not into a block-major copy of the whole:
    its compiled temporaries are what the cost model counts (scores, tiled queries, output,
    and K/V only where padded), not 16 MiB more."""
    q = jax.ShapeDtypeStruct((1, seq, 8, 64), jnp.float32)
    fwd = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=True)[0])
    temp = fwd.lower(q, q, q).compile().memory_analysis().temp_size_in_bytes
    predicted = _flash(1, seq, seq, 8, 8, 64, 64, 4, backward=False)
    assert 0.8 < predicted / temp < 1.2, (predicted / 2**20, temp / 2**20)
