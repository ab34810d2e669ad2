"""The Hugging Face checkpoint format of `models.llama4`: `config.json` of Llama 4 text
models to and from `Llama4Config`, and the tensor names.

transformers' `Llama4ForCausalLM` stores the attention and the dense and shared SwiGLUs as
torch Linears, the router as one too, and the routed experts as two stacked tensors,
`experts.gate_up_proj` `[experts, embed, 2 * hidden]` (the gate, then the up projection)
and `experts.down_proj` `[experts, hidden, embed]`, already `[in, out]`: the first is a
`Fused` tensor (`models/_hf_fused.py`), the rest map one to one. Its complex RoPE rotates
neighbouring feature pairs, the zoo's `RoPE(interleaved=True)`, so no weight is permuted.
A vision-language checkpoint (`llama4`, `Llama4ForConditionalGeneration`) keeps the text
model under `language_model.` and its config under `text_config`.

This module never imports `models.llama4` (which imports it): configs arrive as arguments
and leave as the keyword arguments of `Llama4Config`.
"""

from typing import Any

from eqx_longctx.nn import Llama3RopeScaling

from . import _hf_config, _hf_io
from ._hf import HFTensor
from ._hf_fused import Fused
from ._hybrid import runs

FAMILY = "models.llama4"
_ARCHITECTURES = {
    "llama4_text": "Llama4ForCausalLM",
    "llama4": "Llama4ForConditionalGeneration",
}
_REQUIRED = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "num_local_experts",
)  # fmt: skip
_KEYS = {
    "llama4_text": _REQUIRED + (
        "intermediate_size_mlp", "head_dim", "hidden_act", "max_position_embeddings",
        "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings",
        "attention_bias", "attention_dropout", "num_experts_per_tok", "moe_layers",
        "interleave_moe_layer_step", "use_qk_norm", "no_rope_layers", "no_rope_layer_interval",
        "attention_chunk_size", "layer_types", "attn_temperature_tuning", "floor_scale",
        "attn_scale",
        # Training-time and bookkeeping keys: the forward pass ignores them.
        "output_router_logits", "router_aux_loss_coef", "router_jitter_noise",
        "for_llm_compressor", "cache_implementation", "_attn_implementation_autoset",
    ),
    "llama4": (
        "text_config", "vision_config", "tie_word_embeddings", "boi_token_index",
        "eoi_token_index", "image_token_index",
    ),
}  # fmt: skip
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# The vision tower and its projector: not part of the text model's logits.
_IGNORE = (r"vision_model\..*", r"multi_modal_projector\..*")


def tables(c: Any, hf: dict, path: str | None) -> _hf_io.HFTables:
    """The `HFFormat.tables` of `models.llama4` for the config `c`: zoo parameter path ->
    Hugging Face tensor, the experts' fused `gate_up_proj`, and the tensors reading skips.
    `hf` is the `config.json` read from `path` (its `_model_type` the outer one of a
    vision-language checkpoint), or the one written (`path=None`)."""
    wrapped = path is not None and hf["_model_type"] == "llama4"
    outer = "language_model." if wrapped else ""
    table = _hf_io.decoder_ends(c, outer + "model.")
    if "lm_head" in table:
        table["lm_head"] = HFTensor(outer + "lm_head.weight", "linear")
    ignore: list[str] = list(_IGNORE)
    if wrapped and c.tie_embeddings:  # a copy of the embedding, if written at all
        ignore.append(r"language_model\.lm_head\.weight")
    fused: list[Fused] = []
    E, D, F = c.n_experts, c.dim, c.moe_hidden_dim
    base = outer + "model."
    for n, (kind, first, _) in enumerate(runs(c.kinds)):
        stack, offsets = f"layers.{n}.layers.", (("layer", first),) if first else ()
        one = _hf_io.block_tensors(table, stack, offsets, base)
        for ours in "qkv":
            one(f"attn.w{ours}", f"self_attn.{ours}_proj.weight", "linear")
        one("attn.wo", "self_attn.o_proj.weight", "linear", 2)
        if kind.endswith("/dense"):
            for ours, theirs in _hf_io.SWIGLU:
                one(f"mlp.{ours}", f"feed_forward.{theirs}.weight", "linear")
            continue
        one("mlp.router", "feed_forward.router.weight", "linear")
        gate_up = HFTensor(f"{base}layers.{{layer}}.feed_forward.experts.gate_up_proj",
                           "same", 1, offsets)  # fmt: skip
        fused.append(Fused(gate_up, ((stack + "mlp.w_gate", (E, D, F)),
                                     (stack + "mlp.w_up", (E, D, F))), 2))  # fmt: skip
        one("mlp.w_down", "feed_forward.experts.down_proj")
        for ours, theirs in _hf_io.SWIGLU:
            one(f"mlp.shared.{ours}", f"feed_forward.shared_expert.{theirs}.weight", "linear")
    return _hf_io.HFTables(table, fused, ignore)


