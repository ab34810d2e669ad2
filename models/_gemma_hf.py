"""The Hugging Face checkpoint format of `models.gemma`: `config.json` of Gemma 2, Gemma 3
text and the text model of Gemma 3's vision-language checkpoints, to and from
`GemmaConfig`, and the tensor names.

Weights map by transposing and reshaping only (q/k are stored for rotate_half RoPE, the
zoo's convention). Each block's four norms are `input_layernorm` (before the attention),
`post_attention_layernorm` (after it), `pre_feedforward_layernorm` and
`post_feedforward_layernorm`. A `gemma3` checkpoint keeps its language model under
`language_model.model.` (the Hub's files, and what transformers 5 writes) or
`model.language_model.` (transformers' module names), beside the vision tower and the
projector, which are not read.

Keys a `config.json` leaves out take transformers' defaults for its model type (a Gemma 3
`text_config` often states only the sizes that differ from `Gemma3TextConfig`'s).

This module never imports `models.gemma` (which imports it): configs arrive as arguments
and leave as the keyword arguments of `GemmaConfig`.
"""

from typing import Any

from eqx_longctx.nn import LinearRopeScaling

from . import _hf, _hf_config, _hf_io
from ._hybrid import runs

FAMILY = "models.gemma"
_ARCHITECTURES = {
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
}
_TEXT = ("gemma2", "gemma3_text")
# transformers' defaults (Gemma2Config, Gemma3TextConfig) for the keys that size the model.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": dict(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
        rms_norm_eps=1e-6, query_pre_attn_scalar=256, sliding_window=4096,
        final_logit_softcapping=30.0, attn_logit_softcapping=50.0, tie_word_embeddings=True,
    ),
    "gemma3_text": dict(
        vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        max_position_embeddings=131072, rms_norm_eps=1e-6, query_pre_attn_scalar=256,
        sliding_window=4096, final_logit_softcapping=None, attn_logit_softcapping=None,
        tie_word_embeddings=True,
    ),
}  # fmt: skip
_GLOBAL_THETA, _LOCAL_THETA = 1e6, 1e4  # Gemma3TextConfig's RoPE bases
_COMMON = (
    *_DEFAULTS["gemma2"], "hidden_activation", "hidden_act", "rope_theta", "rope_scaling",
    "rope_parameters", "attention_bias", "attention_dropout", "layer_types",
    "use_bidirectional_attention",
    # What transformers ignores: an old alias of the window, the generation cache's kind.
    "sliding_window_size", "cache_implementation",
)  # fmt: skip
_KEYS = {
    "gemma2": _COMMON,
    "gemma3_text": (*_COMMON, "rope_local_base_freq", "sliding_window_pattern",
                    "_sliding_window_pattern"),  # fmt: skip
    "gemma3": (
        "text_config", "vision_config", "tie_word_embeddings", "mm_tokens_per_image",
        "boi_token_index", "eoi_token_index", "image_token_index", "boi_token_id",
        "eoi_token_id", "image_token_id",
    ),
}  # fmt: skip
# The vision tower and the projector of a gemma3 checkpoint: not part of the text model.
_IGNORE = (r"(model\.)?vision_tower\..*", r"(model\.)?multi_modal_projector\..*")
_LAYOUTS = ("language_model.model.", "model.language_model.")  # a gemma3 checkpoint's


def _base(hf: dict, path: str | None) -> tuple[str, str]:
    """`(prefix of the text model's tensors, name of the untied LM head)`: `model.` and
    `lm_head.weight`, or inside a `gemma3` checkpoint the layout its tensors use."""
    if path is None or hf["_model_type"] != "gemma3":
        return "model.", "lm_head.weight"
    with _hf.SafetensorsCheckpoint(path) as checkpoint:
        names = checkpoint.names
    base = next((b for b in _LAYOUTS if b + "embed_tokens.weight" in names), _LAYOUTS[0])
    return base, "language_model.lm_head.weight" if base == _LAYOUTS[0] else "lm_head.weight"


def tables(c: Any, hf: dict, path: str | None) -> _hf_io.HFTables:
    """The `HFFormat.tables` of `models.gemma` for the config `c`: zoo parameter path ->
    Hugging Face tensor, and the tensors reading skips. `hf` is the `config.json` read
    from `path` (its `_model_type` the outer one), or the one written (`path=None`)."""
    base, head = _base(hf, path)
    table = _hf_io.decoder_ends(c, base)
    if "lm_head" in table:
        table["lm_head"] = _hf.HFTensor(head, "linear")
    for n, (_, first, _) in enumerate(runs(c.kinds)):
        offsets = (("layer", first),) if first else ()
        add = _hf_io.block_tensors(table, f"layers.{n}.layers.", offsets, base)
        add("attn_post_norm.weight", "post_attention_layernorm.weight")
        add("mlp_norm.weight", "pre_feedforward_layernorm.weight")
        add("mlp_post_norm.weight", "post_feedforward_layernorm.weight")
        for ours in ("q", "k", "v"):
            add(f"attn.w{ours}", f"self_attn.{ours}_proj.weight", "linear")
        add("attn.wo", "self_attn.o_proj.weight", "linear", 2)
        if c.qk_norm:
            add("attn.q_norm.weight", "self_attn.q_norm.weight")
            add("attn.k_norm.weight", "self_attn.k_norm.weight")
        for ours, theirs in _hf_io.SWIGLU:
            add(f"mlp.{ours}", f"mlp.{theirs}.weight", "linear")
    return _hf_io.HFTables(table, ignore=_IGNORE)


