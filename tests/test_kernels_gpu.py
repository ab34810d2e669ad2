"""The Pallas GPU kernels (`PallasGpuBlockImpl`, Triton lowering) against the float32
oracles of `test_kernels.py` and `test_kernel_variants.py`, which share no code with them.

Here the kernels run in Pallas' interpreter (`interpret=True`); no GPU is needed. Every row
of both kernel tables runs forward and backward through the block contract's custom VJP;
the ring's hop-by-hop calls with global statistics, the four strategies on meshes, decoding
over a heads-major cache and fully masked blocks have their own tests. The CUDA lowering
test lowers the forward and the gradient for `platforms=("cuda",)` on this host and finds
the three Triton kernels in the program (no silent fall-back to XLA), and `impl="auto"` is
resolved for a faked GPU platform.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_kernel_variants as variants
import test_kernels as table
from helpers import assert_close, rel_err
from test_impls import CASES as STRATEGY_CASES
from test_impls import _inputs, _run

import eqx_longctx as el
from eqx_longctx import reference_attention
from eqx_longctx.attention import PlatformChoice, XlaBlockImpl, resolve_block_impl
from eqx_longctx.attention._block import BlockOptions, block_attention
from eqx_longctx.kernels import PallasGpuBlockImpl

INTERPRET = PallasGpuBlockImpl(64, 64, True)
TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2}  # relative to the max


def close(actual, expected, dtype, what):
    err = rel_err(actual, expected)
    assert err <= TOL[jnp.dtype(dtype)], f"{what}: relative error {err:.2e}"


def gpu_block(q, k, v, qp, kp, qs, ks, *, causal, window=None, scale=None, impl=INTERPRET,
              **_):  # fmt: skip
    options = BlockOptions.make(causal, window, scale, q.shape[-1])
    return block_attention(impl, q, k, v, qp, kp, qs, ks, options)


@pytest.mark.parametrize("name", list(table.CASES))
def test_kernel_table_forward_and_grads_match_the_oracle(name):
    """Every row of the TPU kernels' table (causal, ragged, windows, GQA, MQA, MLA, zig-zag,
    shuffled and packed ids, a ring hop, rows that see no key, bfloat16)."""
    case = table.CASES[name]
    dtype = case.get("dtype", jnp.float32)
    q, k, v, qp, kp, qs, ks = table.make_case(case)
    w = table.loss_weights(case)
    kw = table.kwargs(case)
    (out, lse), grads = table.outputs_and_grads(
        lambda q, k, v: gpu_block(q, k, v, qp, kp, qs, ks, **kw), *w, q, k, v
    )
    (ref_out, ref_lse), ref_grads = table.outputs_and_grads(
        lambda q, k, v: table.oracle(q, k, v, qp, kp, qs, ks, **table.oracle_kwargs(case)),
        *w, q, k, v,
    )  # fmt: skip
    assert out.dtype == q.dtype and lse.dtype == jnp.float32
    close(out, ref_out, dtype, "out")
    table.check_lse(lse, ref_lse, jnp.float32)  # float32 in every case
    for n, g, r, x in zip("qkv", grads, ref_grads, (q, k, v), strict=True):
        assert g.dtype == x.dtype and g.shape == x.shape
        close(g, r, dtype, f"d{n}")


@pytest.mark.parametrize("name", list(variants.CASES))
def test_softcap_chunk_window_segments_match_the_oracle(name):
    case = dict(variants.CASES[name])
    opts = {n: case.pop(n, None) for n in ("softcap", "chunk", "window")}
    q, k, v, pos, seg, w_out, w_lse = variants.inputs(**case)
    scale = q.shape[-1] ** -0.5
    options = BlockOptions.make(True, opts["window"], scale, q.shape[-1], opts["softcap"],
                                opts["chunk"])  # fmt: skip
    (out, lse), grads = variants.value_and_grads(
        lambda q, k, v: block_attention(INTERPRET, q, k, v, pos, pos, seg, seg, options),
        w_out, w_lse, q, k, v,
    )  # fmt: skip
    (ref_out, ref_lse), ref_grads = variants.value_and_grads(
        lambda q, k, v: variants.oracle(q, k, v, pos, pos, seg, seg, scale=scale, **opts),
        w_out, w_lse, q, k, v,
    )  # fmt: skip
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(np.asarray(ref_lse))
    variants.check("out", out, ref_out)
    variants.check("lse", np.asarray(lse)[fin], ref_lse[fin])
    for n, g, r in zip("qkv", grads, ref_grads, strict=True):
        variants.check(f"d{n}", g, r)


def test_ring_hops_with_global_statistics():
    """A ring of two hops through the contract's methods with the global `lse` and `delta`
    (`test_kernels.check_ring_of_two`), at hop lengths that are not block multiples, GQA,
    packed documents."""
    case = dict(table.CASES["ring_hop_gqa"], segments=([100, 156], [60, 196]))
    table.check_ring_of_two(INTERPRET, case, (slice(0, 100), slice(100, None)), check=close)


@pytest.mark.parametrize("strategy,layout,window,packed", STRATEGY_CASES[2:], ids=str)
def test_every_strategy_runs_the_gpu_kernels(strategy, layout, window, packed):
    """All-gather, Ulysses, ring and USP on meshes, zig-zag / striped / none, packed and
    windowed, with the GPU kernels as the block: equal to the oracle and to the XLA path,
    forward and backward."""
    out, grads = _run(strategy, layout, window, packed, INTERPRET)
    out_x, grads_x = _run(strategy, layout, window, packed, "xla")
    q, k, v, _, seg = _inputs()
    ref = reference_attention(q, k, v, window=window, segment_ids=seg if packed else None)
    assert_close(out, ref, what="pallas_gpu vs oracle")
    for n, g, gx in zip("qkv", grads, grads_x, strict=True):
        assert_close(g, gx, what=f"pallas_gpu vs xla d{n}")


def test_masked_key_blocks_are_skipped():
    """A NaN in a key block that no query of a query block can see (causally) never reaches
    that block's rows, so the block is skipped, not masked: a masked product would spread
    it (0 * NaN); rows that see it are NaN, as in naive softmax."""
    s = 256
    q, k, v, qp, kp, _, _ = table.make_case(dict(sq=s, sk=s, hq=1, hk=1))
    k_nan, v_nan = k.at[0, 192:].set(jnp.nan), v.at[0, 192:].set(jnp.nan)
    out, _ = gpu_block(q, k_nan, v_nan, qp, kp, None, None, causal=True)
    assert np.isfinite(np.asarray(out[0, :192])).all()  # blocks of 64: rows 0..191 skip it
    assert np.isnan(np.asarray(out[0, 192:])).all()
    ref, _ = table.oracle(q, k, v, qp, kp, None, None, causal=True, window=None,
                          scale=q.shape[-1] ** -0.5)  # fmt: skip
    close(out[0, :192], ref[0, :192], jnp.float32, "rows before the NaN")  # clean inputs


def test_public_flash_attention_names_the_gpu_kernels():
    """`impl="pallas_gpu"` from the public API (interpreted on this CPU host) is the
    oracle, with float16 accepted (the TPU kernels refuse it)."""
    q, k, v, _, seg = _inputs()
    for dtype, factor in ((jnp.float32, 1.0), (jnp.float16, 0.1)):  # float16: 2e-3
        args = (q.astype(dtype), k.astype(dtype), v.astype(dtype))
        out, _ = el.flash_attention(*args, q_segment_ids=seg, kv_segment_ids=seg,
                                    impl="pallas_gpu", block_q=32, block_k=32)  # fmt: skip
        assert out.dtype == dtype
        ref = reference_attention(q, k, v, segment_ids=seg)
        tol_dtype = jnp.float32 if dtype == jnp.float32 else jnp.bfloat16
        assert_close(out.astype(jnp.float32), ref, tol_dtype, factor, what=str(dtype))


def test_auto_picks_the_gpu_kernels_on_a_gpu():
    """The one resolver, with the platform faked as the TPU choice is tested: a GPU gets
    `PallasGpuBlockImpl` compiled (not interpreted), for attention and for decoding, for
    float32, bfloat16 and float16; float64 stays on XLA; a CPU host keeps its TPU/XLA
    choice; `"pallas_gpu"` names the kernels anywhere (interpreted off a GPU)."""
    for lowering in (True, False):
        for dtype in (None, jnp.float32, jnp.bfloat16, jnp.float16):
            impl = resolve_block_impl("auto", platform="gpu", dtype=dtype, lowering=lowering)
            assert isinstance(impl, PallasGpuBlockImpl) and impl.interpret is False
    assert isinstance(resolve_block_impl("auto", platform="gpu", dtype=jnp.float64), XlaBlockImpl)
    assert isinstance(resolve_block_impl("auto", platform="cpu"), PlatformChoice)
    named = resolve_block_impl("pallas_gpu", platform="cpu", pallas_blocks=(100, None))
    assert isinstance(named, PallasGpuBlockImpl) and named.interpret is True
    assert (named.block_q, named.block_k) == (128, 64)
    on_gpu = resolve_block_impl("pallas_gpu", platform="gpu")
    assert isinstance(on_gpu, PallasGpuBlockImpl) and on_gpu.interpret is False


@pytest.mark.parametrize("bad", [dict(block_q=48), dict(block_k=8)])
def test_bad_blocks_raise(bad):
    q = jnp.ones((1, 64, 2, 16))
    impl = PallasGpuBlockImpl(**{"interpret": True, **bad})
    with pytest.raises(ValueError, match="must be a power of two >= 16"):
        el.attention(q, q, q, impl=impl)


def _kernels_in(text: str) -> list[str]:
    return sorted(set(re.findall(r'name = "(flash_gpu_[a-z]+)"', text)))


def _lower_for_cuda(fn, *args):
    """`fn` lowered for CUDA on this host (JAX >= 0.11 needs an abstract GPU device to name
    the target; 0.10 takes the minimum compute capability Triton supports)."""
    lowered = jax.jit(fn).trace(*args)
    try:
        return lowered.lower(lowering_platforms=("cuda",)).as_text()
    except RuntimeError as error:
        if "abstract GPU device" not in str(error):
            raise
    from jax.sharding import AbstractDevice, AbstractMesh  # JAX >= 0.11

    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(  # pyright: ignore
        device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"))  # fmt: skip
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_cuda_lowering_carries_the_kernels_forward_and_gradient():
    """Lowered for CUDA from this CPU host: the forward holds the forward kernel, the
    gradient the dK/dV and dQ kernels, as Triton calls; none is replaced by XLA."""
    impl = PallasGpuBlockImpl(64, 64, False)
    b, s, h, hk, d = 1, 256, 4, 2, 128
    q = jnp.zeros((b, s, h, d), jnp.bfloat16)
    k = jnp.zeros((b, s, hk, d), jnp.bfloat16)
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    seg = jnp.zeros((b, s), jnp.int32)
    options = BlockOptions.make(True, 100, None, d, softcap=30.0, chunk=128)

    def forward(q, k, v):
        return block_attention(impl, q, k, v, pos, pos, seg, seg, options)

    def loss(q, k, v):
        out, lse = forward(q, k, v)
        return out.astype(jnp.float32).sum() + lse.sum()

    fwd = _lower_for_cuda(forward, q, k, k)
    assert _kernels_in(fwd) == ["flash_gpu_forward"]
    grad = _lower_for_cuda(jax.grad(loss, (0, 1, 2)), q, k, k)
    assert _kernels_in(grad) == ["flash_gpu_dkv", "flash_gpu_dq", "flash_gpu_forward"]
    assert grad.count("xla.gpu.triton") + grad.count("triton_kernel_call") == 3
