"""The attention planner's public names, gathered from the files that implement them.

- `_tiling_policy.py`: the flash tiles and ring hops the dispatcher uses (`tiling`,
  `ring_hops`).
- `_cost.py`: the cost model of each context-parallel strategy (`StrategyCost`).
- `_choose.py`: `plan`, `choose_strategy`, `explain` and the choice `strategy="auto"` makes.
- `_explain.py`: the `Plan` result and its table.
"""

from ._choose import DEFAULT_MEMORY_BUDGET as DEFAULT_MEMORY_BUDGET
from ._choose import MEMORY_FRACTION as MEMORY_FRACTION
from ._choose import TIE_FRACTION as TIE_FRACTION
from ._choose import choose_strategy as choose_strategy
from ._choose import explain as explain
from ._choose import plan as plan
from ._cost import DEFAULT_BYTES_PER_S as DEFAULT_BYTES_PER_S
from ._cost import DEFAULT_FLOPS_PER_S as DEFAULT_FLOPS_PER_S
from ._cost import STRATEGY_ORDER as STRATEGY_ORDER
from ._cost import StrategyCost as StrategyCost
from ._explain import Plan as Plan
from ._tiling_policy import block_size as block_size
from ._tiling_policy import ring_hops as ring_hops
from ._tiling_policy import tile_bytes as tile_bytes
from ._tiling_policy import tiling as tiling
