"""The public op: validate eagerly, then run the chunked form (`_chunked.py`).

With `spec=None` the whole sequence is on one device and `chunk_gated_delta` runs once, or
its Pallas twin `eqx_longctx.kernels.pallas_chunk_gated_delta` (`impl`, resolved by
`resolve_gated_delta_impl`, the one place that decides which).
Under a `ShardingSpec` each device summarises its pieces of the sequence as an affine map
of the state they receive, the maps are composed across devices, and each piece is
finished from its true incoming state (`_context_parallel.py`, `_compose.py`).
"""

import functools
from typing import Any, no_type_check

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from .._sharding import ShardingSpec
from ._chunked import chunk_gated_delta, document_starts
from ._context_parallel import check_spec_inputs, context_parallel_gated_delta
from ._validate import check_inputs, check_options


@no_type_check  # validated eagerly, with errors that say what to fix
def gated_delta_rule(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    g: ArrayLike,
    beta: ArrayLike,
    *,
    segment_ids: ArrayLike | None = None,
    initial_state: ArrayLike | None = None,
    scale: float | None = None,
    spec: ShardingSpec | None = None,
    return_state: bool = False,
    chunk: int = 64,
    impl: Any = None,
):
    """Linear attention by the gated delta rule: Gated DeltaNet (a decay per head) and
    Kimi Delta Attention (a decay per key channel).

    Per batch row and head, a state `S` `[dk, dv]` is updated at each token `t`:

    - `S <- diag(exp(g_t)) S` (the decay; `exp(g_t)` is one number for a GDN gate);
    - `S <- S + k_t (beta_t (v_t - S^T k_t))^T` (the delta rule: write the part of `v_t`
      that `S` does not already predict from `k_t`);
    - `o_t = S^T (scale q_t)`.

    This is the recurrence of transformers' `torch_recurrent_gated_delta_rule`
    (`models/qwen3_5`, `models/qwen3_next`) and `recurrent_kimi_delta_attention`
    (`models/kimi_linear`): they too decay the state before reading it, and apply `beta` to
    the difference `v_t - S^T k_t`. Unlike them the op does not L2-normalise `q` and `k`
    (the layers do) and does not repeat grouped heads.

    `S` is zero at each document's first token: a token whose segment id differs from its
    predecessor's. `initial_state`, when given, is the state before token 0; it carries
    into the row's first document only.

    Runs the chunked parallel form (the UT transform of Gated DeltaNet, Yang, Kautz and
    Hatamizadeh, arXiv:2412.06464; per key channel as in Kimi Linear, arXiv:2510.26692): a
    few `chunk x chunk` matmuls per chunk (the unit-triangular system solved by an inverse
    built from doubling blocks), the state passed from chunk to chunk. Decays only appear
    as `exp` of log decays summed over spans of one document, never positive, so strong
    decays (`g = -20` over a chunk of 64) stay finite and weak ones that follow them keep
    their precision. Computes in float32 whatever the input dtype. The backward recomputes
    each chunk and keeps one state per chunk, never one per token.

    **Split over the sequence.** Under a `spec` the inputs are global arrays in the spec's
    token layout (`eqx_longctx.to_layout(x, spec, axis=1)`), as for `attention`; rows split
    over the batch axes, heads over the tensor axis, and the sequence over all the sequence
    axes together (the spec's strategy does not matter here). Each device runs its pieces
    of the sequence once, with the augmented state `[I | 0]` and values `[0 | v]`, which
    gives both the piece's affine summary `S_out = A S_in + B` and outputs that need only
    an einsum with the true incoming state `S_in` (linearity in the state and the values).
    The summaries are composed in natural order by one all-gather (`(N-1) P m` bytes in,
    one collective) or by a log-depth `ppermute` scan (`ceil(log2 N)` rounds of `P m`
    bytes, plus a few states), the cheaper under a latency + bandwidth estimate; `m` is one
    piece's summary, `4 b h dk (dk + dv)` bytes for the device's rows and heads, and `P`
    its pieces (1 contiguous, 2 zig-zag). None of it grows with the sequence. The striped
    layout, whose pieces would be single tokens, is regrouped into contiguous pieces by one
    `all_to_all` of the inputs and one of the outputs, which grow with the sequence. Exact
    gradients by autodiff through the collectives. Details and measured bytes:
    `docs/linear-attention.md`.

    **Arguments:**

    - `q`, `k`: `[batch, seq, heads, dk]`.
    - `v`: `[batch, seq, heads, dv]`.
    - `g`: the log decay, `<= 0`: `[batch, seq, heads]` (GDN) or
      `[batch, seq, heads, dk]` (KDA).
    - `beta`: `[batch, seq, heads]`, the write strength (usually in `(0, 1)`).
    - `segment_ids`: `[batch, seq]` ints; packed documents, each starting from a zero
      state (or `None`: one document per row).
    - `initial_state`: `[batch, heads, dk, dv]`, the state before token 0, or `None` for
      zeros.
    - `scale`: the factor on `q`, default `dk ** -0.5`.
    - `spec`: `None` (one device) or a `ShardingSpec`: every array with a `seq` axis is
      then in the spec's layout, `initial_state` is the state before natural token 0.
    - `return_state`: also return the state after the last token (in natural order:
      token `seq - 1`, wherever the layout puts it).
    - `chunk`: tokens per chunk of the chunked form (default 64; a sequence that is not a
      multiple is padded with tokens that change nothing).
    - `impl`: who does each chunk's work on one device: `None` (the Pallas kernel on a
      TPU where it runs this `chunk` and these head dims, else the XLA path), `"xla"`,
      `"pallas"` (the kernel, compiled on a TPU and interpreted elsewhere; `chunk` a
      multiple of 8) or an `eqx_longctx.kernels.PallasGatedDeltaImpl`; see
      `resolve_gated_delta_impl`. Under a `spec` it runs each device's augmented pass,
      whose values are `dk + dv` wide, so the kernel's rules apply to that width.

    **Returns:** `out` `[batch, seq, heads, dv]` in the promoted dtype of `q`, `k` and `v`
    (NumPy arrays are accepted), in the spec's layout under a spec; with
    `return_state=True`, `(out, final_state)` where `final_state` is
    `[batch, heads, dk, dv]` float32 (replicated over the sequence axes under a spec).

    **Raises:** `TypeError` for non-float `q`, `k`, `v`, `g`, `beta` or `initial_state`,
    non-integer `segment_ids`, a `spec` that is not a `ShardingSpec` or a non-int `chunk`;
    `ValueError` for shapes that disagree, `g` neither `[batch, seq, heads]` nor
    `[batch, seq, heads, dk]`, a positive entry in a concrete `g` (checked when its values
    are known, not under `jax.jit`), an `initial_state` of the wrong shape, `chunk < 1`,
    or under a spec a batch, sequence or head count that its mesh does not split (the
    sequence into `N` shards, `2N` chunks for zig-zag); for `impl` as
    `resolve_gated_delta_impl`, and with the kernel a `chunk` that is not a multiple of 8
    or whose VMEM does not fit.
    """
    where = "gated_delta_rule"
    chunk = check_options(where, spec, return_state, chunk)
    q, k, v, g, beta, segment_ids, initial_state, scale = check_inputs(
        where, q, k, v, g, beta, segment_ids, initial_state, scale
    )
    if spec is None:
        shape = (chunk, q.shape[-1], v.shape[-1], g.ndim == 4)
        run = resolve_gated_delta_impl(impl, shape=shape)
        out, state = _one_device(q, k, v, g, beta, segment_ids, initial_state, scale, chunk, run)
    else:
        # The augmented pass runs values `dk + dv` wide (`_context_parallel.py`).
        shape = (chunk, q.shape[-1], q.shape[-1] + v.shape[-1], g.ndim == 4)
        try:
            run = resolve_gated_delta_impl(impl, shape=shape)
        except ValueError as e:
            raise ValueError(
                f"{where}: under a ShardingSpec each device's pass runs values "
                f"dk + dv = {shape[2]} wide (the affine summary); {e}"
            ) from None
        check_spec_inputs(where, spec, q, v)
        out, state = context_parallel_gated_delta(
            q, k, v, g, beta, segment_ids, initial_state,
            spec=spec, scale=scale, chunk=chunk, return_state=return_state, run=run,
        )  # fmt: skip
    out = out.astype(jnp.result_type(q.dtype, k.dtype, v.dtype))
    return (out, state) if return_state else out


