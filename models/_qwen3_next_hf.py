"""The Hugging Face checkpoint format of `models.qwen3_next`: `config.json` of Qwen3-Next
and Qwen3.5 to and from `Qwen3NextConfig`, and the tensor names.

Qwen3-Next packs the DeltaNet's q, k, v and z projections per key head into
`in_proj_qkvz` (`[q, k, v (r heads), z (r heads)]` for each key head, `r` value heads per
key head) and b, a into `in_proj_ba`; Qwen3.5 stores `[q | k | v]` over all heads in
`in_proj_qkv` and z, b, a apart. Both put the short convolution of q, k and v in one
`conv1d.weight` `[channels, 1, K]`, and the attention's query and output gate in one
`q_proj` (`[query, gate]` per head). Those are `Fused` tensors (`models/_hf_fused.py`);
the rest map one to one. A Qwen3.5 vision-language checkpoint (`qwen3_5`) keeps the
text model under `model.language_model.` and its config under `text_config`.

This module never imports `models.qwen3_next` (which imports it): configs arrive as
arguments and leave as the keyword arguments of `Qwen3NextConfig`.
"""

from typing import Any, Literal

from . import _hf_config, _hf_io
from ._hf import HFTensor
from ._hf_fused import Fused
from ._hybrid import runs

FAMILY = "models.qwen3_next"
_ARCHITECTURES = {
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
}
# The vision-language wrapper of each text model type: only its text_config is read.
_WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
_REQUIRED = (
    "vocab_size", "hidden_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_value_heads",
    "linear_num_key_heads", "linear_key_head_dim", "linear_value_head_dim",
)  # fmt: skip
_MOE_REQUIRED = (
    "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size",
)  # fmt: skip
_COMMON = _REQUIRED + ("intermediate_size",) + (
    "linear_conv_kernel_dim", "layer_types", "full_attention_interval", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
    "partial_rotary_factor", "tie_word_embeddings", "attention_bias", "attention_dropout",
    # Multi-token prediction (extra layers after the last, skipped) and the gate flag.
    "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings", "attn_output_gate",
    # Sliding windows: checked to be off.
    "use_sliding_window", "sliding_window", "max_window_layers",
)  # fmt: skip
_KEYS = {
    "qwen3_next": _COMMON + _MOE_REQUIRED + (
        "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob", "output_router_logits",
        "router_aux_loss_coef",
    ),
    "qwen3_5_text": _COMMON,
    # Every layer has experts, the top-k weights always renormalised; no dense MLP.
    "qwen3_5_moe_text": tuple(k for k in _COMMON if k != "intermediate_size") + _MOE_REQUIRED
    + ("output_router_logits", "router_aux_loss_coef"),
    **dict.fromkeys(_WRAPPERS, (
        "text_config", "vision_config", "tie_word_embeddings", "image_token_id",
        "video_token_id", "vision_start_token_id", "vision_end_token_id",
    )),
}  # fmt: skip
_Kind = Literal["same", "flat", "linear"]
# Multi-token-prediction layers and the vision tower: not part of the next-token logits.
_IGNORE = (r"mtp\..*", r"model\.visual\..*")


