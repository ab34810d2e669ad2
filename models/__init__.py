"""Model families: `models.llama` (Llama 3 / Mistral / Qwen2 / Qwen3) and `models.deepseek`
(DeepSeek-V2/V3, MLA + MoE). `family(name)` looks one up by its `--model` name."""

from ._family import FAMILY_NAMES as FAMILY_NAMES
from ._family import ModelFamily as ModelFamily
from ._family import family as family
from ._family import family_of as family_of

__all__ = ["FAMILY_NAMES", "ModelFamily", "family", "family_of"]
