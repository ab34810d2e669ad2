"""One block contract, several implementations: every strategy gives the same result with
`impl="pallas"` (the TPU kernels, in interpret mode here) as with `impl="xla"`, forward and
backward, and a third implementation written against the contract plugs in without
touching a strategy."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, make_mesh, random_segment_ids

import eqx_longctx as el
from eqx_longctx import ShardingSpec, attention, reference_attention
from eqx_longctx.attention._block import AbstractBlockImpl, BlockOptions

B, S, HQ, HK, D, DV = 2, 256, 4, 2, 16, 8


def _inputs(seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(ks[0], (B, S, HQ, D))
    k = jax.random.normal(ks[1], (B, S, HK, D))
    v = jax.random.normal(ks[2], (B, S, HK, DV))
    ct = jax.random.normal(ks[3], (B, S, HQ, DV))
    return q, k, v, ct, random_segment_ids(ks[4], B, S, max_docs=3)


MESHES = {
    None: None,
    "all_gather": ((2, 2), ("data", "context"), {}),
    "ulysses": ((1, 2), ("data", "context"), {}),
    "ring": ((1, 4), ("data", "context"), {}),
    "usp": ((2, 2), ("ulysses", "context"), dict(ulysses_axis="ulysses", batch_axis=None)),
}
CASES = [  # (strategy, layout, window, packed)
    (None, "none", None, True),
    (None, "none", 40, False),
    ("all_gather", "striped", None, True),
    ("ulysses", "zigzag", 40, True),
    ("ring", "zigzag", None, True),
    ("ring", "none", 40, False),
    ("usp", "zigzag", 60, True),
]


def _run(strategy, layout, window, packed, impl):
    q, k, v, ct, seg = _inputs()
    seg = seg if packed else None
    if strategy is None:
        spec, mesh = None, None

        def f(q, k, v):
            return attention(q, k, v, window=window, segment_ids=seg, impl=impl)
    else:
        shape, names, kw = MESHES[strategy]
        spec = ShardingSpec(make_mesh(shape, names), strategy, layout, impl=impl, **kw)
        lay = lambda x: el.to_layout(x, spec, axis=1)  # noqa: E731
        mesh = spec.mesh

        def f(q, k, v):
            s = None if seg is None else lay(seg)
            out = attention(lay(q), lay(k), lay(v), spec=spec, window=window, segment_ids=s)
            return el.from_layout(out, spec, axis=1)

    loss = lambda q, k, v: jnp.sum(f(q, k, v) * ct)  # noqa: E731
    step = jax.jit(lambda q, k, v: (f(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)))
    if mesh is None:
        return step(q, k, v)
    with jax.set_mesh(mesh):
        return step(q, k, v)


@pytest.mark.parametrize("strategy,layout,window,packed", CASES, ids=str)
def test_pallas_equals_xla_and_the_oracle(strategy, layout, window, packed):
    out_p, grads_p = _run(strategy, layout, window, packed, "pallas")
    out_x, grads_x = _run(strategy, layout, window, packed, "xla")
    q, k, v, _, seg = _inputs()
    ref = reference_attention(q, k, v, window=window, segment_ids=seg if packed else None)
    assert_close(out_p, ref, what="pallas vs oracle")
    assert_close(out_p, out_x, what="pallas vs xla")
    for name, gp, gx in zip("qkv", grads_p, grads_x, strict=True):
        assert_close(gp, gx, what=f"pallas vs xla d{name}")


class DenseBlockImpl(AbstractBlockImpl):
    """A third implementation, written against the contract alone: every score of a block
    materialized (fine for tests), seq-major layouts, masks from positions and segments."""

    def tile_queries(self, q, positions, segment_ids, kv_like, options: BlockOptions):
        return _DenseQueries(q, positions, segment_ids, options)

    def _probs(self, qt, k, kv_pos, kv_seg, lse=None):
        g = qt.q.shape[2] // k.shape[2]
        kr = jnp.repeat(k, g, axis=2).astype(jnp.float32)
        s = jnp.einsum("bshd,bthd->bhst", qt.q.astype(jnp.float32), kr) * qt.options.scale
        mask = jnp.ones(s.shape, bool)
        qp, kp = qt.positions[:, None, :, None], kv_pos[:, None, None, :]
        if qt.options.causal:
            mask &= qp >= kp
        if qt.options.window is not None:
            mask &= qp - kp < qt.options.window
        if qt.segment_ids is not None:
            mask &= qt.segment_ids[:, None, :, None] == kv_seg[:, None, None, :]
        s = jnp.where(mask, s, -jnp.inf)
        if lse is None:
            lse = jax.nn.logsumexp(s, axis=-1)
        safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.where(mask, jnp.exp(s - safe[..., None]), 0.0), lse, g

    def attend(self, qt, k, v, kv_positions, kv_segment_ids):
        p, lse, g = self._probs(qt, k, kv_positions, kv_segment_ids)
        vr = jnp.repeat(v, g, axis=2).astype(jnp.float32)
        return jnp.einsum("bhst,bthd->bshd", p, vr), jnp.swapaxes(lse, 1, 2)

    def attend_backward(self, qt, k, v, kv_positions, kv_segment_ids, dout, lse, delta, dq):
        p, _, g = self._probs(qt, k, kv_positions, kv_segment_ids, jnp.swapaxes(lse, 1, 2))
        vr = jnp.repeat(v, g, axis=2).astype(jnp.float32)
        dout = dout.astype(jnp.float32)
        dp = jnp.einsum("bshd,bthd->bhst", dout, vr)
        ds = p * (dp - jnp.swapaxes(delta, 1, 2)[..., None]) * qt.options.scale
        kr = jnp.repeat(k, g, axis=2).astype(jnp.float32)
        dq = dq + jnp.einsum("bhst,bthd->bshd", ds, kr)
        dk = jnp.einsum("bhst,bshd->bthd", ds, qt.q.astype(jnp.float32))
        dv = jnp.einsum("bhst,bshd->bthd", p, dout)
        fold = lambda x: x.reshape(*x.shape[:2], -1, g, x.shape[-1]).sum(3)  # noqa: E731
        return dq, fold(dk), fold(dv)


class _DenseQueries:
    def __init__(self, q, positions, segment_ids, options):
        self.q, self.positions, self.segment_ids, self.options = q, positions, segment_ids, options
        self.rows = q.shape[:-1]

    def split_q(self, x):
        return x

    split_rows = merge_q = merge_rows = dq = split_q

    def zeros_dq(self):
        return jnp.zeros(self.q.shape, jnp.float32)


@pytest.mark.parametrize("strategy,layout,window,packed", CASES[::2], ids=str)
def test_a_third_implementation_plugs_in(strategy, layout, window, packed):
    out, grads = _run(strategy, layout, window, packed, DenseBlockImpl())
    out_x, grads_x = _run(strategy, layout, window, packed, "xla")
    assert_close(out, out_x, what="dense vs xla")
    for name, g, gx in zip("qkv", grads, grads_x, strict=True):
        assert_close(g, gx, what=f"dense vs xla d{name}")


def test_strategies_do_not_know_the_implementation():
    root = pathlib.Path(el.__file__).parent / "attention"
    for name in ("_all_gather.py", "_ulysses.py", "_ring.py", "_usp.py"):
        text = (root / name).read_text()
        imports = [line for line in text.splitlines() if line.startswith(("from ", "import "))]
        for line in imports:
            assert not any(m in line for m in ("_local", "_tiles", "kernels")), f"{name}: {line}"
        assert "QueryTiles" not in text and "pallas" not in text.lower(), name


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        (dict(impl="cuda"), ValueError, r"one of \('auto', 'xla', 'pallas', 'pallas_gpu'\)"),
        (dict(impl=3), ValueError, "impl must be one of"),
    ],
)
def test_bad_impl_raises(kw, exc, match):
    q = np.ones((1, 8, 2, 4), np.float32)
    with pytest.raises(exc, match=match):
        attention(q, q, q, **kw)


def test_bad_spec_impl_raises():
    mesh = make_mesh((2, 4), ("data", "context"))
    with pytest.raises(ValueError, match="unknown impl 'cuda'"):
        ShardingSpec(mesh, impl="cuda")
    with pytest.raises(TypeError, match="impl must be one of"):
        ShardingSpec(mesh, impl=3)


def test_pallas_rejects_float16():
    q = np.ones((1, 128, 2, 8), np.float16)
    with pytest.raises(ValueError, match="impl='pallas' runs float32 or bfloat16"):
        attention(q, q, q, impl="pallas")


def test_auto_runs_xla_off_tpu_and_keeps_the_kernels_for_a_tpu_lowering():
    """The one resolver: for a caller that drives the block methods itself (decoding,
    `lowering=False`) `"auto"` is the host's implementation; for a program that may be
    lowered elsewhere (attention) it keeps both paths on a host that is not a TPU, as a
    `PlatformChoice`, which is not a block implementation (no contract methods to call);
    the kernels' interpret mode is left to the lowering platform (`interpret=None`); a
    dtype the kernels do not run keeps the XLA path alone; a choice is returned as is."""
    from eqx_longctx.attention import AbstractBlockImpl, PlatformChoice, XlaBlockImpl
    from eqx_longctx.attention import resolve_block_impl as resolve
    from eqx_longctx.kernels import PallasBlockImpl

    assert isinstance(resolve("auto", platform="cpu", lowering=False), XlaBlockImpl)
    both = resolve("auto", platform="cpu")
    assert isinstance(both, PlatformChoice) and not isinstance(both, AbstractBlockImpl)
    assert not hasattr(both, "attend") and not hasattr(both, "tile_queries")
    assert isinstance(both.tpu, PallasBlockImpl) and isinstance(both.default, XlaBlockImpl)
    assert both.tpu.interpret is False
    tpu = resolve("auto", platform="tpu")
    assert isinstance(tpu, PallasBlockImpl) and tpu.interpret is None
    assert resolve("pallas", platform="cpu").interpret is None
    assert isinstance(resolve("auto", platform="cpu", dtype=jnp.float16), XlaBlockImpl)
    assert resolve(both, platform="cpu") is both
    spec = ShardingSpec(make_mesh(*MESHES["ring"][:2]), "ring", "zigzag", impl="xla")
    assert isinstance(resolve(spec=spec), XlaBlockImpl)  # None: the spec's
    with pytest.raises(ValueError, match="impl must be one of"):
        resolve("fast", platform="cpu")


TRACED: list[str] = []


class _Counting(AbstractBlockImpl):
    """An implementation that notes each time its query side is traced, then defers."""

    inner: AbstractBlockImpl
    name: str

    def tile_queries(self, q, positions, segment_ids, kv_like, options):
        TRACED.append(self.name)
        return self.inner.tile_queries(q, positions, segment_ids, kv_like, options)

    def attend(self, qt, k, v, kv_positions, kv_segment_ids):
        return self.inner.attend(qt, k, v, kv_positions, kv_segment_ids)

    def attend_backward(self, qt, k, v, kv_positions, kv_segment_ids, dout, lse, delta, dq):
        return self.inner.attend_backward(
            qt, k, v, kv_positions, kv_segment_ids, dout, lse, delta, dq
        )


@pytest.mark.parametrize("strategy", [None, "ring"])
def test_each_platform_side_is_traced_once_per_shapes(strategy):
    """Two layers of the same shapes under a `PlatformChoice` (what `impl="auto"` is off TPU):
    each side's forward and backward are traced once, not once per layer, and the result
    is the oracle's."""
    from eqx_longctx.attention import PlatformChoice, resolve_block_impl

    impl = PlatformChoice(
        tpu=_Counting(resolve_block_impl("pallas", platform="tpu", interpret=False), "tpu"),
        default=_Counting(resolve_block_impl("xla", platform="cpu"), "default"),
    )
    spec = None
    if strategy is not None:
        shape, names, kw = MESHES[strategy]
        spec = ShardingSpec(make_mesh(shape, names), strategy, "zigzag", impl=impl, **kw)
    q, k, v, ct, _ = _inputs()

    def two_layers(q, k, v, attend):
        first = attend(q, k, v)  # [..., DV]: repeated up to the next layer's head dim D
        return attend(jnp.repeat(first, D // DV, axis=-1), k, v)

    def ours(q, k, v):
        if spec is None:
            return two_layers(q, k, v, lambda q, k, v: attention(q, k, v, impl=impl))
        lay = lambda x: el.to_layout(x, spec, axis=1)  # noqa: E731
        out = two_layers(lay(q), lay(k), lay(v), lambda q, k, v: attention(q, k, v, spec=spec))
        return el.from_layout(out, spec, axis=1)

    def oracle(q, k, v):
        return two_layers(q, k, v, lambda q, k, v: reference_attention(q, k, v))

    def grads(f):
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * ct), (0, 1, 2)))(q, k, v)

    TRACED.clear()
    got = grads(ours)
    # Forward and backward, one trace each per side (the ring's own VJP tiles the queries
    # once per pass too); tracing per layer would double it.
    assert sorted(TRACED) == ["default"] * 2 + ["tpu"] * 2, TRACED
    expected = grads(oracle)
    for g, e in zip(got, expected, strict=True):
        assert_close(g, e)


def test_pallas_block_sizes_are_validated():
    q = np.ones((1, 256, 2, 8), np.float32)
    with pytest.raises(ValueError, match="block_q must be a positive multiple of 128"):
        el.flash_attention(q, q, q, impl="pallas", block_q=100)
    out, lse = el.flash_attention(q, q, q, impl="pallas", block_q=128, block_k=256)
    assert_close(out, reference_attention(q, q, q))


def test_an_unhashable_configuration_is_traced_each_call():
    """`per_platform`'s cache needs a hashable configuration; one that is not (a list in
    it) runs uncached, with the same result."""
    import functools

    from eqx_longctx.attention import XlaBlockImpl
    from eqx_longctx.attention._block import _staged

    xla = XlaBlockImpl()
    staged = _staged(lambda impl, static, x: x + sum(static), xla, [1, 2])
    assert isinstance(staged, functools.partial) and staged(1) == 4
    hashable = _staged(lambda impl, static, x: x + sum(static), xla, (1, 2))
    assert not isinstance(hashable, functools.partial) and int(hashable(1)) == 4