def resolve_gated_delta_impl(
    impl: Any = None,
    *,
    platform: str | None = None,
    shape: tuple[int, int, int, bool] | None = None,
):
    """Which implementation runs the gated delta rule's chunks on one device; the one place
    that decides it, as `eqx_longctx.attention.resolve_block_impl` does for attention.

    **Arguments:**

    - `impl`: `None` (the Pallas kernels on a TPU where they run `shape`, the XLA path
      otherwise), `"xla"`, `"pallas"`, or an `eqx_longctx.kernels.PallasGatedDeltaImpl`.
    - `platform`: the devices' platform for `None`; default the default device's.
    - `shape`: `(chunk, dk, dv, kda)` of the call, checked against the kernels' rules
      (a chunk that is a multiple of 8, VMEM within the budget); `None` checks nothing.

    **Returns:** `"xla"` or a `PallasGatedDeltaImpl` (for `"pallas"`: compiled on a TPU,
    Pallas' interpreter on any other platform, chosen where the program is lowered).

    **Raises:** `ValueError` for any other `impl`, naming the choices; for the kernels
    (`"pallas"` or an instance) a `shape` they do not run, naming the rule and the fix.
    """
    from ..kernels import PallasGatedDeltaImpl

    if impl is None:
        platform = jax.devices()[0].platform if platform is None else platform
        if platform != "tpu":
            return "xla"
        try:
            return resolve_gated_delta_impl("pallas", shape=shape)
        except ValueError:  # the default takes the kernels only where they run
            return "xla"
    if isinstance(impl, str) and impl == "xla":
        return "xla"
    if isinstance(impl, str) and impl == "pallas":
        impl = PallasGatedDeltaImpl()
    if not isinstance(impl, PallasGatedDeltaImpl):
        raise ValueError(
            f"gated_delta_rule: impl must be None, 'xla', 'pallas' or a PallasGatedDeltaImpl; "
            f"got impl={impl!r}. None runs the Pallas kernels on a TPU and the XLA path "
            "elsewhere."
        )
    if shape is not None:
        chunk, dk, dv, kda = shape
        impl.check(chunk=chunk, dk=dk, dv=dv, kda=kda)
    return impl


@functools.partial(jax.jit, static_argnames=("scale", "chunk", "run"))
def _one_device(q, k, v, g, beta, segment_ids, initial_state, scale, chunk, run):
    b, s, h, dk = q.shape
    dv = v.shape[-1]
    if initial_state is None:
        initial_state = jnp.zeros((b, h, dk, dv), jnp.float32)
    starts = document_starts(segment_ids, b, s)
    q, k, v, g, beta, initial_state = (
        x.astype(jnp.float32) for x in (q, k, v, g, beta, initial_state)
    )
    chunks = chunk_gated_delta if run == "xla" else run
    return chunks(q, k, v, g, beta, starts, initial_state, scale=scale, chunk=chunk)
