"""The model zoo: `models.llama` (Llama 3 / Mistral / Qwen2 / Qwen3) and `models.deepseek`
(DeepSeek-V2/V3, MLA + MoE), each registered as an `eqx_longctx.ModelFamily` plugin under
the `eqx_longctx.models` entry-point group (`eqx_longctx.model_family("llama")`)."""

from ._family import DEEPSEEK as DEEPSEEK
from ._family import KIMI_LINEAR as KIMI_LINEAR
from ._family import LLAMA as LLAMA
from ._family import DeepSeekFamily as DeepSeekFamily
from ._family import KimiLinearFamily as KimiLinearFamily
from ._family import LlamaFamily as LlamaFamily

__all__ = [
    "DEEPSEEK",
    "KIMI_LINEAR",
    "LLAMA",
    "DeepSeekFamily",
    "KimiLinearFamily",
    "LlamaFamily",
]
