"""Transformer building blocks: norms, RoPE, MLPs, attention layers, layer stacks.

Every layer keeps an explicit batch axis and takes the sharding spec explicitly.
"""

from ._attention import SelfAttention as SelfAttention
from ._checks import DTYPES as DTYPES
from ._checks import check_decoder_config as check_decoder_config
from ._decoder import AbstractDecoder as AbstractDecoder
from ._inputs import check_shapes as check_shapes
from ._inputs import check_token_ids as check_token_ids
from ._inputs import prepare_inputs as prepare_inputs
from ._mla import DecoupledRoPE as DecoupledRoPE
from ._mla import MultiHeadLatentAttention as MultiHeadLatentAttention
from ._mla import YarnRopeScaling as YarnRopeScaling
from ._mlp import SwiGLU as SwiGLU
from ._moe import MoE as MoE
from ._norm import RMSNorm as RMSNorm
from ._rope import Llama3RopeScaling as Llama3RopeScaling
from ._rope import RoPE as RoPE
from ._transformer import REMAT_POLICIES as REMAT_POLICIES
from ._transformer import DecoderBlock as DecoderBlock
from ._transformer import LayerStack as LayerStack

__all__ = [
    "check_shapes",
    "check_token_ids",
    "prepare_inputs",
    "REMAT_POLICIES",
    "DTYPES",
    "AbstractDecoder",
    "check_decoder_config",
    "DecoderBlock",
    "DecoupledRoPE",
    "LayerStack",
    "Llama3RopeScaling",
    "MoE",
    "MultiHeadLatentAttention",
    "RMSNorm",
    "RoPE",
    "SelfAttention",
    "SwiGLU",
    "YarnRopeScaling",
]