def _unwrap(hf: dict) -> tuple[str, dict]:
    """`(outer model_type, the text model's config.json)`: a `llama4` checkpoint's
    `text_config` (with the outer tie and dtype), or `hf` itself."""
    outer_type = _hf_config.check_model_type(hf, _ARCHITECTURES, FAMILY)
    if outer_type != "llama4":
        return outer_type, hf
    _hf_config.check_config_keys(hf, _KEYS["llama4"], f"{FAMILY} (llama4)")
    text = hf.get("text_config")
    if not isinstance(text, dict) or text.get("model_type", "llama4_text") != "llama4_text":
        raise _hf_config.unsupported(
            "text_config", text, "a llama4 checkpoint's text model is a llama4_text config."
        )
    inner = {k: v for k, v in text.items() if k != "architectures"}
    inner["model_type"] = "llama4_text"
    for key in ("tie_word_embeddings", "dtype", "torch_dtype"):
        if key in hf:
            inner[key] = hf[key]
    return outer_type, inner


def config_from_hf(hf: dict, file: str) -> tuple[dict, dict[str, Any]]:
    """`config.json` (`hf`, read from `file`) with its values' types checked, and the
    `Llama4Config` fields it describes (the checkpoint's dtype, no overrides); absent keys
    take transformers' `Llama4TextConfig` defaults. The outer `model_type` is kept as
    `_model_type` in the returned dict."""
    outer_type, hf = _unwrap(hf)
    if isinstance(hf.get("attn_temperature_tuning"), int):  # Meta's configs write 4 for on
        hf = {**hf, "attn_temperature_tuning": bool(hf["attn_temperature_tuning"])}
    _, hf = _hf_config.check_config(
        hf, file, FAMILY, _ARCHITECTURES, _KEYS, _REQUIRED,
        why="the zoo does not guess the sizes of a {model_type} model. State them in config.json.",
        ints=_REQUIRED + (
            "intermediate_size_mlp", "head_dim", "max_position_embeddings", "num_experts_per_tok",
            "interleave_moe_layer_step", "no_rope_layer_interval", "attention_chunk_size",
        ),
        reals=("rms_norm_eps", "rope_theta", "floor_scale", "attn_scale"),
        bools=("tie_word_embeddings", "attention_bias", "use_qk_norm", "attn_temperature_tuning"),
        objects=("rope_scaling", "rope_parameters"),
        lists=("moe_layers", "no_rope_layers", "layer_types"),
    )  # fmt: skip
    rules = [
        ("hidden_act", hf.get("hidden_act", "silu"), ("silu", "swish"), "the MLPs are SwiGLU."),
        ("attention_bias", hf.get("attention_bias", False), (False,),
         "transformers then adds biases to q/k/v/o; the zoo's Llama 4 attention has none."),
        ("attention_dropout", hf.get("attention_dropout") or 0.0, (0.0,),
         "the zoo's attention has no dropout; set it to 0."),
    ]  # fmt: skip
    for key, value, allowed, why in rules:
        if value not in allowed:
            raise _hf_config.unsupported(key, value, why)
    n = hf["num_hidden_layers"]
    no_rope = hf.get("no_rope_layers") or None  # transformers: empty means derived
    if no_rope is not None and (len(no_rope) < n or set(no_rope) - {0, 1}):
        raise _hf_config.unsupported(
            "no_rope_layers", no_rope, f"it needs 1 (RoPE) or 0 (NoPE) for each of the {n} layers."
        )
    types = hf.get("layer_types")
    if types is not None and (len(types) != n or set(types) - {"chunked_attention",
                                                              "full_attention"}):  # fmt: skip
        raise _hf_config.unsupported(
            "layer_types", types,
            f"it needs 'chunked_attention' or 'full_attention' for each of the {n} layers.",
        )  # fmt: skip
    moe = hf.get("moe_layers")
    if moe is not None and not all(isinstance(i, int) and 0 <= i < n for i in moe):
        raise _hf_config.unsupported("moe_layers", moe, f"it lists layer indices in [0, {n}).")
    theta, scaling = _rope_from_hf(hf, file)
    hf["_model_type"] = outer_type
    chunk = hf.get("attention_chunk_size", 8192)  # transformers' default; null: no chunks
    return hf, dict(
        **_hf_config.decoder_from_hf(
            {**hf, "intermediate_size": hf.get("intermediate_size_mlp", 16384)}, 131072
        ),
        n_kv_heads=hf["num_key_value_heads"],
        # transformers: 128 when absent, hidden_size // heads when null
        head_dim=hf.get("head_dim", 128) or hf["hidden_size"] // hf["num_attention_heads"],
        moe_hidden_dim=hf["intermediate_size"],
        n_experts=hf["num_local_experts"],
        top_k=hf.get("num_experts_per_tok") or 1,
        moe_layers=None if moe is None else tuple(moe),
        interleave_moe_layer_step=hf.get("interleave_moe_layer_step") or 1,
        no_rope_layers=None if no_rope is None else tuple(no_rope[:n]),
        no_rope_layer_interval=hf.get("no_rope_layer_interval") or 4,
        attention_chunk_size=chunk,
        layer_types=None if types is None else tuple(types),
        use_qk_norm=hf.get("use_qk_norm", True),
        attn_temperature_tuning=hf.get("attn_temperature_tuning", True),
        floor_scale=hf.get("floor_scale", 8192.0),
        attn_scale=hf.get("attn_scale", 0.1),
        rope_theta=theta,
        rope_scaling=scaling,
    )


