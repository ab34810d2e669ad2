"""Generation from a sequence-sharded KV cache: `init_cache`, `prefill`, `decode_step` and
`generate` (see `docs/inference.md`)."""

from ._cache import KVCache as KVCache
from ._cache import StackCache as StackCache
from ._generate import generate as generate
from ._run import compile_counts as compile_counts
from ._run import decode_step as decode_step
from ._run import init_cache as init_cache
from ._run import prefill as prefill
from ._sampling import sample_tokens as sample_tokens

__all__ = [
    "KVCache",
    "StackCache",
    "compile_counts",
    "decode_step",
    "generate",
    "init_cache",
    "prefill",
    "sample_tokens",
]