def tables(c: Any, hf: dict, path: str | None) -> _hf_io.HFTables:
    """The `HFFormat.tables` of `models.qwen3_next` for the config `c`: zoo parameter path
    -> Hugging Face tensor, the fused tensors, and the tensors reading skips. `hf` is the
    `config.json` read from `path` (its `_model_type` the outer one of a vision-language
    checkpoint, which keeps the text model's weights under `model.language_model.`), or
    the one written (`path=None`)."""
    model_type = hf["model_type"] if path is None else hf["_model_type"]
    base = "model.language_model." if model_type in _WRAPPERS else "model."
    table = _hf_io.decoder_ends(c, base)
    fused: list[Fused] = []
    D, H, hd = c.dim, c.n_heads, c.head_dim
    hv, hk, dk, dv = c.linear_n_heads, c.linear_n_key_heads, c.linear_head_dim, c.linear_v_head_dim
    r, K = hv // hk, c.linear_conv_size
    next_format = model_type == "qwen3_next"
    for n, (kind, first, _) in enumerate(runs(c.kinds)):
        stack, offsets = f"layers.{n}.layers.", (("layer", first),) if first else ()
        one = _hf_io.block_tensors(table, stack, offsets, base)

        def many(theirs, kind: _Kind, axis, *parts, stack=stack, offsets=offsets):
            parts = tuple((stack + ours, shape) for ours, shape in parts)
            tensor = HFTensor(f"{base}layers.{{layer}}.{theirs}", kind, 1, offsets)
            fused.append(Fused(tensor, parts, axis))

        mixer, ffn = kind.split("/")
        if mixer == "full_attention":
            q, gate = ("attn.wq", (D, H, hd)), ("attn.wg", (D, H, hd))
            many("self_attn.q_proj.weight", "linear", 2, q, gate)
            one("attn.wk", "self_attn.k_proj.weight", "linear")
            one("attn.wv", "self_attn.v_proj.weight", "linear")
            one("attn.wo", "self_attn.o_proj.weight", "linear", 2)
            one("attn.q_norm.weight", "self_attn.q_norm.weight")
            one("attn.k_norm.weight", "self_attn.k_norm.weight")
        else:
            la = "linear_attn."
            if next_format:
                many(la + "in_proj_qkvz.weight", "linear", 2, ("attn.wq", (D, hk, dk)),
                     ("attn.wk", (D, hk, dk)), ("attn.wv", (D, hk, r * dv)),
                     ("attn.wz", (D, hk, r * dv)))  # fmt: skip
                many(la + "in_proj_ba.weight", "linear", 2, ("attn.wb", (D, hk, r)),
                     ("attn.wa", (D, hk, r)))  # fmt: skip
            else:
                many(la + "in_proj_qkv.weight", "linear", 1, ("attn.wq", (D, hk * dk)),
                     ("attn.wk", (D, hk * dk)), ("attn.wv", (D, hv * dv)))  # fmt: skip
                one("attn.wz", la + "in_proj_z.weight", "linear")
                one("attn.wb", la + "in_proj_b.weight", "linear")
                one("attn.wa", la + "in_proj_a.weight", "linear")
            many(la + "conv1d.weight", "same", 0, ("attn.conv_q", (hk * dk, 1, K)),
                 ("attn.conv_k", (hk * dk, 1, K)), ("attn.conv_v", (hv * dv, 1, K)))  # fmt: skip
            one("attn.a_log", la + "A_log")
            one("attn.dt_bias", la + "dt_bias")
            one("attn.norm", la + "norm.weight")
            one("attn.wo", la + "out_proj.weight", "linear", 2)
        if ffn == "dense":
            for ours, theirs in _hf_io.SWIGLU:
                one(f"mlp.{ours}", f"mlp.{theirs}.weight", "linear")
            continue
        one("mlp.router", "mlp.gate.weight", "linear")
        for ours, theirs in _hf_io.SWIGLU:  # one tensor per expert, as save_pretrained writes them
            one(f"mlp.{ours}", f"mlp.experts.{{expert}}.{theirs}.weight", "linear")
            one(f"mlp.shared.{ours}", f"mlp.shared_expert.{theirs}.weight", "linear")
        one("mlp.shared_gate", "mlp.shared_expert_gate.weight", "linear")
    return _hf_io.HFTables(table, fused, _IGNORE)


