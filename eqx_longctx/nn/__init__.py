"""Transformer building blocks: norms, RoPE, MLPs, attention layers (softmax, and linear:
Gated DeltaNet, Kimi Delta Attention), layer stacks, the decoder scaffolding and the loss.
(The checks a family's config and constructor run are on `eqx_longctx.family`, the face a
plugin author imports.)

Every layer keeps an explicit batch axis and takes the sharding spec explicitly.
"""

from .._config_checks import REMAT_POLICIES as REMAT_POLICIES
from ._attention import SelfAttention as SelfAttention
from ._decoder import AbstractDecoder as AbstractDecoder
from ._gated_delta_net import GatedDeltaNet as GatedDeltaNet
from ._inputs import check_shapes as check_shapes
from ._inputs import check_token_ids as check_token_ids
from ._inputs import prepare_inputs as prepare_inputs
from ._kimi_delta import KimiDeltaAttention as KimiDeltaAttention
from ._loss import LOSS_CHUNK_BYTES as LOSS_CHUNK_BYTES
from ._loss import check_loss_chunk as check_loss_chunk
from ._loss import chunked_cross_entropy as chunked_cross_entropy
from ._loss import loss_chunk_tokens as loss_chunk_tokens
from ._loss import vocab_axes as vocab_axes
from ._mla import MultiHeadLatentAttention as MultiHeadLatentAttention
from ._mlp import SwiGLU as SwiGLU
from ._moe import GROUPED_MATMULS as GROUPED_MATMULS
from ._moe import ClampedSwiGLU as ClampedSwiGLU
from ._moe import MoE as MoE
from ._moe import check_routing as check_routing
from ._norm import RMSNorm as RMSNorm
from ._rope import AbstractRopeScaling as AbstractRopeScaling
from ._rope import LinearRopeScaling as LinearRopeScaling
from ._rope import Llama3RopeScaling as Llama3RopeScaling
from ._rope import RoPE as RoPE
from ._rope import RotaryTables as RotaryTables
from ._rope import YarnRopeScaling as YarnRopeScaling
from ._transformer import DecoderBlock as DecoderBlock
from ._transformer import LayerStack as LayerStack

__all__ = [
    "LOSS_CHUNK_BYTES",
    "check_loss_chunk",
    "chunked_cross_entropy",
    "loss_chunk_tokens",
    "vocab_axes",
    "check_shapes",
    "check_token_ids",
    "prepare_inputs",
    "REMAT_POLICIES",
    "GROUPED_MATMULS",
    "ClampedSwiGLU",
    "AbstractDecoder",
    "AbstractRopeScaling",
    "check_routing",
    "DecoderBlock",
    "GatedDeltaNet",
    "KimiDeltaAttention",
    "LayerStack",
    "LinearRopeScaling",
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
