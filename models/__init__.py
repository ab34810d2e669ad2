"""The model zoo: `models.llama` (Llama 3 / Mistral / Qwen2 / Qwen3), `models.deepseek`
(DeepSeek-V2/V3, MLA + MoE), `models.kimi_linear` (Kimi Linear: KDA + MLA, MoE) and
`models.qwen3_next` (the `qwen3_next` and `qwen3_5` families: Gated DeltaNet + gated
attention, MoE), each registered as an `eqx_longctx.ModelFamily` plugin under the
`eqx_longctx.models` entry-point group (`eqx_longctx.model_family("llama")`).
`models.llama4` (`llama4_text`: chunked and NoPE attention, MoE) is registered the same way.
`models.gemma` (`gemma2`, `gemma3_text`: local and global layers, soft-caps) is
registered the same way. So is `models.gpt_oss` (`gpt_oss`: attention sinks, sliding and full
layers, MoE)."""

from ._family import DEEPSEEK as DEEPSEEK
from ._family import GEMMA2 as GEMMA2
from ._family import GEMMA3_TEXT as GEMMA3_TEXT
from ._family import GPT_OSS as GPT_OSS
from ._family import KIMI_LINEAR as KIMI_LINEAR
from ._family import LLAMA as LLAMA
from ._family import LLAMA4_TEXT as LLAMA4_TEXT
from ._family import QWEN3_5 as QWEN3_5
from ._family import QWEN3_NEXT as QWEN3_NEXT
from ._family import DeepSeekFamily as DeepSeekFamily
from ._family import Gemma2Family as Gemma2Family
from ._family import Gemma3TextFamily as Gemma3TextFamily
from ._family import GptOssFamily as GptOssFamily
from ._family import KimiLinearFamily as KimiLinearFamily
from ._family import Llama4TextFamily as Llama4TextFamily
from ._family import LlamaFamily as LlamaFamily
from ._family import Qwen3NextFamily as Qwen3NextFamily
from ._family import Qwen35Family as Qwen35Family

__all__ = [
    "DEEPSEEK",
    "GEMMA2",
    "GEMMA3_TEXT",
    "GPT_OSS",
    "KIMI_LINEAR",
    "LLAMA",
    "LLAMA4_TEXT",
    "QWEN3_5",
    "QWEN3_NEXT",
    "DeepSeekFamily",
    "Gemma2Family",
    "Gemma3TextFamily",
    "GptOssFamily",
    "KimiLinearFamily",
    "Llama4TextFamily",
    "LlamaFamily",
    "Qwen35Family",
    "Qwen3NextFamily",
]