def _text_config(hf: dict) -> dict:
    """A `gemma3` checkpoint's `text_config`, with the outer keys that apply to it."""
    _hf_config.check_config_keys(hf, _KEYS["gemma3"], f"{FAMILY} (gemma3)")
    text = hf.get("text_config") or {}
    if not isinstance(text, dict) or text.get("model_type", "gemma3_text") != "gemma3_text":
        raise _hf_config.unsupported(
            "text_config", text, "a gemma3 checkpoint's text model is a gemma3_text config."
        )
    inner = {k: v for k, v in text.items() if k != "architectures"}
    inner["model_type"] = "gemma3_text"
    for key in ("tie_word_embeddings", "dtype", "torch_dtype"):
        if key in hf:
            inner[key] = hf[key]
    if inner.get("final_logit_softcapping") is not None:
        raise _hf_config.unsupported(
            "text_config.final_logit_softcapping", inner["final_logit_softcapping"],
            "Gemma3ForConditionalGeneration never applies it (only Gemma3ForCausalLM does), "
            "so the checkpoint's logits are ambiguous; set it to null.",
        )  # fmt: skip
    return inner


def config_from_hf(hf: dict, file: str) -> tuple[dict, dict[str, Any]]:
    """`config.json` (`hf`, read from `file`) with its values' types checked, and the
    `GemmaConfig` fields it describes (the checkpoint's dtype, no overrides). A `gemma3`
    checkpoint's `text_config` is what is read; the outer `model_type` is kept as
    `_model_type` in the returned dict."""
    outer_type = _hf_config.check_model_type(hf, _ARCHITECTURES, FAMILY)
    if outer_type == "gemma3":
        hf = _text_config(hf)
    model_type = hf.get("model_type")
    if model_type in _TEXT:
        hf = {**_DEFAULTS[model_type], **hf}
    model_type, hf = _hf_config.check_config(
        hf, file, FAMILY, _ARCHITECTURES, _KEYS, (), why="",
        ints=(
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
            "sliding_window", "sliding_window_pattern", "_sliding_window_pattern",
        ),
        reals=(
            "rms_norm_eps", "rope_theta", "rope_local_base_freq", "query_pre_attn_scalar",
            "final_logit_softcapping", "attn_logit_softcapping",
        ),
        bools=("tie_word_embeddings", "attention_bias", "use_bidirectional_attention"),
        objects=("rope_scaling", "rope_parameters"),
        lists=("layer_types",),
    )  # fmt: skip
    gemma3 = model_type == "gemma3_text"
    act = hf.get("hidden_activation") or "gelu_pytorch_tanh"
    rules = [
        ("hidden_activation", act, ("gelu_pytorch_tanh",),
         "the MLP is GeGLU with GELU's tanh approximation."),
        ("attention_bias", hf.get("attention_bias", False), (False,),
         "transformers then adds biases to q/k/v/o; the zoo's Gemma has none."),
        ("attention_dropout", hf.get("attention_dropout") or 0.0, (0.0,),
         "the zoo's attention has no dropout; set it to 0."),
        ("use_bidirectional_attention", bool(hf.get("use_bidirectional_attention")), (False,),
         "the zoo's Gemma is a causal decoder."),
        ("attn_logit_softcapping", hf["attn_logit_softcapping"] if gemma3 else None, (None,),
         "Gemma3ForCausalLM never applies it, so the checkpoint's scores are ambiguous; set "
         "it to null."),
    ]  # fmt: skip
    for key, value, allowed, why in rules:
        if value not in allowed:
            raise _hf_config.unsupported(key, value, why)
    n = hf["num_hidden_layers"]
    every = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
    layer_types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % (every if gemma3 else 2) == 0 else "sliding_attention"
        for i in range(n)
    ]
    if len(layer_types) != n or not set(layer_types) <= {"sliding_attention", "full_attention"}:
        raise _hf_config.unsupported(
            "layer_types", layer_types,
            f"it needs 'sliding_attention' or 'full_attention' for each of the {n} layers.",
        )  # fmt: skip
    window = hf.get("sliding_window") if "sliding_attention" in layer_types else None
    rope = _rope_from_hf(hf, file) if gemma3 else _gemma2_rope(hf, file)
    hf["_model_type"] = outer_type
    return hf, dict(
        **_hf_config.decoder_from_hf(hf, hf["max_position_embeddings"]),
        n_kv_heads=hf["num_key_value_heads"],
        head_dim=hf["head_dim"],
        sliding_window=window,
        layer_types=tuple(layer_types),
        query_pre_attn_scalar=hf["query_pre_attn_scalar"],
        attn_softcap=hf["attn_logit_softcapping"],
        final_softcap=hf["final_logit_softcapping"],
        qk_norm=gemma3,
        **rope,
    )


