"""Attention checks: the Pallas path against the XLA path and the float32 oracle, and a ring
over every local device.

Each case runs through the public `flash_attention(..., impl=...)` (the block contract's
custom VJP, what every strategy calls) and compares `out`, `lse` and the gradients `dq`,
`dk`, `dv` of a loss that depends on both outputs. The oracle is
`eqx_longctx.reference_attention` with a naive logsumexp beside it. Matmuls of float32
inputs run at full float32 precision (`jax.default_matmul_precision("highest")`): TPUs and
GPUs otherwise round them to bfloat16 or TF32 passes, which is a setting, not a bug.
"""

import dataclasses
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from .._layout import from_layout, to_layout
from .._sharding import ShardingSpec
from ..attention import attention, flash_attention, reference_attention, resolve_block_impl
from ._report import Row, rel_err, run_check, tolerance

GRADS = ("dq", "dk", "dv")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Batch, tokens, head dim of the cases on this backend."""

    batch: int
    seq: int
    head_dim: int


def sizes_for(platform: str) -> Sizes:
    """Small on CPU (interpret mode simulates every kernel step); a few blocks on a TPU."""
    return Sizes(2, 2048, 128) if platform in ("tpu", "gpu") else Sizes(1, 256, 64)


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention configuration: a mask and a head layout, at `Sizes`."""

    name: str
    q_heads: int = 2
    kv_heads: int = 2
    window: float | None = None  # fraction of the sequence
    packed: bool = False
    dtype: Any = jnp.float32
    batch: int | None = None  # None: the backend's `Sizes`
    head_dim: int | None = None
    v_head_dim: int | None = None  # None: head_dim

    def sized(self, sizes: Sizes) -> Sizes:
        """The backend's sizes with this case's batch and head dim."""
        return Sizes(self.batch or sizes.batch, sizes.seq, self.head_dim or sizes.head_dim)

    def v_dim(self, sizes: Sizes) -> int:
        return self.v_head_dim or self.sized(sizes).head_dim

    def label(self, sizes: Sizes) -> str:
        dtype = "bf16" if jnp.dtype(self.dtype) == jnp.bfloat16 else "f32"
        own = self.sized(sizes)
        dims = f"d{own.head_dim}" + (f"/{self.v_dim(sizes)}" if self.v_head_dim else "")
        return (f"{self.name} {dtype} b{own.batch} s{own.seq} "
                f"h{self.q_heads}/{self.kv_heads} {dims}")  # fmt: skip

    def window_of(self, sizes: Sizes) -> int | None:
        return None if self.window is None else int(self.window * sizes.seq)


CASES = (
    Case("causal"),
    Case("window", window=0.4),
    Case("packed", packed=True),
    Case("gqa", q_heads=4, kv_heads=1, packed=True, dtype=jnp.bfloat16),
)
BF16, F32 = jnp.bfloat16, jnp.float32
# The kernels' lowering matrix, run: every dtype, with and without segment ids, head dims 64,
# 128, 256 and MLA's 192/128, MHA, GQA and MQA, batch 1 and 2 (each value in several cases).
MATRIX = (
    Case("m-mha", q_heads=2, kv_heads=2, head_dim=64, batch=2),
    Case("m-gqa", q_heads=4, kv_heads=2, head_dim=128, packed=True, dtype=BF16, batch=2),
    Case("m-mqa", q_heads=4, kv_heads=1, head_dim=256, packed=True, batch=1),
    Case("m-mla", q_heads=2, kv_heads=2, head_dim=192, v_head_dim=128, dtype=BF16, batch=2),
    Case("m-mqa-bf16", q_heads=2, kv_heads=1, head_dim=64, packed=True, dtype=BF16, batch=1),
    Case("m-mla-gqa", q_heads=4, kv_heads=2, head_dim=192, v_head_dim=128, packed=True),
    Case("m-mha-bf16", q_heads=2, kv_heads=2, head_dim=256, dtype=BF16, batch=1),
    Case("m-gqa-f32", q_heads=4, kv_heads=2, head_dim=128, batch=2),
)


