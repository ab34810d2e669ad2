"""Eager input checks for attention: clear errors instead of XLA shape failures.

One function per rule family, shared by `attention`, `latent_attention` and
`flash_attention`; every check runs on shapes and dtypes only, before any tracing.
"""

import jax
import jax.numpy as jnp
import numpy as np

from .._checks import as_int32_ids, check_bool, check_int, check_real, check_spec


def as_float_arrays(where: str, **arrays):
    """Turn array-likes (NumPy arrays, lists, JAX arrays) into JAX arrays of one float dtype.

    Integer or boolean inputs are a `TypeError` (attention on them would silently truncate).
    Mixed float dtypes are promoted to their common dtype (`jnp.result_type`), which is also
    the dtype of the output.

    **Returns:** the arrays, in the order given.
    """
    out = {}
    for name, x in arrays.items():
        if not isinstance(x, jax.Array | jax.ShapeDtypeStruct):
            x = jnp.asarray(x)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(
                f"{where} needs floating-point {', '.join(arrays)}; got {name} of dtype "
                f"{x.dtype}. Cast with .astype(jnp.float32) (or bfloat16): integer inputs "
                "would be silently truncated."
            )
        out[name] = x
    dtype = jnp.result_type(*(x.dtype for x in out.values()))
    return [x if x.dtype == dtype or isinstance(x, jax.ShapeDtypeStruct) else x.astype(dtype)
            for x in out.values()]  # fmt: skip


def as_ids(x, name: str):
    """`None`, or `x` as a JAX array of integer ids (NumPy accepted)."""
    if x is None:
        return None
    if not isinstance(x, jax.Array | jax.ShapeDtypeStruct):
        x = jnp.asarray(as_int32_ids(x, name))
    if not np.issubdtype(x.dtype, np.integer):
        raise ValueError(
            f"{name} must be integers (one id per token); got dtype {x.dtype}. Cast with "
            ".astype(jnp.int32)."
        )
    return x


def check_options(where: str, spec, causal, scale, window=None) -> int | None:
    """The keyword options every attention entry point shares; **returns** the window.

    **Raises:** `TypeError` for a `spec` that is not a `ShardingSpec`, or options of the
    wrong type; `ValueError` for a window below 1, or a window without `causal`.
    """
    check_spec(spec, where)
    check_bool(causal, f"{where}: causal")
    if scale is not None:
        check_real(scale, f"{where}: scale")
    if window is None:
        return None
    window = check_int(window, f"{where}: window", minimum=None)
    if window <= 0:
        raise ValueError(
            f"{where}: window must be >= 1 (query i sees keys j with 0 <= i - j < window); got "
            f"window={window}. Use window=None for full causal attention."
        )
    if not causal:
        raise ValueError(
            f"{where}: a sliding window needs causal=True (query i sees keys j with "
            f"0 <= i - j < window); got window={window} with causal=False. Pass causal=True, "
            "or window=None."
        )
    return window


def check_variants(where: str, causal, softcap, chunk) -> tuple[float | None, int | None]:
    """The softmax variants' options; **returns** `(softcap, chunk)` as float and int.

    **Raises:** `TypeError` for options of the wrong type; `ValueError` for `softcap <= 0`,
    `chunk < 1`, or `chunk` without `causal`.
    """
    if softcap is not None:
        softcap = float(check_real(softcap, f"{where}: softcap"))
        if not softcap > 0 or not np.isfinite(softcap):
            raise ValueError(
                f"{where}: softcap must be a finite number > 0 (scores x become softcap * "
                f"tanh(x / softcap)); got softcap={softcap}. Use softcap=None for no cap."
            )
    if chunk is not None:
        chunk = check_int(chunk, f"{where}: chunk", minimum=None)
        if chunk < 1:
            raise ValueError(
                f"{where}: chunk must be >= 1 (query i sees keys j with i // chunk == j // "
                f"chunk); got chunk={chunk}. Use chunk=None for no chunking."
            )
        if not causal:
            raise ValueError(
                f"{where}: chunked attention needs causal=True (query i sees keys j <= i of "
                f"its own chunk); got chunk={chunk} with causal=False. Pass causal=True, or "
                "chunk=None."
            )
    return softcap, chunk


def check_sinks(where: str, sinks, q_heads: int):
    """`None`, or `sinks` as a float `[q_heads]` JAX array (one learned logit per query
    head, GPT-OSS's attention sinks).

    **Raises:** `TypeError` for a non-float array; `ValueError` for the wrong shape.
    """
    if sinks is None:
        return None
    if not isinstance(sinks, jax.Array | jax.ShapeDtypeStruct):
        sinks = jnp.asarray(sinks)
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise TypeError(
            f"{where}: sinks must be floating point (one learned logit per query head); got "
            f"dtype {sinks.dtype}. Cast with .astype(jnp.float32)."
        )
    if tuple(sinks.shape) != (q_heads,):
        raise ValueError(
            f"{where}: sinks must have shape [q_heads] = ({q_heads},), one logit per query "
            f"head; got shape {tuple(sinks.shape)}."
        )
    return sinks


