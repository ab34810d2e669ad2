"""Sliding-window attention in the `config.json` of Llama-family checkpoints: reading and
writing Mistral's and Qwen2/Qwen3's keys as `LlamaConfig.sliding_window` + `layer_types`.

What transformers (5.x) does with these keys, which this module reproduces:

- Mistral: `sliding_window` (default 4096 when the key is absent) applies to every layer;
  `null` means full attention. `MistralForCausalLM` ignores `layer_types`.
- Qwen2 / Qwen3: the window is `sliding_window` (default 4096) if `use_sliding_window`
  (default false), else none. `layer_types`, when given, says which layers slide;
  otherwise layer `i` slides when there is a window and `i >= max_window_layers` (default
  28, here also for `null`): the layers *below* `max_window_layers` attend fully. A
  sliding layer without a window is an error in transformers (`Could not find a
  sliding_window argument`).
"""

from collections.abc import Mapping
from typing import Any

from ._hf_config import unsupported

MISTRAL_KEYS = ("sliding_window",)
QWEN_KEYS = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
HF_DEFAULT_WINDOW = 4096  # transformers' default `sliding_window` for all three families
HF_DEFAULT_MAX_WINDOW_LAYERS = 28  # Qwen2Config / Qwen3Config


def windows_from_hf(
    hf: Mapping[str, Any], model_type: str, n_layers: int
) -> tuple[int | None, tuple[str, ...] | None]:
    """`(sliding_window, layer_types)` of the `LlamaConfig` a checked `config.json`
    describes (`layer_types` as written or derived; the config normalises it).

    **Arguments:**

    - `hf`: `config.json`, its value types already checked.
    - `model_type`: `"llama"`, `"mistral"`, `"qwen2"` or `"qwen3"`.
    - `n_layers`: `num_hidden_layers`.
    """
    if model_type == "llama":
        return None, None
    if model_type == "mistral":
        if hf.get("layer_types") is not None:
            raise unsupported(
                "layer_types",
                hf["layer_types"],
                "MistralForCausalLM ignores it and slides every layer when sliding_window is "
                "set, so the checkpoint's intent is unclear. Remove layer_types (every layer "
                "slides), or convert it to a Qwen2/Qwen3 checkpoint that honours it.",
            )
        return hf.get("sliding_window", HF_DEFAULT_WINDOW), None
    window = hf.get("sliding_window", HF_DEFAULT_WINDOW) if hf.get("use_sliding_window") else None
    types = hf.get("layer_types")
    if types is None:
        first = hf.get("max_window_layers")
        first = HF_DEFAULT_MAX_WINDOW_LAYERS if first is None else first
        types = [
            "sliding_attention" if window is not None and i >= first else "full_attention"
            for i in range(n_layers)
        ]
    elif "sliding_attention" in types and window is None:
        raise ValueError(
            f"layer_types marks sliding layers but use_sliding_window="
            f"{hf.get('use_sliding_window', False)} and sliding_window="
            f"{hf.get('sliding_window', HF_DEFAULT_WINDOW)} give them no window (transformers "
            "fails on this config). Set use_sliding_window to true and sliding_window to the "
            "window, or mark every layer 'full_attention'."
        )
    if "sliding_attention" not in types:
        window = None  # a window no layer uses (e.g. max_window_layers >= num_hidden_layers)
    return window, tuple(types)


def llama_or_mistral(sliding_window: int | None, layer_types) -> str:
    """The model type `to_hf` writes for a model without q/k/v biases or q/k norm: Llama
    without windows, Mistral with one in every layer."""
    if layer_types is not None:
        raise ValueError(
            "to_hf: a model without q/k/v biases or q/k norm is written as Llama (no windows) "
            "or Mistral (every layer slides), and neither mixes sliding and full layers; got "
            f"layer_types={layer_types}. Use one window for every layer, or qk_norm=True "
            "(Qwen3) or attention_bias=True (Qwen2), which honour layer_types."
        )
    return "llama" if sliding_window is None else "mistral"


def windows_to_hf(
    sliding_window: int | None, layer_types, model_type: str, n_layers: int
) -> dict[str, Any]:
    """The `config.json` keys that make transformers use these windows (`windows_from_hf`
    reads them back exactly)."""
    if model_type == "llama":
        return {}
    if model_type == "mistral":
        return {"sliding_window": sliding_window}
    if layer_types is None:
        kind = "full_attention" if sliding_window is None else "sliding_attention"
        layer_types = (kind,) * n_layers
    # transformers 5 reads layer_types; older versions read max_window_layers, which says
    # the same when the sliding layers are the top ones (Qwen2's pattern).
    full_below = next((i for i, t in enumerate(layer_types) if t != "full_attention"), n_layers)
    return {
        "use_sliding_window": sliding_window is not None,
        "sliding_window": sliding_window,
        "max_window_layers": full_below,
        "layer_types": list(layer_types),
    }