def implementations(platform: str) -> dict[str, Any]:
    """`{name: block impl}`: the one under test first, then `"xla"` (the comparison).

    On a TPU the Pallas kernels compiled by Mosaic at the generation's default blocks; on a
    CPU the same kernels in TPU interpret mode (VMEM, SMEM, scalar prefetch and DMAs
    simulated) at 128 x 128 blocks; on a GPU whatever `impl="auto"` picks.
    """
    xla = resolve_block_impl("xla", platform=platform)
    if platform == "tpu":
        from ..kernels import PallasBlockImpl

        pallas = cast(PallasBlockImpl, resolve_block_impl("pallas", platform=platform))
        return {f"pallas {pallas.block_q}x{pallas.block_k} mosaic": pallas, "xla": xla}
    if platform == "cpu":
        from ..kernels import PallasBlockImpl

        return {"pallas 128x128 tpu-interpret": PallasBlockImpl(128, 128, pltpu.InterpretParams()),
                "xla": xla}  # fmt: skip
    auto = resolve_block_impl("auto", platform=platform, lowering=False)
    name = "auto=xla" if type(auto) is type(xla) else f"auto={type(auto).__name__}"
    return {name: auto} if name == "auto=xla" else {name: auto, "xla": xla}


def _packed_ids(batch: int, seq: int):
    cuts = [int(seq * f) for f in (0.4, 0.6)]  # three documents, not on block edges
    ids = np.searchsorted(np.asarray(cuts), np.arange(seq), side="right")
    return jnp.asarray(np.broadcast_to(ids, (batch, seq)), jnp.int32)


def make_inputs(case: Case, sizes: Sizes, seed: int = 0):
    """`(q, k, v, segment_ids, w_out, w_lse)`: inputs in the case's dtype and float32 loss
    weights for `out` and `lse`."""
    own = case.sized(sizes)
    b, s, d, dv = own.batch, own.seq, own.head_dim, case.v_dim(sizes)
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    normal = lambda key, *shape: jax.random.normal(key, shape, jnp.float32)  # noqa: E731
    q = normal(keys[0], b, s, case.q_heads, d).astype(case.dtype)
    k = normal(keys[1], b, s, case.kv_heads, d).astype(case.dtype)
    v = normal(keys[2], b, s, case.kv_heads, dv).astype(case.dtype)
    seg = _packed_ids(b, s) if case.packed else None
    w_out = normal(keys[3], b, s, case.q_heads, dv)
    return q, k, v, seg, w_out, normal(keys[4], b, s, case.q_heads)


def oracle_lse(q, k, segment_ids, *, causal: bool, window: int | None):
    """The float32 logsumexp of the scaled visible scores `[batch, seq, q_heads]`, `-inf`
    for a row that sees no key; differentiable (the scores of such a row are zeroed)."""
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    k = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)
    s = jnp.einsum("bshd,bthd->bhst", q, k, precision="highest") / np.sqrt(q.shape[-1])
    i, j = jnp.arange(q.shape[1])[:, None], jnp.arange(k.shape[1])[None, :]
    mask = jnp.ones(s.shape, bool)
    if causal:
        mask &= i >= j
    if window is not None:
        mask &= i - j < window
    if segment_ids is not None:
        mask &= segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    seen = mask.any(-1, keepdims=True)
    s = jnp.where(seen, jnp.where(mask, s, -jnp.inf), 0.0)
    lse = jnp.where(seen[..., 0], jax.nn.logsumexp(s, axis=-1), -jnp.inf)
    return jnp.swapaxes(lse, 1, 2)


def _loss(out, lse, w_out, w_lse):
    finite = jnp.where(jnp.isneginf(lse), 0.0, lse)
    return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(finite * w_lse)


def outputs_and_grads(fn, q, k, v, w_out, w_lse):
    """`(out, lse, dq, dk, dv)` of `fn(q, k, v) -> (out, lse)`, in one compiled function."""

    def loss(q, k, v):
        out, lse = fn(q, k, v)
        return _loss(out, lse, w_out, w_lse), (out, lse)

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    return (out, lse, *grads)


def _compare(got, want) -> dict[str, float]:
    return {n: rel_err(a, b) for n, a, b in zip(("out", "lse", *GRADS), got, want, strict=True)}


class _Memo:
    """Each implementation's results computed once (or its exception kept and re-raised)."""

    def __init__(self, compute):
        self.compute, self.done = compute, {}

    def __call__(self, key):
        if key not in self.done:
            try:
                self.done[key] = self.compute(key)
            except Exception as e:  # noqa: BLE001 (re-raised for every row that needs it)
                self.done[key] = e
        if isinstance(self.done[key], Exception):
            raise self.done[key]
        return self.done[key]


