"""The softmax variants (sinks, soft-cap, chunked attention) with windows and packed
documents, on one device and under every strategy and layout, forward and gradients of q,
k, v *and the sinks*, against a float32 oracle that writes every rule out in full.

Local layers (a window or a chunk) on the contiguous and zig-zag layouts run by neighbour
exchange (`attention/_halo.py`): the table covers reaches shorter and longer than a piece,
and the compiled programs' bytes are checked against the window's own K/V.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, make_mesh, pairwise_cover, random_segment_ids

from eqx_longctx import ShardingSpec, attention, from_layout, latent_attention, to_layout
from eqx_longctx._hlo import collective_bytes
from eqx_longctx._layout import layout_order
from eqx_longctx.attention import BlockOptions
from eqx_longctx.attention._halo import halo_plan

B, S, D = 2, 64, 8
HEADS = {"gqa": (4, 2), "mha": (4, 4)}
VARIANTS = {  # name: (window, chunk, softcap, sinks, packed)
    "sinks": (None, None, None, True, False),
    "softcap": (None, None, 2.0, False, True),
    "chunk": (None, 24, None, False, False),
    "window-chunk": (12, 24, None, True, True),
    "long-window": (40, None, 3.0, True, False),  # reach over several pieces
    "all": (20, 24, 2.5, True, True),
}
MESHES = {  # name: (shape, axis names, spec keywords)
    "2x4": ((2, 4), ("data", "context"), {}),
    "2x2x2": ((2, 2, 2), ("data", "tensor", "context"), {"tensor_axis": "tensor"}),
}
USP_MESHES = {
    "2x4": ((2, 4), ("ulysses", "context"), {"batch_axis": None, "ulysses_axis": "ulysses"}),
    "2x2x2": ((2, 2, 2), ("data", "ulysses", "context"), {"ulysses_axis": "ulysses"}),
}


def oracle(q, k, v, *, window, chunk, softcap, sinks, segment_ids):
    """Naive float32 attention: every score, every mask rule and the sink column explicit."""
    b, s, h, d = q.shape
    g = h // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    x = jnp.einsum("bshd,bthd->bhst", q, k) / np.sqrt(d)
    if softcap is not None:
        x = softcap * jnp.tanh(x / softcap)
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    mask = j <= i
    if window is not None:
        mask = mask & (i - j < window)
    if chunk is not None:
        mask = mask & (i // chunk == j // chunk)
    mask = jnp.broadcast_to(mask, (b, h, s, s))
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    x = jnp.where(mask, x, -jnp.inf)
    if sinks is not None:
        x = jnp.concatenate([x, jnp.broadcast_to(sinks[None, :, None, None], (b, h, s, 1))], -1)
    p = jax.nn.softmax(x, axis=-1)[..., :s]
    return jnp.einsum("bhst,bthd->bshd", p, v)


@functools.cache
def inputs(heads: str, seed: int = 0):
    hq, hk = HEADS[heads]
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    q = jax.random.normal(ks[0], (B, S, hq, D))
    k = jax.random.normal(ks[1], (B, S, hk, D))
    v = jax.random.normal(ks[2], (B, S, hk, D))
    sinks = jax.random.normal(ks[3], (hq,))
    ct = jax.random.normal(ks[4], (B, S, hq, D))
    return q, k, v, sinks, ct, random_segment_ids(ks[5], B, S, max_docs=3)


def grads_of(f, q, k, v, sinks, ct, mesh=None):
    def loss(q, k, v, sinks):
        out = f(q, k, v, sinks)
        return jnp.sum(out * ct), out

    run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    if mesh is None:
        (_, out), grads = run(q, k, v, sinks)
    else:
        with jax.set_mesh(mesh):
            (_, out), grads = run(q, k, v, sinks)
    return out, grads


@functools.cache
def expected(heads: str, variant: str):
    window, chunk, softcap, use_sinks, packed = VARIANTS[variant]
    q, k, v, sinks, ct, seg = inputs(heads)

    def f(q, k, v, sinks):
        return oracle(
            q, k, v, window=window, chunk=chunk, softcap=softcap,
            sinks=sinks if use_sinks else None, segment_ids=seg if packed else None,
        )  # fmt: skip

    out, grads = grads_of(f, q, k, v, sinks, ct)
    return np.asarray(out), tuple(np.asarray(g) for g in grads)


def check(f, heads, variant, what, mesh=None):
    q, k, v, sinks, ct, _ = inputs(heads)
    out, grads = grads_of(f, q, k, v, sinks, ct, mesh)
    ref_out, ref_grads = expected(heads, variant)
    assert_close(out, ref_out, what=f"{what} out")
    for name, g, r in zip(("q", "k", "v", "sinks"), grads, ref_grads, strict=True):
        if name == "sinks" and not VARIANTS[variant][3]:
            assert float(jnp.abs(g).max()) == 0.0, what
            continue
        assert_close(g, r, what=f"{what} d{name}")
    if VARIANTS[variant][3]:  # a dropped sink gives a zero (or wrong) gradient
        assert float(jnp.abs(grads[3]).min()) > 1e-4, f"{what}: a sink's gradient is zero"


def variant_kwargs(variant, sinks, segment_ids):
    window, chunk, softcap, use_sinks, packed = VARIANTS[variant]
    return dict(
        window=window, chunk=chunk, softcap=softcap, sinks=sinks if use_sinks else None,
        segment_ids=segment_ids if packed else None,
    )  # fmt: skip


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_one_device(variant):
    seg = inputs("gqa")[-1]

    def f(q, k, v, sinks):
        return attention(q, k, v, impl="xla", **variant_kwargs(variant, sinks, seg))

    check(f, "gqa", variant, f"one device {variant}")


def make_spec(strategy: str, mesh_name: str, layout: str) -> ShardingSpec:
    table = USP_MESHES if strategy == "usp" else MESHES
    shape, names, kw = table[mesh_name]
    return ShardingSpec(make_mesh(shape, names), strategy, layout, **kw)


FACTORS = dict(
    strategy=("all_gather", "ulysses", "ring", "usp"),
    mesh=tuple(MESHES),
    layout=("none", "zigzag", "striped"),
    variant=tuple(VARIANTS),
    heads=tuple(HEADS),
)
TABLE = pairwise_cover(
    FACTORS,
    # every strategy with every variant on the zig-zag layout
    seed_rows=[
        dict(strategy=s, mesh=m, layout="zigzag", variant="all", heads="gqa")
        for s, m in (("all_gather", "2x4"), ("ulysses", "2x2x2"), ("ring", "2x4"), ("usp", "2x2x2"))
    ],
)


@pytest.mark.parametrize("row", TABLE, ids=lambda r: "-".join(map(str, r.values())))
def test_context_parallel(row):
    spec = make_spec(row["strategy"], row["mesh"], row["layout"])
    seg = inputs(row["heads"])[-1]
    lay = lambda x: to_layout(x, spec, axis=1)  # noqa: E731

    def f(q, k, v, sinks):
        kw = variant_kwargs(row["variant"], sinks, lay(seg))
        out = attention(lay(q), lay(k), lay(v), spec=spec, impl="xla", **kw)
        return from_layout(out, spec, axis=1)

    check(f, row["heads"], row["variant"], str(row), mesh=spec.mesh)


class _UpProject:
    """MLA-style: keys and values from one latent (a fixed linear map)."""

    def __init__(self, hk):
        ks = jax.random.split(jax.random.PRNGKey(7), 2)
        self.wk = jax.random.normal(ks[0], (D, hk, D)) / np.sqrt(D)
        self.wv = jax.random.normal(ks[1], (D, hk, D)) / np.sqrt(D)

    def __call__(self, latent):
        return (
            jnp.einsum("bsc,ckd->bskd", latent, self.wk),
            jnp.einsum("bsc,ckd->bskd", latent, self.wv),
        )


@pytest.mark.parametrize(
    "strategy,layout,variant",
    [("ring", "zigzag", "all"), ("ring", "none", "long-window"), ("ulysses", "striped", "all")],
)
def test_latent_attention(strategy, layout, variant):
    """MLA: what travels (and what a halo carries) is the latent; K/V are rebuilt locally."""
    spec = make_spec(strategy, "2x4", layout)
    q, _, _, sinks, ct, seg = inputs("gqa")
    up = _UpProject(HEADS["gqa"][1])
    latent = jax.random.normal(jax.random.PRNGKey(3), (B, S, D))
    lay = lambda x: to_layout(x, spec, axis=1)  # noqa: E731
    kw = lambda sinks, seg: variant_kwargs(variant, sinks, seg)  # noqa: E731

    def ours(q, latent, sinks):
        kwargs = kw(sinks, lay(seg))
        out = latent_attention(lay(q), lay(latent), up, spec=spec, impl="xla", **kwargs)
        return from_layout(out, spec, axis=1)

    def ref(q, latent, sinks):
        k, v = up(latent)
        return oracle(q, k, v, **kw(sinks, seg))

    loss = lambda f: lambda *a: jnp.sum(f(*a) * ct)  # noqa: E731
    with jax.set_mesh(spec.mesh):
        got = jax.jit(jax.value_and_grad(loss(ours), argnums=(0, 1, 2)))(q, latent, sinks)
    want = jax.value_and_grad(loss(ref), argnums=(0, 1, 2))(q, latent, sinks)
    names = ("loss", "q", "latent", "sinks")
    for name, g, r in zip(names, (got[0], *got[1]), (want[0], *want[1]), strict=True):
        assert_close(g, r, what=f"MLA {strategy} {layout} {variant} d{name}")


# ---- the neighbour exchange ---------------------------------------------------------------


@pytest.mark.parametrize("layout,pieces", [("none", 1), ("zigzag", 2), ("striped", None)])
def test_halo_plan_by_layout(layout, pieces):
    spec = make_spec("ring", "2x4", layout)
    plan = halo_plan(layout_order(spec, 1024), 4, BlockOptions.make(True, 100, None, D))
    if pieces is None:
        assert plan is None  # striped keeps its ring (with skipped hops)
        return
    assert plan is not None and plan.pieces == pieces
    # 99 keys travel per piece; the buffer is whole 128-slot blocks (no padded key blocks)
    assert plan.halo_len == 128 and plan.tokens_received() == 99 * pieces
    # no window and no chunk: nothing bounds the reach
    assert halo_plan(layout_order(spec, 1024), 4, BlockOptions.make(True, None, None, D)) is None


def test_halo_plan_chunk_fetches_only_what_a_chunk_reaches():
    """Chunks of 256 over contiguous pieces of 128: the first piece of every chunk needs no
    halo, the second the whole first piece (one neighbour, every other device)."""
    spec = ShardingSpec(make_mesh((8,), ("context",)), "ring", "none")
    plan = halo_plan(layout_order(spec, 1024), 8, BlockOptions.make(True, None, None, D, chunk=256))
    assert plan is not None and plan.halo_len == 128 and plan.tokens_received() == 128
    receivers = [d for r in plan.rounds for d, got in enumerate(r.receives) if got]
    assert receivers == [1, 3, 5, 7]


@pytest.mark.parametrize("layout,bound", [("none", 1.5), ("zigzag", 3.0)])
def test_window_layer_moves_about_its_window(layout, bound):
    """A window-256 layer at 16K tokens on 8 devices: the compiled forward, and the compiled
    backward on top of it, each move at most `bound` times the window's own K/V per device
    (the windowed ring sent whole shards: 8x on contiguous, 56x on zig-zag)."""
    mesh = make_mesh((8,), ("context",))
    spec = ShardingSpec(mesh, "ring", layout)
    b, s, hq, hk, d, w = 1, 16384, 2, 1, 64, 256
    q = jax.ShapeDtypeStruct((b, s, hq, d), jnp.float32)
    kv = jax.ShapeDtypeStruct((b, s, hk, d), jnp.float32)
    window_kv = 2 * w * hk * d * 4
    f = lambda q, k, v: attention(q, k, v, spec=spec, window=w, impl="xla")  # noqa: E731
    g = jax.grad(lambda q, k, v: f(q, k, v).sum(), argnums=(0, 1, 2))
    with jax.set_mesh(mesh):
        forward = sum(collective_bytes(jax.jit(f).lower(q, kv, kv).compile()).values())
        both = sum(collective_bytes(jax.jit(g).lower(q, kv, kv).compile()).values())
    assert 0 < forward <= bound * window_kv, (forward, window_kv)
    assert 0 < both - forward <= bound * window_kv, (both - forward, window_kv)


# ---- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(sinks=jnp.zeros((3,))), r"sinks must have shape \[q_heads\] = \(4,\)"),
        (dict(sinks=jnp.zeros((4,), jnp.int32)), "sinks must be floating point"),
        (dict(softcap=0.0), "softcap must be a finite number > 0"),
        (dict(softcap=-1.0), "softcap must be a finite number > 0"),
        (dict(chunk=0), "chunk must be >= 1"),
        (dict(chunk=16, causal=False), "chunked attention needs causal=True"),
    ],
)
def test_bad_variant_options(kwargs, match):
    q, k, v, *_ = inputs("gqa")
    error = TypeError if "floating" in match else ValueError
    with pytest.raises(error, match=match):
        attention(q, k, v, **kwargs)


def test_the_step_planner_shows_what_each_layer_kind_runs():
    """A Gemma-3-style model under ring on zig-zag: its local layers run a neighbour
    exchange of a fraction of the bytes its global layers' ring moves; `explain` says so."""
    from eqx_longctx import model_family
    from eqx_longctx.plan import plan_train_step

    family = model_family("gemma3_text")
    config = family.config.from_preset("gemma-3-4b")
    spec = ShardingSpec(make_mesh((8,), ("context",)), "ring", "zigzag")
    plan = plan_train_step(family, config, spec, batch=1, seq=32768, remats=("full",))
    kinds = {k["window"]: k for k in plan.problem["layers"]}
    local, full = kinds[config.sliding_window], kinds[None]
    assert local["layers"] + full["layers"] == config.n_layers
    assert local["runs"]["ring"]["runs"] == "neighbour exchange"
    assert full["runs"]["ring"]["runs"] == "ring"
    assert local["runs"]["ring"]["comm_train_bytes"] * 4 < full["runs"]["ring"]["comm_train_bytes"]
    assert "local (window/chunk 1024) layers: neighbour exchange" in plan.explain()


