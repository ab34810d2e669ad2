"""Which block implementation runs, and the public single-block `flash_attention`.

`resolve_block_impl` is the one place that decides it, for every caller: `attention`,
`latent_attention` and `flash_attention` (which trace programs that may be lowered for
another platform), and inference's prefill and decode (decode drives the contract's methods
itself, so it asks for an implementation of the host's platform). A third implementation
is added here and nowhere else.
"""

from typing import Any, no_type_check

import jax
import jax.numpy as jnp

from .._checks import check_int
from .._sharding import IMPLS, ShardingSpec
from .._types import AttnOut, LogSumExp
from ._block import AbstractBlockImpl, BlockImpl, BlockOptions, PlatformChoice, block_attention
from ._local import XlaBlockImpl
from ._tiles import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, DEFAULT_TILING, TILE_BYTES, Tiling
from ._validate import (
    as_float_arrays,
    as_ids,
    check_attention_inputs,
    check_options,
    check_token_array,
    check_variants,
)


def check_impl(impl: Any) -> "str | BlockImpl":
    """**Returns:** `impl` when it names a block implementation (one of `IMPLS`), is an
    `AbstractBlockImpl` (a third implementation plugs in so) or a `PlatformChoice` of two.

    **Raises:** `ValueError` otherwise, naming the choices.
    """
    if isinstance(impl, AbstractBlockImpl | PlatformChoice):
        return impl
    if isinstance(impl, str) and impl in IMPLS:
        return impl
    raise ValueError(
        f"impl must be one of {IMPLS} or an AbstractBlockImpl; got impl={impl!r}. 'auto' "
        "runs the Pallas kernels on TPU and GPU and the XLA path elsewhere."
    )


