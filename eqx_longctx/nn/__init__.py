"""Transformer building blocks: norms, RoPE, MLPs, attention layers, layer stacks, and the
checks a model family's config and constructor run.

Every layer keeps an explicit batch axis and takes the sharding spec explicitly.
"""

from .._checks import check_bool as check_bool
from .._checks import check_instance as check_instance
from .._checks import check_int as check_int
from .._checks import check_real as check_real
from .._checks import check_spec as check_spec
from ._attention import SelfAttention as SelfAttention
from ._checks import DTYPES as DTYPES
from ._checks import check_choice as check_choice
from ._checks import check_decoder_config as check_decoder_config
from ._checks import check_fields as check_fields
from ._checks import check_layer_windows as check_layer_windows
from ._checks import check_model_args as check_model_args
from ._checks import check_preset as check_preset
from ._decoder import AbstractDecoder as AbstractDecoder
from ._inputs import check_shapes as check_shapes
from ._inputs import check_token_ids as check_token_ids
from ._inputs import prepare_inputs as prepare_inputs
from ._loss import LOSS_CHUNK_BYTES as LOSS_CHUNK_BYTES
from ._loss import chunked_cross_entropy as chunked_cross_entropy
from ._mla import MultiHeadLatentAttention as MultiHeadLatentAttention
from ._mlp import SwiGLU as SwiGLU
from ._moe import GROUPED_MATMULS as GROUPED_MATMULS
from ._moe import MoE as MoE
from ._moe import check_routing as check_routing
from ._norm import RMSNorm as RMSNorm
from ._rope import AbstractRopeScaling as AbstractRopeScaling
from ._rope import Llama3RopeScaling as Llama3RopeScaling
from ._rope import RoPE as RoPE
from ._rope import RotaryTables as RotaryTables
from ._rope import YarnRopeScaling as YarnRopeScaling
from ._transformer import REMAT_POLICIES as REMAT_POLICIES
from ._transformer import DecoderBlock as DecoderBlock
from ._transformer import LayerStack as LayerStack

__all__ = [
    "LOSS_CHUNK_BYTES",
    "chunked_cross_entropy",
    "check_shapes",
    "check_token_ids",
    "prepare_inputs",
    "REMAT_POLICIES",
    "DTYPES",
    "GROUPED_MATMULS",
    "AbstractDecoder",
    "AbstractRopeScaling",
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
    "check_routing",
    "check_spec",
    "DecoderBlock",
    "LayerStack",
    "Llama3RopeScaling",
    "MoE",
    "MultiHeadLatentAttention",
    "RMSNorm",
    "RoPE",
    "RotaryTables",
    "SelfAttention",
    "SwiGLU",
    "YarnRopeScaling",
]
