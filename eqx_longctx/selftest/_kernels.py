"""Kernel checks beyond the oracle comparisons: rows that see no key, two runs bitwise
equal, and (on a TPU) one timing row against JAX's splash attention.

The matrix cases themselves (`_attention.MATRIX`) go through `case_rows` like the named
cases: against the float32 oracle and against the XLA path.
"""

from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from .._timing import best_seconds
from ..attention import flash_attention
from ._attention import GRADS, Case, Sizes, make_inputs, outputs_and_grads
from ._report import CheckFailed, Row, run_check


def empty_rows_row(impls: dict[str, Any], sizes: Sizes) -> Row:
    """Causal attention whose keys sit `s/2 + 1` positions after the queries: queries
    `0..s/2` see no key (whole blocks of them, and one row inside a block that other rows
    see keys from) and must give `out = 0`, `lse = -inf` and `dq = 0` exactly, and the keys
    no query sees (`s/2 - 1` on) get `dk = dv = 0` (the implementation under test)."""
    name, impl = next(iter(impls.items()))
    case = Case("no visible key", q_heads=4, kv_heads=2, dtype=jnp.bfloat16)
    q, k, v, _, w_out, w_lse = make_inputs(case, sizes, seed=2)
    b, s = q.shape[:2]
    q_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    kv_pos = q_pos + s // 2 + 1  # query i sees key j iff i >= j + s/2 + 1

    def check():
        out, lse, dq, dk, dv = outputs_and_grads(
            lambda q, k, v: flash_attention(
                q, k, v, q_positions=q_pos, kv_positions=kv_pos, causal=True, impl=impl
            ),
            q, k, v, w_out, w_lse,
        )  # fmt: skip
        half, unseen = s // 2 + 1, s // 2 - 1  # empty rows [0, half), unseen keys [unseen, s)
        biggest = lambda x: float(jnp.max(jnp.abs(x.astype(jnp.float32))))  # noqa: E731
        errors = {
            "out": biggest(out[:, :half]),
            "dq": biggest(dq[:, :half]),
            "dk": biggest(dk[:, unseen:]),
            "dv": biggest(dv[:, unseen:]),
        }
        if biggest(dk[:, :unseen]) == 0.0:
            raise CheckFailed("keys that queries see got no gradient", errors)
        not_inf = int(jnp.sum(lse[:, :half] != -jnp.inf))
        if not_inf:
            raise CheckFailed(f"{not_inf} empty rows have lse other than -inf", errors)
        if not bool(jnp.all(jnp.isfinite(lse[:, half:]))):
            raise CheckFailed("a row that sees keys has a non-finite lse", errors)
        return errors

    return run_check(case.label(sizes), name, "exact", 0.0, check)


def bitwise_row(impls: dict[str, Any], sizes: Sizes) -> Row:
    """The implementation under test run twice on the same inputs (compiled twice):
    `out`, `lse` and the gradients bitwise equal."""
    name, impl = next(iter(impls.items()))
    case = Case("rerun", q_heads=4, kv_heads=2, packed=True, dtype=jnp.bfloat16)
    q, k, v, seg, w_out, w_lse = make_inputs(case, sizes, seed=3)

    def run():
        return outputs_and_grads(
            lambda q, k, v: flash_attention(
                q, k, v, q_segment_ids=seg, kv_segment_ids=seg, causal=True, impl=impl
            ),
            q, k, v, w_out, w_lse,
        )  # fmt: skip

    def check():
        first, second = run(), run()
        names = ("out", "lse", *GRADS)
        differ = [
            n for n, a, b in zip(names, first, second, strict=True)
            if not np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)
        ]  # fmt: skip
        if differ:
            raise CheckFailed(f"not bitwise equal: {', '.join(differ)}")
        return "bitwise equal", ""

    return run_check(case.label(sizes), name, "rerun", None, check)


def splash_timing_row(
    impls: dict[str, Any], seq: int = 8192, heads: int = 8, dim: int = 128,
    interpret: bool = False,
) -> Row:  # fmt: skip
    """On a TPU: forward + backward of causal bfloat16 attention at `seq` tokens, one batch
    row, ours (the implementation under test) and JAX's splash attention at the same
    blocks, in TFLOP/s of the useful (causal) work. Informational: it passes unless one
    side raises. `interpret` runs splash in Pallas' interpreter (a smoke test off TPU)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    name, impl = next(iter(impls.items()))
    keys = jax.random.split(jax.random.PRNGKey(4), 3)
    q, k, v = (jax.random.normal(key, (1, seq, heads, dim), jnp.bfloat16) for key in keys)
    bq, bk = (min(getattr(impl, name, 512), seq) for name in ("block_q", "block_k"))

    @jax.jit
    def ours(q, k, v):
        def loss(q, k, v):
            return jnp.sum(flash_attention(q, k, v, causal=True, impl=impl)[0].astype(jnp.float32))

        return jax.grad(loss, (0, 1, 2))(q, k, v)

    mask = splash.MultiHeadMask([splash.CausalMask((seq, seq))] * heads)
    blocks = splash.BlockSizes(
        block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq, block_kv_dkv=bk,
        block_kv_dkv_compute=bk, block_q_dq=bq, block_kv_dq=bk,
    )  # fmt: skip
    kernel = splash.make_splash_mha_single_device(mask, block_sizes=blocks, interpret=interpret)

    @jax.jit
    def theirs(q, k, v):
        def loss(q, k, v):
            hm = lambda x: jnp.swapaxes(x[0], 0, 1)  # noqa: E731
            out = cast(jax.Array, kernel(hm(q) * dim**-0.5, hm(k), hm(v)))  # no residuals
            return jnp.sum(out.astype(jnp.float32))

        return jax.grad(loss, (0, 1, 2))(q, k, v)

    # forward 2 matmuls, backward 5, over the causal half of the scores
    flops = 7 * 2 * heads * dim * seq * seq / 2

    def check():
        mine, splash_s = best_seconds(ours, q, k, v), best_seconds(theirs, q, k, v)
        a, b = flops / mine / 1e12, flops / splash_s / 1e12
        return f"fwd+bwd {a:.1f} TFLOP/s, splash {b:.1f} ({a / b:.2f}x)", ""

    label = f"timing bf16 causal s{seq} h{heads} d{dim}"
    return run_check(label, name, "splash", None, check)