def test_explain_prices_a_local_layer_as_its_exchange():
    """`explain`'s ring and all_gather rows of a windowed (or chunked) call on zig-zag price
    the neighbour exchange that runs: the halo's bytes, a note that says so."""
    from eqx_longctx import explain
    from eqx_longctx.attention import plan_attention

    spec = ShardingSpec(make_mesh((8,), ("context",)), "ring", "zigzag")
    shape = dict(batch=1, seq=32768, q_heads=8, kv_heads=4, head_dim=256)
    plan = plan_attention(spec, **shape, window=1024)
    ring = plan.costs["ring"]
    assert ring.reason.startswith("local layer: a neighbour exchange")
    # fwd: two pieces' halos of 1023 tokens' K and V (float32) and their positions
    assert sum(ring.comm_forward.values()) == 2 * 1023 * (4 * 512 * 4 + 4)
    assert "neighbour exchange" in explain(spec, **shape, window=1024)
    # 1024-token chunks: every zig-zag piece (2048 tokens) starts a chunk, nothing moves
    chunked = plan_attention(spec, **shape, chunk=1024).costs["ring"]
    assert chunked.reason.startswith("local layer") and sum(chunked.comm_train.values()) == 0
    full = plan_attention(spec, **shape).costs["ring"]
    assert sum(full.comm_forward.values()) > 10 * sum(ring.comm_forward.values())
