"""Linear attention: the gated delta rule (Gated DeltaNet, Kimi Delta Attention).

`gated_delta_rule` validates its inputs and runs the chunked parallel form
(`_chunked.py`); `reference_gated_delta_rule` is the plain per-token recurrence the tests
compare with.
"""

from ._gated_delta_rule import gated_delta_rule as gated_delta_rule
from ._reference import reference_gated_delta_rule as reference_gated_delta_rule

__all__ = ["gated_delta_rule", "reference_gated_delta_rule"]
