"""Eager input checks for attention: clear errors instead of XLA shape failures."""


def check_attention_inputs(q, k, v, segment_ids) -> None:
    """Raise `ValueError` naming the rule, the values and the fix for malformed inputs."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            "attention needs q, k, v of rank 4 laid out [batch, seq, heads, head_dim]; got "
            f"q{tuple(q.shape)}, k{tuple(k.shape)}, v{tuple(v.shape)}. Add a batch axis "
            "(x[None]) or split heads (einops.rearrange(x, 'b s (h d) -> b s h d', h=...))."
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
    if hk == 0 or hq % hk != 0:
        raise ValueError(
            f"q_heads must be a multiple of kv_heads (GQA groups query heads over shared K/V "
            f"heads); got q_heads={hq}, kv_heads={hk}. Choose kv_heads among the divisors of "
            f"{hq}."
        )
    if sq != sk:
        raise ValueError(
            f"self-attention needs q and k of the same sequence length; got q seq={sq}, k seq={sk}."
        )
    if segment_ids is not None:
        if tuple(segment_ids.shape) != (bq, sq):
            raise ValueError(
                f"segment_ids must have shape [batch, seq] = {(bq, sq)}; got "
                f"{tuple(segment_ids.shape)}."
            )
        if not _is_integer(segment_ids.dtype):
            raise ValueError(
                f"segment_ids must be integers (one id per packed document); got dtype "
                f"{segment_ids.dtype}. Cast with .astype(jnp.int32)."
            )


def _is_integer(dtype) -> bool:
    import numpy as np

    return np.issubdtype(dtype, np.integer)


def check_spec_inputs(spec, q, k, segment_ids) -> str:
    """Check shapes against a `ShardingSpec`; return the strategy to run (resolving "auto")."""
    from .._layout import check_sequence_length

    b, s, hq, _ = q.shape
    hk = k.shape[2]
    spec.check_batch(b)
    check_sequence_length(spec, s)
    nt = spec.axis_size(spec.tensor_axis)
    if hq % nt or hk % nt:
        raise ValueError(
            f"tensor_axis {spec.tensor_axis!r} has {nt} devices and shards the heads, so "
            f"q_heads and kv_heads must be divisible by {nt}; got q_heads={hq}, kv_heads={hk}. "
            "Use a smaller tensor axis, or tensor_axis=None."
        )
    strategy = spec.strategy
    if strategy == "auto":
        from ._plan import choose_strategy

        strategy = choose_strategy(spec, q, k).strategy
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
    return strategy
