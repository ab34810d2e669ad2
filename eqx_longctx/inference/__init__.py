"""Generation from a sequence-sharded KV cache: `init_cache`, `prefill`, `decode_step` and
`generate` (see `docs/inference.md`); `cache_layout`, the cache's geometry decided once;
`lower_prefill` and `lower_decode`, the two programs lowered for abstract arrays."""

from ._cache import KVCache as KVCache
from ._cache import StackCache as StackCache
from ._cache_layout import CacheLayout as CacheLayout
from ._cache_layout import StackLayout as StackLayout
from ._cache_layout import cache_layout as cache_layout
from ._cli import main as generate_main
from ._generate import generate as generate
from ._lower import lower_decode as lower_decode
from ._lower import lower_prefill as lower_prefill
from ._run import compile_counts as compile_counts
from ._run import decode_step as decode_step
from ._run import init_cache as init_cache
from ._run import prefill as prefill
from ._sampling import sample_tokens as sample_tokens

__all__ = [
    "CacheLayout",
    "KVCache",
    "StackCache",
    "StackLayout",
    "cache_layout",
    "compile_counts",
    "decode_step",
    "generate",
    "generate_main",
    "init_cache",
    "lower_decode",
    "lower_prefill",
    "prefill",
    "sample_tokens",
]