def _rope_from_hf(hf: dict, file: str) -> tuple[float, Llama3RopeScaling | None]:
    """RoPE base (transformers' Llama 4 default 5e5) and Llama 3 scaling, from
    `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (Meta's configs)."""
    params = hf.get("rope_parameters") or {}
    if hf.get("rope_theta") is None and params.get("rope_theta") is None:
        hf = {**hf, "rope_theta": 500000.0}
    theta, rope_type, params = _hf_config.rope_from_hf(hf, file)
    expected = {"default": (), "llama3": _LLAMA3_KEYS}.get(rope_type)
    if expected is None or set(params) != set(expected):
        raise _hf_config.unsupported(
            "rope_parameters", {"rope_type": rope_type, **params},
            "the zoo's Llama 4 implements 'default' RoPE and 'llama3' scaling (with exactly "
            f"{list(_LLAMA3_KEYS)}).",
        )  # fmt: skip
    return theta, (Llama3RopeScaling(**params) if rope_type == "llama3" else None)


def config_to_hf(c: Any) -> dict:
    """The `config.json` of the `Llama4Config` `c`: a `Llama4ForCausalLM` (`llama4_text`)
    with every per-layer pattern written out."""
    scaling = c.rope_scaling
    hf = {
        **_hf_config.decoder_to_hf(c, "llama4_text", _ARCHITECTURES),
        "intermediate_size": c.moe_hidden_dim,
        "intermediate_size_mlp": c.hidden_dim,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "num_local_experts": c.n_experts,
        "num_experts_per_tok": c.top_k,
        "moe_layers": list(c.moe_layers),
        "interleave_moe_layer_step": c.interleave_moe_layer_step,
        "no_rope_layers": list(c.no_rope_layers),
        "no_rope_layer_interval": c.no_rope_layer_interval,
        "attention_chunk_size": c.attention_chunk_size,
        "layer_types": list(c.layer_types),
        "use_qk_norm": c.use_qk_norm,
        "attn_temperature_tuning": c.attn_temperature_tuning,
        "floor_scale": int(c.floor_scale) if c.floor_scale.is_integer() else c.floor_scale,
        "attn_scale": c.attn_scale,
        "attention_bias": False,
        "rope_scaling": None
        if scaling is None
        else {"rope_type": "llama3", **{k: getattr(scaling, k) for k in _LLAMA3_KEYS}},
    }
    return hf