def resolve_block_impl(
    impl: Any = None,
    *,
    spec: ShardingSpec | None = None,
    platform: str | None = None,
    dtype: Any = None,
    tiling: Tiling = DEFAULT_TILING,
    pallas_blocks: tuple[int | None, int | None] = (None, None),
    interpret: bool | None = None,
    lowering: bool = True,
) -> BlockImpl:
    """The block implementation that runs.

    **Arguments:**

    - `impl`: `"xla"`, `"pallas"`, `"pallas_gpu"`, `"auto"`, or an `AbstractBlockImpl` or
      `PlatformChoice` (returned as is); `None` takes the spec's `impl` (`"auto"` without a
      spec).
    - `spec`: the sharding spec, or `None`; its platform is the default `platform`.
    - `platform`: the devices' platform (`"cpu"`, `"tpu"`, `"gpu"`); default the spec's,
      else the default device's.
    - `dtype`: the queries' dtype, when known.
    - `tiling`: the XLA path's block length and score-tile bytes.
    - `pallas_blocks`: the kernels' `(block_q, block_k)`; `None` takes the TPU generation's
      default (the GPU kernels': 64, 64; given ones are rounded up to powers of two there).
    - `interpret`: run Pallas kernels in interpret mode (default: off TPU only).
    - `lowering`: whether the caller traces a program that may be lowered for another
      platform (attention's strategies, through the contract's custom VJPs). Then `"auto"`
      on a host that is not a TPU is a `PlatformChoice` of the Pallas kernels for a TPU and
      the XLA path for any other platform, so a TPU program exported from a CPU host
      carries the kernels while the host runs XLA; for a `dtype` the kernels do not run
      (float16) it is the XLA path alone. With `lowering=False` (decoding, which calls
      the contract's methods itself) `"auto"` is the host platform's implementation.
      On a GPU, `"auto"` is the Pallas GPU kernels (`PallasGpuBlockImpl`) for float32,
      bfloat16 and float16, and the XLA path for other dtypes; the choice is made by the
      host, not at lowering (a CPU host keeps the TPU/XLA choice above).

    **Returns:** an `AbstractBlockImpl`, or a `PlatformChoice` of two.

    **Raises:** `ValueError` as [`check_impl`][].
    """
    if impl is None:
        impl = "auto" if spec is None else spec.impl
    check_impl(impl)
    if isinstance(impl, AbstractBlockImpl | PlatformChoice):
        return impl
    if platform is None:
        platform = jax.devices()[0].platform if spec is None else spec.platform
    if impl == "auto":
        if platform == "tpu":
            impl = "pallas"
        elif platform == "gpu":
            gpu_ok = dtype is None or jnp.dtype(dtype) in _gpu_kernel_dtypes()
            impl = "pallas_gpu" if gpu_ok else "xla"
        elif lowering and (dtype is None or jnp.dtype(dtype) in _kernel_dtypes()):
            # Blocks asked of the path that runs here may be any length; the kernels' must be
            # multiples of the lane width, so the TPU side rounds them up. The TPU side is
            # only ever lowered for a TPU, so its kernels are the compiled ones alone
            # (`interpret=False`): left to choose per platform too, each kernel would be
            # traced twice more in every program this host builds (the ring tests: 115 ->
            # 76 s).
            blocks = tuple(None if b is None else -(-int(b) // 128) * 128 for b in pallas_blocks)
            return PlatformChoice(tpu=_pallas("tpu", False, blocks), default=XlaBlockImpl(tiling))
        else:
            impl = "xla"
    if impl == "xla":
        return XlaBlockImpl(tiling)
    if impl == "pallas_gpu":
        return _pallas_gpu(platform, interpret, pallas_blocks)
    return _pallas(platform, interpret, pallas_blocks)


def _kernel_dtypes():
    from ..kernels import KERNEL_DTYPES

    return KERNEL_DTYPES


def _gpu_kernel_dtypes():
    from ..kernels import GPU_KERNEL_DTYPES

    return GPU_KERNEL_DTYPES


def _pallas_gpu(platform: str, interpret: bool | None, blocks) -> AbstractBlockImpl:
    from ..kernels import PallasGpuBlockImpl, next_power_of_two

    default = PallasGpuBlockImpl.for_platform(platform, interpret=interpret)
    block_q, block_k = (None if b is None else next_power_of_two(b) for b in blocks)
    return PallasGpuBlockImpl(
        default.block_q if block_q is None else block_q,
        default.block_k if block_k is None else block_k,
        default.interpret,
    )


def _pallas(platform: str, interpret: bool | None, blocks) -> AbstractBlockImpl:
    from ..kernels import PallasBlockImpl

    default = PallasBlockImpl.for_platform(platform, interpret=interpret)
    block_q, block_k = blocks
    return PallasBlockImpl(
        default.block_q if block_q is None else block_q,
        default.block_k if block_k is None else block_k,
        default.interpret,
    )


@no_type_check  # validated eagerly, with errors that say what to fix
def flash_attention(
    q,
    k,
    v,
    *,
    q_positions=None,
    kv_positions=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    causal: bool = True,
    window: int | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    impl: str = "auto",
    block_q: int | None = None,
    block_k: int | None = None,
    tile_bytes: int = TILE_BYTES,
) -> tuple[AttnOut, LogSumExp]:
    """Attention of `q` over `k`/`v` with masks computed from positions and segment ids.

    The causal rule is `q_position >= kv_position`, the window rule
    `q_position - kv_position < window`, the segment rule `q_segment == kv_segment`.
    Positions are token indices in the original sequence, so the same function serves any
    token layout and any ring step. Key blocks that no query of a query block can see are
    skipped. Differentiable in `q`, `k`, `v` through a custom backward that recomputes
    scores blockwise (no `seq x seq` residuals); the cotangent of the logsumexp is honoured
    too, which lets callers merge partial results under autodiff.

    **Arguments:**

    - `q`: `[batch, seq, q_heads, head_dim]`.
    - `k`, `v`: `[batch, kv_seq, kv_heads, head_dim]` and `[..., v_head_dim]`.
    - `q_positions`, `kv_positions`: `[batch, seq]` / `[batch, kv_seq]` ints; default
      `0..seq-1` and `0..kv_seq-1`.
    - `q_segment_ids`, `kv_segment_ids`: `[batch, seq]` / `[batch, kv_seq]` ints, or `None`
      (both or neither).
    - `causal`, `window`, `chunk`, `softcap`, `scale`: as in `attention` (sinks join the
      result afterwards: `apply_sinks(out, lse, sinks)`).
    - `impl`: `"auto"` (the Pallas kernels on TPU and GPU, XLA elsewhere), `"xla"`,
      `"pallas"` (TPU kernels) or `"pallas_gpu"` (GPU kernels); on a CPU the kernels run in
      Pallas interpret mode.
    - `block_q`, `block_k`: block lengths (`None`: 512 on the XLA path, the TPU
      generation's default for the kernels, which need multiples of 128).
    - `tile_bytes`: bytes one block of float32 scores may take on the XLA path (heads are
      tiled to fit).

    **Returns:** `(out, lse)`: out `[batch, seq, q_heads, v_head_dim]` in the common dtype
    of `q`, `k`, `v` (mixed float dtypes are promoted) and
    the float32 logsumexp of the scaled scores `[batch, seq, q_heads]`. Rows that see no
    key get `out = 0` and `lse = -inf`.

    **Raises:** `TypeError` for non-float arrays or options of the wrong type; `ValueError`
    for shapes that do not fit together and out-of-range options.
    """
    where = "flash_attention"
    window = check_options(where, None, causal, scale, window)
    softcap, chunk = check_variants(where, causal, softcap, chunk)
    for name, value in (("block_q", block_q), ("block_k", block_k), ("tile_bytes", tile_bytes)):
        if value is not None:
            check_int(value, f"{where}: {name}")
    q, k, v = as_float_arrays(where, q=q, k=k, v=v)
    check_attention_inputs(q, k, v, None, self_attention=False)
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError(
            "flash_attention needs q_segment_ids and kv_segment_ids together (or neither); "
            f"got q_segment_ids={'None' if q_segment_ids is None else 'array'} and "
            f"kv_segment_ids={'None' if kv_segment_ids is None else 'array'}."
        )
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    masks = []
    for name, x, seq in (
        ("q_positions", q_positions, sq),
        ("kv_positions", kv_positions, sk),
        ("q_segment_ids", q_segment_ids, sq),
        ("kv_segment_ids", kv_segment_ids, sk),
    ):
        x = as_ids(x, name)
        if x is not None:
            check_token_array(x, name, (b, seq))
            x = x.astype(jnp.int32)
        elif "positions" in name:
            x = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (b, seq))
        masks.append(x)
    tiling = Tiling(block_q or DEFAULT_BLOCK_Q, tile_bytes, block_k or DEFAULT_BLOCK_K)
    block_impl = resolve_block_impl(
        impl, tiling=tiling, pallas_blocks=(block_q, block_k), dtype=q.dtype
    )
    options = BlockOptions.make(causal, window, scale, q.shape[-1], softcap, chunk)
    with jax.named_scope("flash_attention"):
        return block_attention(block_impl, q, k, v, *masks, options)
