"""The light face of the library for model families: what a plugin author (and the zoo in
`models/`) imports to write one.

- the family protocol: `ModelFamily`, its shapes `AttentionShape` and `MoEShape`, and the
  registry (`register_family`, `model_family`, `model_families`, `family_names`,
  `ENTRY_POINT_GROUP`);
- `ShardingSpec`, and `param_shardings` to read a checkpoint's weights into their shards;
- the checks a config and a model constructor run, written once for every family:
  `check_decoder_config`, `check_layer_windows`, `check_fields`, `check_model_args`,
  `check_preset`, `check_choice`, the value checks `check_int`, `check_real`,
  `check_bool`, `check_instance`, `check_spec`, and the names `DTYPES` and
  `REMAT_POLICIES`.

The layers a family builds its model from are in `eqx_longctx.nn`. Importing this module
(or `eqx_longctx.nn`) loads no module of the trainer, inference or the planner: a family
costs its users only what it uses.
"""

from ._checks import check_bool as check_bool
from ._checks import check_instance as check_instance
from ._checks import check_int as check_int
from ._checks import check_real as check_real
from ._checks import check_spec as check_spec
from ._config_checks import DTYPES as DTYPES
from ._config_checks import REMAT_POLICIES as REMAT_POLICIES
from ._config_checks import check_choice as check_choice
from ._config_checks import check_decoder_config as check_decoder_config
from ._config_checks import check_fields as check_fields
from ._config_checks import check_layer_windows as check_layer_windows
from ._config_checks import check_model_args as check_model_args
from ._config_checks import check_preset as check_preset
from ._family import ENTRY_POINT_GROUP as ENTRY_POINT_GROUP
from ._family import AttentionShape as AttentionShape
from ._family import ModelFamily as ModelFamily
from ._family import MoEShape as MoEShape
from ._family import family_names as family_names
from ._family import model_families as model_families
from ._family import model_family as model_family
from ._family import register_family as register_family
from ._partition import param_shardings as param_shardings
from ._sharding import ShardingSpec as ShardingSpec

__all__ = [
    "DTYPES",
    "ENTRY_POINT_GROUP",
    "REMAT_POLICIES",
    "AttentionShape",
    "ModelFamily",
    "MoEShape",
    "ShardingSpec",
    "check_bool",
    "check_choice",
    "check_decoder_config",
    "check_fields",
    "check_instance",
    "check_int",
    "check_layer_windows",
    "check_model_args",
    "check_preset",
    "check_real",
    "check_spec",
    "family_names",
    "model_families",
    "model_family",
    "param_shardings",
    "register_family",
]