def case_rows(case: Case, sizes: Sizes, impls: dict[str, Any]) -> list[Row]:
    """Rows for one case: each implementation against the float32 oracle, then the one
    under test against `"xla"`."""
    q, k, v, seg, w_out, w_lse = make_inputs(case, sizes)
    window = case.window_of(sizes)

    def compute(name):
        with jax.default_matmul_precision("highest"):
            if name == "ref":
                qf, kf, vf = (x.astype(jnp.float32) for x in (q, k, v))
                return outputs_and_grads(
                    lambda q, k, v: (
                        reference_attention(q, k, v, window=window, segment_ids=seg),
                        oracle_lse(q, k, seg, causal=True, window=window),
                    ),
                    qf, kf, vf, w_out, w_lse,
                )  # fmt: skip
            return outputs_and_grads(
                lambda q, k, v: flash_attention(
                    q, k, v, q_segment_ids=seg, kv_segment_ids=seg, window=window,
                    impl=impls[name],
                ),
                q, k, v, w_out, w_lse,
            )  # fmt: skip

    results, label, tol = _Memo(compute), case.label(sizes), tolerance(case.dtype)
    rows = [
        run_check(label, name, "f32 ref", tol, lambda n=name: _compare(results(n), results("ref")))
        for name in impls
    ]
    first = next(iter(impls))
    if "xla" in impls and first != "xla":
        rows.append(run_check(label, first, "xla", tol,
                              lambda: _compare(results(first), results("xla"))))  # fmt: skip
    return rows


def ring_implementations(impls: dict[str, Any]) -> dict[str, Any]:
    """The implementation under test (the first of `impls`) for the ring; TPU interpret
    mode becomes Pallas' plain interpreter (`interpret=True`, what `impl="pallas"` runs off
    TPU): TPU interpret mode simulates one chip's memories per device and waits for every
    device at each kernel, so it hangs on a ring whose devices skip different empty hops."""
    from ..kernels import PallasBlockImpl

    name, impl = next(iter(impls.items()))
    if isinstance(impl, PallasBlockImpl) and isinstance(impl.interpret, pltpu.InterpretParams):
        impl = PallasBlockImpl(impl.block_q, impl.block_k, True, impl.max_live_blocks)
        name = f"pallas {impl.block_q}x{impl.block_k} interpret"
    return {name: impl}


def ring_rows(impls: dict[str, Any], sizes: Sizes) -> list[Row]:
    """Ring attention over every local device (a ring of one on one device), zig-zag layout,
    causal, packed, GQA, float32: `out`, `dq`, `dk`, `dv` of `ring_implementations(impls)`
    against the float32 oracle."""
    impls = ring_implementations(impls)
    devices = jax.local_devices()
    n = len(devices)
    mesh = jax.make_mesh((n,), ("context",), devices=devices)
    per_device = sizes.seq if n == 1 else max(128, sizes.seq // 2)
    ring_sizes = Sizes(1, per_device * n, sizes.head_dim)
    case = Case(f"ring of {n} zigzag", q_heads=4, kv_heads=2, packed=True)
    q, k, v, seg, w_out, _ = make_inputs(case, ring_sizes, seed=1)
    label = case.label(ring_sizes)

    def grads(f):
        loss = lambda q, k, v: jnp.sum(f(q, k, v) * w_out)  # noqa: E731
        with jax.default_matmul_precision("highest"):
            return (jax.jit(f)(q, k, v), *jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v))

    def check(impl):
        spec = ShardingSpec(mesh, strategy="ring", load_balance="zigzag", batch_axis=None,
                            impl=impl)  # fmt: skip
        lay = lambda x: to_layout(x, spec, axis=1)  # noqa: E731

        def ring(q, k, v):
            out = attention(lay(q), lay(k), lay(v), spec=spec, segment_ids=lay(seg))
            return from_layout(out, spec, axis=1)

        with jax.set_mesh(mesh):
            got = grads(ring)
        want = grads(lambda q, k, v: reference_attention(q, k, v, segment_ids=seg))
        return {n: rel_err(a, b) for n, a, b in zip(("out", *GRADS), got, want, strict=True)}

    tol = tolerance(jnp.float32)
    return [run_check(label, name, "f32 ref", tol, lambda i=impl: check(i))
            for name, impl in impls.items()]  # fmt: skip