def check_layout(where: str, **arrays) -> None:
    """Raise `ValueError` unless every one of `arrays` (by name) is of rank 4, laid out
    `[batch, seq, heads, head_dim]`."""
    if all(len(x.shape) == 4 for x in arrays.values()):
        return
    got = ", ".join(f"{name}{tuple(x.shape)}" for name, x in arrays.items())
    raise ValueError(
        f"{where} needs {', '.join(arrays)} of rank 4 laid out [batch, seq, heads, head_dim]; "
        f"got {got}. Add a batch axis (x[None]) or split heads "
        "(einops.rearrange(x, 'b s (h d) -> b s h d', h=...))."
    )


def check_attention_inputs(q, k, v, segment_ids, *, self_attention: bool = True) -> None:
    """Raise `ValueError` naming the rule, the values and the fix for malformed inputs."""
    check_layout("attention", q=q, k=k, v=v)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if 0 in x.shape:
            dims = ("batch", "seq", "heads", "head_dim")
            empty = [d for d, n in zip(dims, x.shape, strict=True) if n == 0]
            raise ValueError(
                f"attention needs non-empty dimensions; got {name} of shape {tuple(x.shape)} "
                f"({', '.join(empty)} = 0). Drop the call for empty inputs."
            )
    bq, sq, hq, dq = q.shape
    bk, sk, hk, dk = k.shape
    bv, sv, hv, _ = v.shape
    if not (bq == bk == bv):
        raise ValueError(f"q, k, v need the same batch size; got q={bq}, k={bk}, v={bv}.")
    if sk != sv or hk != hv:
        raise ValueError(
            "k and v need the same sequence length and number of heads; got "
            f"k{tuple(k.shape)} and v{tuple(v.shape)}."
        )
    if dq != dk:
        raise ValueError(
            f"q and k need the same head_dim (the dot product runs over it); got q head_dim={dq}"
            f" and k head_dim={dk}. Project both to one size (v may differ)."
        )
    if hq % hk != 0:
        raise ValueError(
            f"q_heads must be a multiple of kv_heads (GQA groups query heads over shared K/V "
            f"heads); got q_heads={hq}, kv_heads={hk}. Choose kv_heads among the divisors of "
            f"{hq}."
        )
    if self_attention and sq != sk:
        raise ValueError(
            f"self-attention needs q and k of the same sequence length; got q seq={sq}, k seq={sk}."
        )
    if segment_ids is not None:
        check_token_array(segment_ids, "segment_ids", (bq, sq))


def check_token_array(x, name: str, shape: tuple[int, int]) -> None:
    """A per-token `[batch, seq]` integer array (segment ids, positions)."""
    if tuple(x.shape) != tuple(shape):
        raise ValueError(
            f"{name} must have shape [batch, seq] = {tuple(shape)}; got {tuple(x.shape)}."
        )
    if not np.issubdtype(x.dtype, np.integer):
        raise ValueError(
            f"{name} must be integers (one id per packed document); got dtype {x.dtype}. "
            "Cast with .astype(jnp.int32)."
        )


def check_tensor_heads(spec, q_heads: int, kv_heads: int) -> int:
    """The tensor axis splits the heads (GQA's query and K/V heads; MLA's heads, whose keys
    and values each tensor shard up-projects from the latent): both must divide over it.

    **Returns:** the tensor axis size (1 without one).

    **Raises:** `ValueError` when `q_heads` or `kv_heads` is not divisible by it.
    """
    nt = spec.axis_size(spec.tensor_axis)
    if q_heads % nt or kv_heads % nt:
        raise ValueError(
            f"tensor_axis {spec.tensor_axis!r} has {nt} devices and shards the heads, so "
            f"q_heads and kv_heads must be divisible by {nt}; got q_heads={q_heads}, "
            f"kv_heads={kv_heads}. Use a smaller tensor axis, or tensor_axis=None."
        )
    return nt


def check_spec_inputs(spec, q, k, strategy: str) -> None:
    """Check shapes against a `ShardingSpec` for the strategy that runs (the spec's, or the
    one `"auto"` chose: `resolve_strategy`).

    **Raises:** `ValueError` when the batch does not split over the batch axes, the
    sequence over the layout, the heads over the tensor axis, or (Ulysses, USP) the local
    heads over the all-to-all axis.
    """
    from .._layout import check_sequence_length

    b, s, hq, _ = q.shape
    hk = k.shape[2]
    spec.check_batch(b)
    check_sequence_length(spec, s)
    nt = check_tensor_heads(spec, hq, hk)
    if strategy in ("ulysses", "usp"):
        if strategy == "ulysses":
            axis, n = "+".join(spec.sequence_axes), spec.context_parallel_size
        else:
            axis, n = spec.ulysses_axis, spec.axis_size(spec.ulysses_axis)
        local_heads = hq // nt
        if local_heads % n:
            alt = "use strategy='usp' with a smaller ulysses axis, or 'ring'"
            if strategy == "usp":
                alt = "use a ulysses axis whose size divides the heads, or strategy='ring'"
            raise ValueError(
                f"strategy={strategy!r} over axis {axis!r} (size {n}) needs num_heads "
                f"divisible by {n}, got {local_heads}"
                + (f" (q_heads={hq} over tensor axis of size {nt})" if nt > 1 else "")
                + f": {alt}."
            )
