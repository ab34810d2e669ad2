"""Linear attention: the gated delta rule (Gated DeltaNet, Kimi Delta Attention).

`gated_delta_rule` validates its inputs and runs the chunked parallel form
(`_chunked.py`; or its chunk work in a Pallas TPU kernel, as `resolve_gated_delta_impl`
decides); `reference_gated_delta_rule` is the plain per-token recurrence the tests
compare with. `short_conv` is the short causal depthwise convolution the layers run
before the rule, with halos between the devices of a sequence split (`_conv.py`).
"""

from ._conv import short_conv as short_conv
from ._gated_delta_rule import gated_delta_rule as gated_delta_rule
from ._gated_delta_rule import resolve_gated_delta_impl as resolve_gated_delta_impl
from ._reference import reference_gated_delta_rule as reference_gated_delta_rule

__all__ = [
    "gated_delta_rule",
    "reference_gated_delta_rule",
    "resolve_gated_delta_impl",
    "short_conv",
]
