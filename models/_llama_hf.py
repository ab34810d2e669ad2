"""The Hugging Face checkpoint format of `models.llama`: `config.json` of Llama 2/3.x,
Mistral, Qwen2 and Qwen3 to and from `LlamaConfig`, and the tensor names.

Hugging Face stores q/k projections already permuted for its rotate_half RoPE, the
convention of `eqx_longctx.nn.RoPE`, so weights map by transposing and reshaping only.
`models.llama.from_hf` and `to_hf` read and write the files with `models/_hf.py`.

This module never imports `models.llama` (which imports it): configs arrive as arguments
and leave as the keyword arguments of `LlamaConfig`.
"""

from typing import Any, Literal

from eqx_longctx.nn import Llama3RopeScaling

from . import _hf, _hf_config, _hf_io, _hf_windows

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_REQUIRED = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
)  # fmt: skip
_COMMON = _REQUIRED + (
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings", "attention_dropout",
)  # fmt: skip
# `pretraining_tp` only split the matmuls of old transformers versions: same arithmetic.
# Mistral's reader rejects `layer_types` with its own message (transformers ignores it).
_KEYS = {
    "llama": _COMMON + ("attention_bias", "mlp_bias", "pretraining_tp"),
    "mistral": _COMMON + _hf_windows.MISTRAL_KEYS + ("layer_types",),
    "qwen2": _COMMON + _hf_windows.QWEN_KEYS,
    "qwen3": _COMMON + _hf_windows.QWEN_KEYS + ("attention_bias",),
}
_MAX_LEN = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768}  # defaults
_Kind = Literal["same", "flat", "linear"]
# Old conversions saved RoPE frequencies as buffers; they are recomputed from config.json.
_IGNORE = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def hf_table(c: Any) -> dict[str, _hf.HFTensor]:
    """Zoo parameter path -> Hugging Face tensor, for the `LlamaConfig` `c`."""
    table = _hf_io.decoder_ends(c)
    # (path in a block, Hugging Face name in model.layers.{layer}, kind, n_in)
    block: list[tuple[str, str, _Kind, int]] = [("attn.wo", "self_attn.o_proj.weight", "linear", 2)]
    for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
        block.append((f"attn.w{ours}", f"self_attn.{theirs}.weight", "linear", 1))
        if c.attention_bias:
            block.append((f"attn.b{ours}", f"self_attn.{theirs}.bias", "flat", 1))
    for ours in ("gate", "up", "down"):
        block.append((f"mlp.w_{ours}", f"mlp.{ours}_proj.weight", "linear", 1))
    if c.qk_norm:
        for ours in ("q_norm", "k_norm"):
            block.append((f"attn.{ours}.weight", f"self_attn.{ours}.weight", "same", 1))
    runs = c.window_runs
    for i, (start, _, _) in enumerate(runs):  # one LayerStack per run (see `Llama`)
        stack = "layers.layers." if len(runs) == 1 else f"layers.{i}.layers."
        add = _hf_io.block_tensors(table, stack, (("layer", start),) if start else ())
        for ours, theirs, kind, n_in in block:
            add(ours, theirs, kind, n_in)
    return table


def tables(c: Any, hf: dict, path: str | None) -> _hf_io.HFTables:
    """The `HFFormat.tables` of `models.llama`: `hf_table`, old RoPE buffers skipped."""
    return _hf_io.HFTables(hf_table(c), ignore=_IGNORE)