def _gemma2_rope(hf: dict, file: str) -> dict[str, Any]:
    theta, rope_type, params = _hf_config.rope_from_hf(hf, file)
    if rope_type != "default" or params:
        raise _hf_config.unsupported(
            "rope_parameters", {"rope_type": rope_type, **params},
            "Gemma 2 rotates with plain RoPE (rope_type 'default').",
        )  # fmt: skip
    return dict(rope_theta=theta)


def _rope_from_hf(hf: dict, file: str) -> dict[str, Any]:
    """Gemma 3's two RoPEs: `rope_parameters` per layer type (transformers 5), whose bases
    default to `rope_theta` and `rope_local_base_freq`, with `rope_scaling` joining the
    global one's (as transformers merges them); or the older flat keys."""
    params = hf.get("rope_parameters")
    if params is not None and set(params) <= {"full_attention", "sliding_attention"}:
        full = {**(params.get("full_attention") or {}), **(hf.get("rope_scaling") or {})}
        local = dict(params.get("sliding_attention") or {})
    else:
        full = {**(params or {}), **(hf.get("rope_scaling") or {})}
        local = {}
    full.setdefault("rope_theta", hf.get("rope_theta") or _GLOBAL_THETA)
    local.setdefault("rope_theta", hf.get("rope_local_base_freq") or _LOCAL_THETA)
    out: dict[str, Any] = {}
    for kind, p in (("global", full), ("local", local)):
        theta, rope_type, rest = _hf_config.rope_from_hf({"rope_parameters": p}, file)
        linear = rope_type == "linear" and set(rest) == {"factor"} and kind == "global"
        if not (linear or (rope_type == "default" and not rest)):
            raise _hf_config.unsupported(
                f"rope_parameters ({kind} layers)", {"rope_type": rope_type, **rest},
                "Gemma 3's global layers rotate with plain or linearly scaled RoPE "
                "('default', or 'linear' with a factor), its local layers with plain RoPE.",
            )  # fmt: skip
        if kind == "global":
            out["rope_theta"] = theta
            out["rope_scaling"] = LinearRopeScaling(rest["factor"]) if linear else None
        else:
            out["rope_local_theta"] = theta
    return out


def config_to_hf(c: Any) -> dict:
    """The `config.json` of the `GemmaConfig` `c` (see `models.gemma.to_hf`): Gemma 3 text
    with `qk_norm`, else Gemma 2."""
    model_type = "gemma3_text" if c.qk_norm else "gemma2"
    if model_type == "gemma2" and (c.rope_scaling is not None or c.rope_local_theta not in (
        None, c.rope_theta
    )):  # fmt: skip
        raise ValueError(
            "to_hf writes a model without qk_norm as Gemma 2, whose layers share one plain "
            f"RoPE; got rope_local_theta={c.rope_local_theta}, rope_scaling={c.rope_scaling}. "
            "Use qk_norm=True (Gemma 3) or drop them."
        )
    if model_type == "gemma3_text" and c.attn_softcap is not None:
        raise ValueError(
            "to_hf writes a model with qk_norm as Gemma 3, which transformers runs without "
            f"an attention soft-cap; got attn_softcap={c.attn_softcap}. Set attn_softcap=None."
        )
    hf = _hf_config.decoder_to_hf(c, model_type, _ARCHITECTURES)
    del hf["hidden_act"], hf["rope_theta"]
    layer_types = c.layer_types or tuple("full_attention" if w is None else "sliding_attention"
                                         for w in c.windows)  # fmt: skip
    scalar = c.query_pre_attn_scalar or c.head_dim
    hf.update(
        hidden_activation="gelu_pytorch_tanh", num_key_value_heads=c.n_kv_heads,
        head_dim=c.head_dim,
        # transformers types it as an int
        query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
        sliding_window=c.sliding_window, layer_types=list(layer_types),
        attn_logit_softcapping=c.attn_softcap, final_logit_softcapping=c.final_softcap,
        attention_bias=False, use_bidirectional_attention=False,
    )  # fmt: skip
    if model_type == "gemma2":
        hf["rope_parameters"] = {"rope_type": "default", "rope_theta": c.rope_theta}
        return hf
    scaling = c.rope_scaling
    full = {"rope_type": "default", "rope_theta": c.rope_theta}
    if scaling is not None:
        full.update(rope_type="linear", factor=scaling.factor)
    hf["rope_parameters"] = {
        "full_attention": full,
        "sliding_attention": {"rope_type": "default",
                              "rope_theta": c.rope_local_theta or c.rope_theta},
    }  # fmt: skip
    return hf
