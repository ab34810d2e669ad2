"""Linear attention: the gated delta rule (Gated DeltaNet, Kimi Delta Attention).

`gated_delta_rule` validates its inputs and runs the chunked parallel form
(`_chunked.py`); `reference_gated_delta_rule` is the plain per-token recurrence the tests
compare with. `short_conv` is the short causal depthwise convolution the layers run
before the rule, with halos between the devices of a sequence split (`_conv.py`).
"""

from ._conv import short_conv as short_conv
from ._gated_delta_rule import gated_delta_rule as gated_delta_rule
from ._reference import reference_gated_delta_rule as reference_gated_delta_rule

__all__ = ["gated_delta_rule", "reference_gated_delta_rule", "short_conv"]