def config_from_hf(hf: dict, file: str) -> tuple[dict, dict[str, Any]]:
    """`config.json` (`hf`, read from `file`) with its values' types checked, and the
    `Qwen3NextConfig` fields it describes (the checkpoint's dtype, no overrides). A
    vision-language checkpoint's (`qwen3_5`, `qwen3_5_moe`) `text_config` is what is read;
    the outer `model_type` is kept as `_model_type` in the returned dict."""
    outer_type = _hf_config.check_model_type(hf, _ARCHITECTURES, FAMILY)
    outer = hf
    if outer_type in _WRAPPERS:
        inner = _WRAPPERS[outer_type]
        _hf_config.check_config_keys(hf, _KEYS[outer_type], f"{FAMILY} ({outer_type})")
        text = hf.get("text_config")
        if not isinstance(text, dict) or text.get("model_type", inner) != inner:
            raise _hf_config.unsupported(
                "text_config", text, f"a {outer_type} checkpoint's text model is a {inner} config."
            )
        hf = {k: v for k, v in text.items() if k != "architectures"}
        hf["model_type"] = inner
        for key in ("tie_word_embeddings", "dtype", "torch_dtype"):
            if key in outer:
                hf[key] = outer[key]
    moe_type = hf.get("model_type") in ("qwen3_next", "qwen3_5_moe_text")
    dense_type = hf.get("model_type") != "qwen3_5_moe_text"
    model_type, hf = _hf_config.check_config(
        hf, file, FAMILY, _ARCHITECTURES, _KEYS,
        _REQUIRED + (_MOE_REQUIRED if moe_type else ()) + (("intermediate_size",) * dense_type),
        why="save_pretrained writes every one of them for {model_type}.",
        ints=_REQUIRED + (
            "intermediate_size", "num_experts_per_tok", "moe_intermediate_size",
            "linear_conv_kernel_dim", "full_attention_interval", "decoder_sparse_step",
            "max_position_embeddings",
        ),
        non_negative_ints=("num_experts", "shared_expert_intermediate_size"),
        reals=("rms_norm_eps", "rope_theta", "partial_rotary_factor"),
        bools=("tie_word_embeddings", "attention_bias", "norm_topk_prob"),
        objects=("rope_scaling", "rope_parameters"),
        lists=("layer_types", "mlp_only_layers"),
    )  # fmt: skip
    rules = [
        ("hidden_act", hf.get("hidden_act", "silu"), ("silu", "swish"), "the MLPs are SwiGLU."),
        ("attention_bias", hf.get("attention_bias", False), (False,),
         "transformers then adds biases to q/k/v/o; the zoo's gated attention has none. Use "
         "a checkpoint without attention biases."),
        ("attention_dropout", hf.get("attention_dropout") or 0.0, (0.0,),
         "the zoo's attention has no dropout; set it to 0."),
        ("attn_output_gate", hf.get("attn_output_gate", True), (True,),
         "the full-attention layers are gated (the zoo has no ungated Qwen3-Next attention)."),
        ("use_sliding_window", hf.get("use_sliding_window", False), (False,),
         "the full-attention layers attend to the whole context here."),
    ]  # fmt: skip
    for key, value, allowed, why in rules:
        if value not in allowed:
            raise _hf_config.unsupported(key, value, why)
    theta, rope_type, params = _hf_config.rope_from_hf(hf, file)
    factor = params.pop("partial_rotary_factor", None) or hf.get("partial_rotary_factor", 0.25)
    mrope = {"mrope_section", "mrope_interleaved"} if model_type != "qwen3_next" else set()
    if rope_type != "default" or set(params) - mrope:
        raise _hf_config.unsupported(
            "rope_parameters", {"rope_type": rope_type, **params},
            "the zoo implements plain (default) RoPE on the partial_rotary_factor of each head "
            "(Qwen3.5's mrope_section is read as plain RoPE: text positions are equal in every "
            "section). Use rope_type 'default'.",
        )  # fmt: skip
    n = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types")
    if layer_types is not None and (
        len(layer_types) != n or not set(layer_types) <= {"linear_attention", "full_attention"}
    ):
        raise _hf_config.unsupported(
            "layer_types", layer_types,
            f"it needs 'linear_attention' or 'full_attention' for each of the {n} layers.",
        )  # fmt: skip
    only = hf.get("mlp_only_layers") or []
    if not all(isinstance(i, int) and 0 <= i < n for i in only):
        raise _hf_config.unsupported(
            "mlp_only_layers", only, f"it lists layer indices in [0, {n})."
        )
    experts = hf["num_experts"] if moe_type else 0
    if (experts or not dense_type) and not hf["shared_expert_intermediate_size"]:
        raise _hf_config.unsupported(
            "shared_expert_intermediate_size", 0,
            "the zoo's Qwen3-Next / Qwen3.5 MoE always has its gated shared expert (width > 0).",
        )  # fmt: skip
    if not dense_type and not experts:
        raise _hf_config.unsupported(
            "num_experts", 0, "qwen3_5_moe_text has experts in every layer; use qwen3_5_text."
        )
    moe: dict[str, Any] = {}
    if moe_type:  # read even without experts: to_hf writes them back
        moe = dict(
            n_experts=experts, top_k=hf["num_experts_per_tok"],
            moe_hidden_dim=hf["moe_intermediate_size"],
            shared_hidden_dim=hf["shared_expert_intermediate_size"],
            # Qwen3.5-MoE always renormalises, and has experts in every layer.
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            decoder_sparse_step=hf.get("decoder_sparse_step") or 1, mlp_only_layers=tuple(only),
        )  # fmt: skip
    hf["_model_type"] = outer_type
    # Qwen3.5-MoE has no dense MLP; its (unused) width is read as the experts'.
    sizes = hf if dense_type else {**hf, "intermediate_size": hf["moe_intermediate_size"]}
    return hf, dict(
        **_hf_config.decoder_from_hf(sizes, 32768),
        n_kv_heads=hf["num_key_value_heads"],
        head_dim=hf["head_dim"],
        linear_n_heads=hf["linear_num_value_heads"],
        linear_n_key_heads=hf["linear_num_key_heads"],
        linear_head_dim=hf["linear_key_head_dim"],
        linear_v_head_dim=hf["linear_value_head_dim"],
        linear_conv_size=hf.get("linear_conv_kernel_dim") or 4,
        layer_types=None if layer_types is None else tuple(layer_types),
        full_attention_interval=hf.get("full_attention_interval") or 4,
        partial_rotary_factor=float(factor),
        rope_theta=theta,
        checkpoint_format="qwen3_next" if model_type == "qwen3_next" else "qwen3_5",
        **moe,
    )