def config_from_hf(hf: dict, file: str) -> tuple[dict, dict[str, Any]]:
    """`config.json` (`hf`, read from `file`) with its values' types checked, and the
    `LlamaConfig` fields it describes (the checkpoint's dtype, no `from_hf` overrides)."""
    model_type, hf = _hf_config.check_config(
        hf, file, "models.llama", _ARCHITECTURES, _KEYS, _REQUIRED,
        why="every {model_type} config states them.",
        ints=(
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
            "sliding_window",
        ),
        reals=("rms_norm_eps", "rope_theta"),
        non_negative_ints=("max_window_layers",),
        bools=("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window"),
        objects=("rope_scaling", "rope_parameters"),
        lists=("layer_types",),
    )  # fmt: skip
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise _hf_config.unsupported("hidden_act", hf["hidden_act"], "the MLP is SwiGLU (silu).")
    if hf.get("mlp_bias", False):
        raise _hf_config.unsupported("mlp_bias", True, "the zoo's MLP has no biases.")
    if hf.get("attention_bias", False):
        raise _hf_config.unsupported(
            "attention_bias",
            True,
            f"{model_type} then adds biases to q/k/v and the output projection; the zoo has "
            "q/k/v biases only (as Qwen2).",
        )
    if hf.get("attention_dropout") not in (None, 0, 0.0):
        raise _hf_config.unsupported(
            "attention_dropout", hf["attention_dropout"], "the zoo's attention has no dropout."
        )
    sliding_window, layer_types = _hf_windows.windows_from_hf(
        hf, model_type, hf["num_hidden_layers"]
    )
    rope_theta, rope_scaling = _rope_from_hf(hf, file)
    n_heads = hf["num_attention_heads"]
    return hf, dict(
        **_hf_config.decoder_from_hf(hf, _MAX_LEN[model_type]),
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        attention_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
        sliding_window=sliding_window,
        layer_types=layer_types,
    )


def _rope_from_hf(hf: dict, file: str) -> tuple[float, Llama3RopeScaling | None]:
    """RoPE base and scaling from `rope_parameters` (transformers 5) or the older
    `rope_theta` + `rope_scaling`."""
    theta, rope_type, params = _hf_config.rope_from_hf(hf, file)
    expected = {"default": (), "llama3": _LLAMA3_KEYS}.get(rope_type)
    if expected is None:
        raise _hf_config.unsupported(
            "rope type",
            rope_type,
            "the zoo implements 'default' (plain RoPE) and 'llama3' (Llama 3.1 scaling) only.",
        )
    if set(params) != set(expected):
        raise _hf_config.unsupported(
            f"{rope_type!r} RoPE parameters",
            sorted(params),
            f"expected exactly {sorted(expected)} besides rope_type and rope_theta.",
        )
    return theta, (Llama3RopeScaling(**params) if rope_type == "llama3" else None)


def config_to_hf(c: Any) -> dict:
    """The `config.json` of the `LlamaConfig` `c`, in the family its fields call for (see
    `models.llama.to_hf`)."""
    if c.qk_norm and c.attention_bias:
        raise ValueError(
            "to_hf: no supported Hugging Face family has both q/k norm and q/k/v-only biases "
            "(Qwen3 has the norm, Qwen2 the biases); got qk_norm=True, attention_bias=True."
        )
    model_type = (
        "qwen3"
        if c.qk_norm
        else "qwen2"
        if c.attention_bias
        else _hf_windows.llama_or_mistral(c.sliding_window, c.layer_types)
    )
    scaling = c.rope_scaling
    if scaling is not None and not isinstance(scaling, Llama3RopeScaling):
        raise ValueError(
            f"to_hf writes a Llama's RoPE scaling as rope_type 'llama3' only; got "
            f"{type(scaling).__name__}. Save the model with rope_scaling=None or a "
            "Llama3RopeScaling (eval-time scalings need not be saved)."
        )
    hf = {
        **_hf_config.decoder_to_hf(c, model_type, _ARCHITECTURES),
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "rope_scaling": None
        if scaling is None
        else {"rope_type": "llama3", **{k: getattr(scaling, k) for k in _LLAMA3_KEYS}},
    }
    if model_type in ("llama", "qwen3"):
        hf["attention_bias"] = False
    if model_type == "llama":
        hf["mlp_bias"] = False
    hf.update(_hf_windows.windows_to_hf(c.sliding_window, c.layer_types, model_type, c.n_layers))
    return hf
