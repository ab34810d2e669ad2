"""Which block implementation runs, and the public single-block `flash_attention`.

`make_impl` turns `impl="auto" | "xla" | "pallas"` into an `AbstractBlockImpl`; it is the one
place that knows the implementations, so a third one is added here and nowhere else.
"""

from typing import no_type_check

import jax
import jax.numpy as jnp

from .._checks import check_int
from .._types import AttnOut, LogSumExp
from ._block import AbstractBlockImpl, BlockOptions, PerPlatform, block_attention, resolve_impl
from ._local import XlaBlockImpl
from ._tiles import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, DEFAULT_TILING, TILE_BYTES, Tiling
from ._validate import (
    as_float_arrays,
    as_ids,
    check_attention_inputs,
    check_options,
    check_token_array,
)


def make_impl(
    impl: "str | AbstractBlockImpl",
    *,
    platform: str,
    tiling: Tiling = DEFAULT_TILING,
    interpret: bool | None = None,
    pallas_blocks: tuple[int | None, int | None] = (None, None),
) -> AbstractBlockImpl:
    """The block implementation `impl` names, for devices of `platform` (`"cpu"`, `"tpu"`...).

    **Arguments:**

    - `impl`: `"xla"`, `"pallas"` or `"auto"` (Pallas on TPU, XLA elsewhere), or an
      `AbstractBlockImpl` instance, returned as is.
    - `platform`: the devices' platform.
    - `tiling`: the XLA path's block length and score-tile bytes.
    - `interpret`: run Pallas kernels in interpret mode (default: off TPU only).
    - `pallas_blocks`: the kernels' `(block_q, block_k)`; `None` takes the TPU generation's
      default.
    """
    name = resolve_impl(impl, platform)
    if isinstance(name, AbstractBlockImpl):
        return name
    if name == "xla":
        return XlaBlockImpl(tiling)
    from ..kernels import PallasBlockImpl

    impl = PallasBlockImpl.for_platform(platform, interpret=interpret)
    block_q, block_k = pallas_blocks
    return PallasBlockImpl(
        impl.block_q if block_q is None else block_q,
        impl.block_k if block_k is None else block_k,
        impl.interpret,
    )


def lowering_impl(
    impl: "str | AbstractBlockImpl",
    *,
    platform: str,
    tiling: Tiling = DEFAULT_TILING,
    pallas_blocks: tuple[int | None, int | None] = (None, None),
    dtype=None,
) -> AbstractBlockImpl:
    """`make_impl`, except that `impl="auto"` on a host that is not a TPU keeps both paths,
    the Pallas kernels for a TPU and the XLA path for any other platform
    (`PerPlatform`), and the one for the platform the program is lowered for runs. So a TPU
    program exported or lowered from a CPU host carries the kernels, while the host itself
    runs the XLA path. On a TPU host `"auto"` is the kernels alone. For queries of a `dtype`
    the kernels do not run (float16), `"auto"` off a TPU is the XLA path alone: tracing the
    kernels' side would refuse the dtype on a host that never runs them."""
    if impl == "auto" and platform != "tpu":
        from ..kernels._impl import KERNEL_DTYPES

        if dtype is not None and jnp.dtype(dtype) not in KERNEL_DTYPES:
            return make_impl("xla", platform=platform, tiling=tiling)
        # Blocks asked of the path that runs here may be any length; the kernels' must be
        # multiples of the lane width, so the TPU side rounds them up.
        bq, bk = (None if b is None else -(-int(b) // 128) * 128 for b in pallas_blocks)
        # The TPU side is only ever lowered for a TPU, so its kernels are the compiled ones
        # alone (`interpret=False`): left to choose per platform too, each kernel would be
        # traced twice more, compiled and interpreted, in every program this host builds
        # (the ring tests: 115 -> 76 s).
        return PerPlatform(
            tpu=make_impl("pallas", platform="tpu", interpret=False, pallas_blocks=(bq, bk)),
            default=make_impl("xla", platform=platform, tiling=tiling),
        )
    return make_impl(impl, platform=platform, tiling=tiling, pallas_blocks=pallas_blocks)


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
    - `causal`, `window`, `scale`: as in `attention`.
    - `impl`: `"auto"` (the Pallas kernels on TPU, XLA elsewhere), `"xla"` or `"pallas"`
      (on a CPU the kernels run in Pallas interpret mode).
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
    platform = jax.devices()[0].platform
    tiling = Tiling(block_q or DEFAULT_BLOCK_Q, tile_bytes, block_k or DEFAULT_BLOCK_K)
    block_impl = lowering_impl(
        impl, platform=platform, tiling=tiling, pallas_blocks=(block_q, block_k), dtype=q.dtype
    )
    options = BlockOptions.make(causal, window, scale, q.shape[-1])
    return block_attention(block_impl, q, k, v, *masks, options)