def config_to_hf(c: Any) -> dict:
    """The `config.json` of the `Qwen3NextConfig` `c` (see `models.qwen3_next.to_hf`)."""
    next_format = c.checkpoint_format == "qwen3_next"
    moe35 = not next_format and c.n_experts > 0
    if moe35 and not (all(c.moe_layers) and c.norm_topk_prob):
        raise ValueError(
            "to_hf writes checkpoint_format='qwen3_5' with experts as Qwen3.5-MoE, which has "
            "experts in every layer and renormalises the top-k weights; got moe_layers="
            f"{c.moe_layers}, norm_topk_prob={c.norm_topk_prob}. Use "
            "checkpoint_format='qwen3_next' for other layouts."
        )
    if c.n_experts and not c.shared_hidden_dim:
        raise ValueError(
            "to_hf writes Qwen3-Next or Qwen3.5-MoE, whose MoE always has a gated shared "
            "expert; got shared_hidden_dim=0. Give the model a shared expert or drop the experts."
        )
    model_type = "qwen3_next" if next_format else "qwen3_5_moe_text" if moe35 else "qwen3_5_text"
    hf = {
        **_hf_config.decoder_to_hf(c, model_type, _ARCHITECTURES),
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "linear_num_value_heads": c.linear_n_heads,
        "linear_num_key_heads": c.linear_n_key_heads,
        "linear_key_head_dim": c.linear_head_dim,
        "linear_value_head_dim": c.linear_v_head_dim,
        "linear_conv_kernel_dim": c.linear_conv_size,
        "layer_types": list(c.layer_types),
        "attention_bias": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": c.rope_theta,
            "partial_rotary_factor": c.partial_rotary_factor,
        },
    }
    del hf["rope_theta"]
    if moe35:
        del hf["intermediate_size"]
        hf.update(
            num_experts=c.n_experts, num_experts_per_tok=c.top_k,
            moe_intermediate_size=c.moe_hidden_dim,
            shared_expert_intermediate_size=c.shared_hidden_dim,
        )  # fmt: skip
    if next_format:
        hf.update(
            num_experts=c.n_experts, num_experts_per_tok=c.top_k,
            moe_intermediate_size=c.moe_hidden_dim,
            shared_expert_intermediate_size=c.shared_hidden_dim, norm_topk_prob=c.norm_topk_prob,
            decoder_sparse_step=c.decoder_sparse_step, mlp_only_layers=list(c.mlp_only_layers),
        )  # fmt: skip
    return hf
