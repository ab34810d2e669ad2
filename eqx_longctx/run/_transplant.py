"""One model's weights in another model's structure: a model rebuilt from a config that
changes no weight (`--override rope_theta=...` at eval time), or a run that starts from
another run's checkpoint (`--init-run`)."""

from typing import Any

import jax

from ._checkpoints import is_array_or_shape as _is_array


def transplant(weights: Any, target: Any, *, what: str) -> Any:
    """`target` with every array leaf taken from `weights`: the structure and static
    fields (config, RoPE, spec) are `target`'s, the arrays `weights`'.

    **Arguments:**

    - `weights`: the model whose arrays are kept.
    - `target`: a model (or its abstract shape, e.g. from `eqx.filter_eval_shape`) built
      from the config wanted.
    - `what`: what asks for it, for the message (e.g. `"--init-run runs/short"`).

    **Returns:** the model of `target`'s structure holding `weights`' arrays.

    **Raises:** `ValueError` naming `what` and the first weight that differs in path,
    shape or dtype (or a difference in the number of weights).
    """
    old = jax.tree_util.tree_leaves_with_path(weights)
    new = jax.tree_util.tree_leaves_with_path(target)
    if len(old) != len(new):
        raise ValueError(
            f"{what} would change the model's weights: the models hold {len(old)} and "
            f"{len(new)} leaves; only a config that "
            "keeps every weight (rope_theta, rope_scaling, max_seq_len, ...) may differ."
        )
    for (po, x), (pn, y) in zip(old, new, strict=True):
        same = po == pn and (
            not _is_array(x) or (tuple(x.shape), x.dtype) == (tuple(y.shape), y.dtype)
        )
        if not same:
            raise ValueError(
                f"{what} would change the model's weights: {jax.tree_util.keystr(po)} is "
                f"{_shape(x)} but the model wanted has {jax.tree_util.keystr(pn)} "
                f"{_shape(y)}; only a config that keeps "
                "every weight (rope_theta, rope_scaling, max_seq_len, ...) may differ."
            )
    leaves = [x if _is_array(x) else y for (_, x), (_, y) in zip(old, new, strict=True)]
    return jax.tree.unflatten(jax.tree.structure(target), leaves)


def _shape(a: Any) -> str:
    return f"{tuple(a.shape)} {a.dtype}" if _is_array(a) else type(a).__name__
