"""Linear attention: the gated delta rule (Gated DeltaNet, Kimi Delta Attention).

`gated_delta_rule` validates its inputs and runs the chunked parallel form
(`_chunked.py`; or its chunk work in a Pallas TPU kernel, as `resolve_gated_delta_impl`
decides); `reference_gated_delta_rule` is the plain per-token recurrence the tests
compare with. `short_conv` is the short causal depthwise convolution the layers run
before the rule, with halos between the devices of a sequence split (`_conv.py`).
`gated_delta_step` and `short_conv_step` are one token of each, what a layer runs per
decoded token against its cached state (`_step.py`). `linear_attention_cost` is one
layer's FLOPs, bytes and time under a spec, what the planner prices linear layers with
(`_cost.py`).
"""

from ._conv import short_conv as short_conv
from ._cost import LinearCost as LinearCost
from ._cost import linear_attention_cost as linear_attention_cost
from ._gated_delta_rule import gated_delta_rule as gated_delta_rule
from ._gated_delta_rule import resolve_gated_delta_impl as resolve_gated_delta_impl
from ._reference import reference_gated_delta_rule as reference_gated_delta_rule
from ._step import gated_delta_step as gated_delta_step
from ._step import short_conv_step as short_conv_step

__all__ = [
    "LinearCost",
    "gated_delta_rule",
    "gated_delta_step",
    "linear_attention_cost",
    "reference_gated_delta_rule",
    "resolve_gated_delta_impl",
    "short_conv",
    "short_conv_step",
]
