"""Generation from a sequence-sharded KV cache: `init_cache`, `prefill`, `decode_step` and
`generate` (see `docs/inference.md`); `cache_layout`, the cache's geometry decided once;
`lower_prefill` and `lower_decode`, the two programs lowered for abstract arrays."""

from ._cache import KVCache as KVCache
from ._cache import StackCache as StackCache
from ._cache_layout import CacheLayout as CacheLayout
from ._cache_layout import StackLayout as StackLayout
from ._cache_layout import cache_layout as cache_layout

# The generate command's model loaders and flag check, shared with `python -m
# eqx_longctx.eval` (command-line plumbing, not API: not in `__all__`).
from ._cli import _load_hf as cli_load_hf  # noqa: F401
from ._cli import _load_run as cli_load_run  # noqa: F401
from ._cli import main as generate_main
from ._cli import placement_flags as cli_placement_flags  # noqa: F401
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
