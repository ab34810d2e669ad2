"""What every decoder of the zoo builds alike outside its layers: the token embedding and
the LM head."""

from typing import Any

import jax


def embed_and_head(
    c: Any, k_embed: jax.Array, k_head: jax.Array, dtype: Any
) -> tuple[jax.Array, jax.Array | None]:
    """The token embedding `[vocab_size, dim]` and the LM head `[dim, vocab_size]` (`None`
    when the config `c` ties it to the embedding), normal with standard deviation
    `c.init_std`, in `dtype`."""
    embed = c.init_std * jax.random.normal(k_embed, (c.vocab_size, c.dim), dtype)
    if c.tie_embeddings:
        return embed, None
    return embed, c.init_std * jax.random.normal(k_head, (c.dim, c.vocab_size), dtype)
