"""`short_conv` against the convolution written out here in NumPy float64 (forward and
gradients), on one device and split over the sequence: none / zig-zag / striped on
(data 2, context 4) and (context 8), with packed documents that cross device boundaries;
plus the ulysses x context split, a tensor axis over the channels, a kernel longer than
the striped axis, the halo bytes read from the compiled program, and the documented errors.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, make_mesh, need_devices, segment_ids_from_lengths

from eqx_longctx import ShardingSpec, collective_bytes, from_layout, to_layout
from eqx_longctx.linear import short_conv

BATCH, SEQ, CHANNELS = 2, 48, 6
# Boundaries off every piece edge and on some (8 devices x 6; 16 zig-zag chunks x 3), and
# one-token documents.
DOCS = [[5, 1, 13, 6, 23], [18, 1, 1, 28]]


def _silu(z):
    return z / (1.0 + np.exp(-z))


def numpy_conv(x, w, b, seg, activation, ct):
    """The convolution token by token in float64, and the gradients of `sum(out * ct)`:
    `(out, (dx, dw, db))`."""
    x, w, ct = (np.asarray(a, np.float64) for a in (x, w, ct))
    bsz, s, c = x.shape
    kernel = w.shape[1]
    pre = np.zeros((bsz, s, c)) + (0.0 if b is None else np.asarray(b, np.float64))
    sources = {}  # (row, t) -> [(i, src)] of the terms that count
    for r in range(bsz):
        for t in range(s):
            terms = []
            for i in range(kernel):
                src = t - (kernel - 1) + i
                if src < 0 or (
                    seg is not None and any(seg[r, u] != seg[r, t] for u in range(src, t))
                ):
                    continue
                pre[r, t] += w[:, i] * x[r, src]
                terms.append((i, src))
            sources[r, t] = terms
    if activation == "silu":
        sig = 1.0 / (1.0 + np.exp(-pre))
        out, gpre = _silu(pre), ct * sig * (1.0 + pre * (1.0 - sig))
    else:
        out, gpre = pre, ct
    dx, dw = np.zeros_like(x), np.zeros_like(w)
    for (r, t), terms in sources.items():
        for i, src in terms:
            dx[r, src] += w[:, i] * gpre[r, t]
            dw[:, i] += x[r, src] * gpre[r, t]
    return out, (dx, dw, gpre.sum(axis=(0, 1)))


@functools.cache
def inputs(kernel: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(BATCH, SEQ, CHANNELS)).astype(np.float32)
    w = rng.normal(size=(CHANNELS, kernel)).astype(np.float32)
    b = rng.normal(size=(CHANNELS,)).astype(np.float32)
    ct = rng.normal(size=(BATCH, SEQ, CHANNELS)).astype(np.float32)
    return x, w, b, segment_ids_from_lengths(DOCS), ct


def run(spec, x, w, b, seg, ct, activation="silu"):
    """Natural order in and out: lay out, convolve under `spec`, restore the order;
    the output and the gradients of `sum(out * ct)` in `x`, `w`, `b`."""

    def loss(x, w, b):
        if spec is None:
            out = short_conv(x, w, b, activation=activation, segment_ids=seg)
        else:
            lay = lambda a: to_layout(a, spec, axis=1)  # noqa: E731
            out = short_conv(
                lay(x), w, b, activation=activation, segment_ids=None if seg is None else lay(seg),
                spec=spec,
            )  # fmt: skip
            out = from_layout(out, spec, axis=1)
        return jnp.sum(out * ct), out

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    if spec is None:
        (_, out), grads = grad(x, w, b)
    else:
        with jax.set_mesh(spec.mesh):
            (_, out), grads = grad(x, w, b)
    return np.asarray(out), [np.asarray(g) for g in grads]


def check(out, grads, expected, what):
    ref_out, ref_grads = expected
    assert_close(out, ref_out, what=f"{what} forward")
    for name, g, r in zip(("dx", "dw", "db"), grads, ref_grads, strict=True):
        assert_close(g, r, what=f"{what} {name}")


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_one_device(activation, packed):
    x, w, b, seg, ct = inputs()
    seg = seg if packed else None
    out, grads = run(None, x, w, b, seg, ct, activation)
    check(out, grads, numpy_conv(x, w, b, seg, activation, ct), f"{activation}-{packed}")


# name: (mesh shape, mesh axis names, spec keywords)
MESHES = {
    "data2-context4": ((2, 4), ("data", "context"), {}),
    "context8": ((8,), ("context",), {}),
}
CASES = [(m, lb, 4) for m in MESHES for lb in ("none", "zigzag", "striped")]
# K - 1 = 5 >= N = 4: striped predecessors that wrap to the token's own device.
CASES.append(("data2-context4", "striped", 6))


@pytest.mark.parametrize(("mesh", "layout", "kernel"), CASES)
def test_sequence_split(mesh, layout, kernel):
    need_devices(8)
    shape, names, kw = MESHES[mesh]
    spec = ShardingSpec(make_mesh(shape, names), load_balance=layout, **kw)
    x, w, b, seg, ct = inputs(kernel)
    out, grads = run(spec, x, w, b, seg, ct)
    check(out, grads, numpy_conv(x, w, b, seg, "silu", ct), f"{mesh}-{layout}-K{kernel}")


@pytest.mark.parametrize(
    ("shape", "names", "kw"),
    [
        ((2, 4), ("ulysses", "context"), dict(strategy="usp", ulysses_axis="ulysses")),
        ((2, 2, 2), ("data", "context", "tensor"), dict(tensor_axis="tensor")),
    ],
    ids=["ulysses2-context4", "tensor2-channels"],
)
def test_other_axes(shape, names, kw):
    """Two sequence axes (device index ulysses-major), and channels split over a tensor
    axis; zig-zag, packed, with a bias-free convolution."""
    need_devices(8)
    spec = ShardingSpec(make_mesh(shape, names), load_balance="zigzag", batch_axis=None, **kw)
    x, w, b, seg, ct = inputs()
    out, grads = run(spec, x, w, b, seg, ct)
    check(out, grads, numpy_conv(x, w, b, seg, "silu", ct), str(names))


@pytest.mark.parametrize("layout", ["none", "zigzag", "striped"])
def test_collective_bytes(layout):
    """The halo bytes of the docstring, read from the compiled program: per device,
    `(K-1) b c p` contiguous, twice that zig-zag, `(K-1) L b c p` striped, plus the int32
    segment ids; the backward sends the halos' cotangents back and all-reduces `dw`."""
    need_devices(8)
    spec = ShardingSpec(make_mesh((8,), ("context",)), load_balance=layout)
    x, w, _, seg, _ = inputs()
    f = lambda x, w: short_conv(x, w, segment_ids=seg, spec=spec)  # noqa: E731
    grad = jax.grad(lambda x, w: jnp.sum(f(x, w)), argnums=(0, 1))
    with jax.set_mesh(spec.mesh):
        forward = collective_bytes(jax.jit(f).lower(x, w).compile())
        backward = collective_bytes(jax.jit(grad).lower(x, w).compile())
    tokens = {"none": 3, "zigzag": 2 * 3, "striped": 3 * SEQ // 8}[layout]  # K - 1 = 3
    halo, ids = tokens * BATCH * CHANNELS * 4, tokens * BATCH * 4
    assert forward == dict.fromkeys(forward, 0) | {"collective-permute": halo + ids}
    dw = round(2 * 7 / 8 * CHANNELS * 4 * 4)  # an all-reduce over 8 devices of [c, K] f32
    expected = {"collective-permute": 2 * halo + ids, "all-reduce": dw}
    assert backward == dict.fromkeys(backward, 0) | expected


def _saved_floats(f, *args) -> int:
    """Float elements the backward of `f` keeps beyond its arguments (JAX's list of saved
    residuals, `jax.ad_checkpoint.print_saved_residuals`)."""
    import contextlib
    import io
    import math
    import re

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        jax.ad_checkpoint.print_saved_residuals(f, *args)
    total = 0
    for line in text.getvalue().splitlines():
        m = re.match(r"\s*(f\d+)\[([\d,]*)\]\s+(.*)", line)
        if m and "from the argument" not in m.group(3):
            total += math.prod(int(d) for d in m.group(2).split(",") if d)
    return total


@pytest.mark.parametrize("layout", [None, "zigzag", "striped"])
def test_backward_keeps_the_input_not_the_taps(layout):
    """The backward recomputes the K shifted taps and their sum from the input and the
    halos it received: it keeps no float array the size of the input beyond the
    arguments (it kept K + 2 of them before), only the halos under a spec."""
    x, w, _, seg, _ = inputs(4)
    spec = None
    if layout is not None:
        need_devices(8)
        spec = ShardingSpec(make_mesh((8,), ("context",)), load_balance=layout)
        x, seg = to_layout(x, spec, axis=1), to_layout(seg, spec, axis=1)
    f = lambda x, w: jnp.sum(short_conv(x, w, segment_ids=seg, activation="silu", spec=spec))  # noqa: E731
    halos = {None: 0, "zigzag": 2 * 3, "striped": 3 * SEQ // 8}[layout]  # tokens per device
    # Under a spec the residuals are listed per device's shard; the halos: K - 1 = 3 each.
    assert _saved_floats(f, x, w) <= halos * BATCH * CHANNELS * 8


def test_errors():
    need_devices(8)
    x, w, b, seg, _ = inputs()
    with pytest.raises(ValueError, match=r"weight \[channels, K\]"):
        short_conv(x, w.T)
    with pytest.raises(ValueError, match=r"\[batch, seq, channels\]"):
        short_conv(x[0], w)
    with pytest.raises(ValueError, match="activation must be one of"):
        short_conv(x, w, activation="gelu")
    with pytest.raises(ValueError, match=r"bias \[channels\]"):
        short_conv(x, w, b[:3])
    with pytest.raises(TypeError, match="segment_ids must be integers"):
        short_conv(x, w, segment_ids=seg.astype(np.float32))
    with pytest.raises(TypeError, match="floating-point x"):
        short_conv(x.astype(np.int32), w)
    mesh = make_mesh((8,), ("context",))
    for layout, seq in (("none", 16), ("zigzag", 32)):  # 2 tokens per piece < K - 1 = 3
        spec = ShardingSpec(mesh, load_balance=layout)
        with pytest.raises(ValueError, match=r"each of the \d+ pieces needs >= 3 tokens"):
            short_conv(x[:, :seq], w, spec=spec)
    # Striped has no such rule: one token per device.
    spec = ShardingSpec(mesh, load_balance="striped")
    _, _, _, _, ct = inputs()
    out, _ = run(spec, x[:, :8], w, b, None, ct[:, :8])
    assert_close(out, numpy_conv(x[:, :8], w, b, None, "silu", ct[:, :8])[0], what="striped 8")
