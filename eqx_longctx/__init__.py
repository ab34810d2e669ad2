"""eqx_longctx: Equinox transformers for very long sequences in JAX.

The attention, the layouts, the sharding and the family registry load with the package;
inference (`generate`, `init_cache`, ...) and the planner (`plan_train_step`) load on first
use, so a family plugin that imports `eqx_longctx.family` or `eqx_longctx.nn` pays for
neither.
"""

import importlib as _importlib
import sys as _sys
import types as _pytypes
from typing import TYPE_CHECKING

from ._caches import clear_caches as clear_caches
from ._family import AttentionShape as AttentionShape
from ._family import ModelFamily as ModelFamily
from ._family import MoEShape as MoEShape
from ._family import family_for_model_type as family_for_model_type
from ._family import family_names as family_names
from ._family import from_hf as from_hf
from ._family import model_families as model_families
from ._family import model_family as model_family
from ._family import register_family as register_family
from ._family import to_hf as to_hf
from ._hlo import collective_bytes as collective_bytes
from ._layout import from_layout as from_layout
from ._layout import layout_order as layout_order
from ._layout import to_layout as to_layout
from ._partition import ShardingRules as ShardingRules
from ._partition import init_sharded as init_sharded
from ._partition import logical_axes as logical_axes
from ._partition import param_bytes_per_device as param_bytes_per_device
from ._partition import param_pspecs as param_pspecs
from ._partition import param_shardings as param_shardings
from ._sharding import ShardingSpec as ShardingSpec
from .attention import Plan as Plan
from .attention import attention as attention
from .attention import choose_strategy as choose_strategy
from .attention import explain as explain
from .attention import flash_attention as flash_attention
from .attention import latent_attention as latent_attention
from .attention import reference_attention as reference_attention
from .linear import gated_delta_rule as gated_delta_rule
from .linear import reference_gated_delta_rule as reference_gated_delta_rule

if TYPE_CHECKING:  # loaded lazily at run time (see `_LAZY`)
    from .inference import KVCache as KVCache
    from .inference import cache_layout as cache_layout
    from .inference import decode_step as decode_step
    from .inference import generate as generate
    from .inference import init_cache as init_cache
    from .inference import prefill as prefill
    from .inference import sample_tokens as sample_tokens
    from .plan import StepPlan as StepPlan
    from .plan import plan_train_step as plan_train_step

__version__ = "0.1.0"

# Names of the heavier subpackages, imported the first time one is asked for.
_LAZY = {
    **dict.fromkeys(
        (
            "KVCache",
            "cache_layout",
            "decode_step",
            "generate",
            "init_cache",
            "prefill",
            "sample_tokens",
        ),
        "inference",
    ),  # fmt: skip
    **dict.fromkeys(("StepPlan", "plan_train_step"), "plan"),
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(_importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


class _Package(_pytypes.ModuleType):
    """This package's module type: `eqx_longctx.generate` stays the function even when the
    command-line module of the same name (`python -m eqx_longctx.generate`) is imported,
    which would otherwise set the package attribute to that module."""

    def __setattr__(self, name: str, value) -> None:
        if name == "generate" and isinstance(value, _pytypes.ModuleType):
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package
