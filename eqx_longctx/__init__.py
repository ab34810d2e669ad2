"""eqx_longctx: Equinox transformers for very long sequences in JAX."""

from .attention import attention as attention
from .attention import flash_attention as flash_attention
from .attention import reference_attention as reference_attention

__version__ = "0.1.0"
