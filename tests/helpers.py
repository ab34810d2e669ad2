"""Shared test helpers: tolerances keyed by dtype, relative error, random inputs."""

import importlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np

# Relative tolerances (max abs error / max abs reference), written once.
RTOL = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 2e-2}


def rel_err(actual, expected) -> float:
    """Max absolute difference, relative to the largest reference magnitude."""
    a = np.asarray(jnp.asarray(actual, jnp.float32))
    e = np.asarray(jnp.asarray(expected, jnp.float32))
    return float(np.max(np.abs(a - e)) / (np.max(np.abs(e)) + 1e-30))


def assert_close(actual, expected, dtype=jnp.float32, factor: float = 1.0, what: str = ""):
    tol = RTOL[jnp.dtype(dtype)] * factor
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: relative error {err:.3e} > tolerance {tol:.1e}"


def random_segment_ids(key, batch: int, seq: int, max_docs: int = 4):
    """Sorted random segment ids: packed documents of random lengths in each row."""
    return jnp.sort(jax.random.randint(key, (batch, seq), 0, max_docs), axis=1).astype(jnp.int32)


def pairwise_cover(factors: dict, seed_rows=()) -> list[dict]:
    """Rows (`{factor: value}`) in which every pair of values of every two factors appears.

    Keeps `seed_rows` first, then adds rows of the full product greedily, each covering the
    most pairs not yet covered (ties go to the earliest in product order, so the result is
    the same in every pytest-xdist worker).
    """
    names = list(factors)

    def pairs(row):
        return frozenset((a, row[a], b, row[b]) for a, b in itertools.combinations(names, 2))

    uncovered = {
        (a, x, b, y)
        for a, b in itertools.combinations(names, 2)
        for x in factors[a]
        for y in factors[b]
    }
    rows = [dict(r) for r in seed_rows]
    for row in rows:
        uncovered -= pairs(row)
    candidates = [
        dict(zip(names, values, strict=True)) for values in itertools.product(*factors.values())
    ]
    candidate_pairs = [pairs(row) for row in candidates]
    while uncovered:
        best = max(range(len(candidates)), key=lambda i: len(candidate_pairs[i] & uncovered))
        rows.append(candidates[best])
        uncovered -= candidate_pairs[best]
    return rows


def segment_ids_from_lengths(rows_of_lengths) -> np.ndarray:
    """`int32 [batch, seq]` segment ids of packed rows: document `j` of a row gets id `j`."""
    return np.stack([np.repeat(np.arange(len(ls)), ls) for ls in rows_of_lengths]).astype(np.int32)


def make_mesh(shape: tuple, names: tuple, axes: str = "explicit"):
    """A mesh over the fake CPU devices: `"explicit"` as users build it (`jax.make_mesh`,
    Explicit axes), or `"auto"` (`jax.sharding.Mesh`, Auto axes)."""
    if axes == "explicit":
        return jax.make_mesh(shape, names)
    n = int(np.prod(shape))
    return jax.sharding.Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


def packed_rows(vocab_size: int, batch: int = 4, seq: int = 64, seed: int = 0):
    """Random `(tokens, positions, segment_ids)` int32 rows of up to 3 packed documents
    each, positions restarting at 0 in every document."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab_size, (batch, seq)).astype(np.int32)
    seg = np.sort(rng.integers(1, 4, (batch, seq)), axis=1).astype(np.int32)
    pos = np.zeros_like(seg)
    for r in range(batch):
        for d in np.unique(seg[r]):
            idx = np.flatnonzero(seg[r] == d)
            pos[r, idx] = np.arange(idx.size)
    return tokens, pos, seg


def resolve_dotted(path: str):
    """The object at a dotted path: the longest importable module, then attributes.

    Raises `ImportError` when no prefix imports, `AttributeError` naming the missing one."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no module of {path!r} imports")
