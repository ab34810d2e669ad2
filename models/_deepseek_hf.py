"""The Hugging Face checkpoint format of `models.deepseek`: `config.json` of DeepSeek-V2
and DeepSeek-V3 to and from `DeepSeekConfig`, and the tensor names.

transformers stores every projection as a torch Linear and the routed experts one tensor
per expert (`mlp.experts.{e}.gate_proj.weight`), as DeepSeek's own checkpoints do; both
DeepSeek RoPE layouts are applied in the model, so weights map by transposing and
reshaping only. `models.deepseek.from_hf` and `to_hf` read and write the files with
`models/_hf.py`.

This module never imports `models.deepseek` (which imports it): configs arrive as
arguments and leave as the keyword arguments of `DeepSeekConfig`.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

from eqx_longctx.nn import YarnRopeScaling

from . import _hf, _hf_config, _hf_io

_ARCHITECTURES = {
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
_REQUIRED = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_hidden_layers", "num_attention_heads", "n_routed_experts", "n_shared_experts",
    "num_experts_per_tok", "first_k_dense_replace", "kv_lora_rank", "q_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "norm_topk_prob",
    "routed_scaling_factor",
)  # fmt: skip
_COMMON = _REQUIRED + (
    "num_key_value_heads", "head_dim", "qk_head_dim", "hidden_act", "max_position_embeddings",
    "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings",
    "attention_bias", "attention_dropout", "pretraining_tp", "n_group", "topk_group",
    "topk_method", "scoring_func", "moe_layer_freq",
    # Training-time and bookkeeping keys of DeepSeek's configs: the forward pass ignores them.
    "output_router_logits", "aux_loss_alpha", "seq_aux", "ep_size", "auto_map",
)  # fmt: skip
_KEYS = {
    "deepseek_v2": _COMMON + ("mlp_bias",),
    "deepseek_v3": _COMMON + ("rope_interleave", "num_nextn_predict_layers"),
}
_MAX_LEN = {"deepseek_v2": 2048, "deepseek_v3": 4096}  # transformers' defaults
_YARN_KEYS = (
    "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
    "mscale_all_dim", "attention_factor", "truncate",
)  # fmt: skip


def hf_table(c: Any) -> dict[str, _hf.HFTensor]:
    """Zoo parameter path -> Hugging Face tensor, for the `DeepSeekConfig` `c`."""
    table, stacks = _hf_io.decoder_ends(c), []
    if c.first_k_dense:
        stacks.append(("dense_layers.layers.", False, ()))
    if c.n_moe_layers:
        stacks.append(("moe_layers.layers.", True, (("layer", c.first_k_dense),)))
    for prefix, moe, offsets in stacks:
        add = _hf_io.block_tensors(table, prefix, offsets)
        add_mla(add, c.q_lora_rank)
        if not moe:
            for ours, theirs in _hf_io.SWIGLU:
                add(f"mlp.{ours}", f"mlp.{theirs}.weight", "linear")
            continue
        add("mlp.router", "mlp.gate.weight", "linear")
        if c.topk_method == "noaux_tc":
            add("mlp.score_bias", "mlp.gate.e_score_correction_bias")
        for ours, theirs in _hf_io.SWIGLU:
            add(f"mlp.{ours}", "mlp.experts.{expert}." + theirs + ".weight", "linear")
            if c.n_shared_experts:
                add(f"mlp.shared.{ours}", f"mlp.shared_experts.{theirs}.weight", "linear")
    return table


def add_mla(add: Callable[..., None], q_lora_rank: int | None) -> None:
    """Put the tensors of a multi-head latent attention layer in a table with `add` (as
    `_hf_io.block_tensors` returns it), named as DeepSeek's checkpoints (and Kimi Linear's)
    name them; `q_lora_rank` `None`: a direct query projection."""
    if q_lora_rank is None:
        add("attn.wq", "self_attn.q_proj.weight", "linear")
    else:
        add("attn.wq_a", "self_attn.q_a_proj.weight", "linear")
        add("attn.q_norm.weight", "self_attn.q_a_layernorm.weight")
        add("attn.wq_b", "self_attn.q_b_proj.weight", "linear")
    add("attn.wkv_a", "self_attn.kv_a_proj_with_mqa.weight", "linear")
    add("attn.kv_norm.weight", "self_attn.kv_a_layernorm.weight")
    add("attn.wkv_b", "self_attn.kv_b_proj.weight", "linear")
    add("attn.wo", "self_attn.o_proj.weight", "linear", n_in=2)


def tables(c: Any, hf: dict, path: str | None) -> _hf_io.HFTables:
    """The `HFFormat.tables` of `models.deepseek`: `hf_table`, and the multi-token-prediction
    modules of a DeepSeek-V3 checkpoint skipped (`num_nextn_predict_layers` extra layers
    after the last one, not part of the next-token logits)."""
    n_mtp = hf.get("num_nextn_predict_layers") or 0
    mtp_layers = "|".join(str(c.n_layers + i) for i in range(n_mtp))
    ignore = [rf"model\.layers\.({mtp_layers})\..*"] if n_mtp else []
    return _hf_io.HFTables(hf_table(c), ignore=ignore)


def config_from_hf(hf: dict, file: str) -> tuple[dict, dict[str, Any]]:
    """`config.json` (`hf`, read from `file`) with its values' types checked, and the
    `DeepSeekConfig` fields it describes (the checkpoint's dtype, no `from_hf` overrides)."""
    model_type, hf = _hf_config.check_config(
        hf, file, "models.deepseek", _ARCHITECTURES, _KEYS, _REQUIRED,
        why="the zoo does not guess them (transformers' defaults differ between DeepSeek "
        "versions). State them in config.json.",
        ints=(
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
            "num_hidden_layers", "num_attention_heads", "n_routed_experts",
            "num_experts_per_tok", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "max_position_embeddings", "n_group", "topk_group",
            "num_key_value_heads", "head_dim", "qk_head_dim", "moe_layer_freq",
        ),
        non_negative_ints=("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers"),
        reals=("rms_norm_eps", "rope_theta", "routed_scaling_factor"),
        bools=(
            "norm_topk_prob", "tie_word_embeddings", "attention_bias", "mlp_bias",
            "rope_interleave",
        ),
        objects=("rope_scaling", "rope_parameters"),
    )  # fmt: skip
    v3 = model_type == "deepseek_v3"
    n_heads, nope, rope_dim = (
        hf["num_attention_heads"], hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
    )  # fmt: skip
    # (key, value seen, values the zoo implements, why)
    rules = [
        ("hidden_act", hf.get("hidden_act", "silu"), ("silu", "swish"), "the FFNs are SwiGLU."),
        ("mlp_bias", hf.get("mlp_bias", False), (False,), "the zoo's FFNs have no biases."),
        ("attention_bias", hf.get("attention_bias", False), (False,),
         "the zoo's MLA projections have no biases."),
        ("attention_dropout", hf.get("attention_dropout") or 0.0, (0.0,),
         "the zoo's attention has no dropout."),
        ("num_key_value_heads", hf.get("num_key_value_heads"), (None, n_heads),
         "MLA up-projects one key and value per attention head, so it must equal "
         f"num_attention_heads={n_heads}."),
        ("head_dim", hf.get("head_dim"), (None, rope_dim),
         f"transformers sets it to qk_rope_head_dim={rope_dim}."),
        ("qk_head_dim", hf.get("qk_head_dim"), (None, nope + rope_dim),
         f"it is qk_nope_head_dim + qk_rope_head_dim = {nope + rope_dim}."),
        ("moe_layer_freq", hf.get("moe_layer_freq"), (None, 1),
         "every layer after first_k_dense_replace is an MoE layer."),
        ("scoring_func", hf.get("scoring_func"), (None, "sigmoid" if v3 else "softmax"),
         f"{model_type} routes with {'sigmoid' if v3 else 'softmax'} scores."),
        ("topk_method", hf.get("topk_method"),
         (None, "noaux_tc") if v3 else (None, "greedy", "group_limited_greedy"),
         f"{model_type} implements {'noaux_tc' if v3 else 'greedy and group_limited_greedy'}."),
        ("rope_interleave", hf.get("rope_interleave", True), (True, False), "it is a bool."),
    ]  # fmt: skip
    if not v3:
        # transformers ignores norm_topk_prob for V2 while DeepSeek's code normalises (and
        # then skips routed_scaling_factor): the two disagree, so only False is read.
        rules.append(
            ("norm_topk_prob", bool(hf["norm_topk_prob"]), (False,),
             "transformers' DeepSeek-V2 ignores it but DeepSeek's reference code normalises "
             "the routing weights; the two disagree, so only false is read."),
        )  # fmt: skip
    for key, value, allowed, why in rules:
        if value not in allowed:
            raise _hf_config.unsupported(key, value, why)
    topk_method = "noaux_tc" if v3 else hf.get("topk_method") or "greedy"
    n_group, topk_group = hf.get("n_group"), hf.get("topk_group")
    if topk_method == "greedy":
        n_group, topk_group = n_group or 1, topk_group or 1
    elif not isinstance(n_group, int) or not isinstance(topk_group, int):
        raise _hf_config.unsupported(
            "n_group/topk_group",
            (n_group, topk_group),
            f"topk_method={topk_method!r} needs both as integers.",
        )
    first_k = hf["first_k_dense_replace"] or 0
    if first_k > hf["num_hidden_layers"]:
        raise _hf_config.unsupported(
            "first_k_dense_replace",
            first_k,
            f"it must be <= num_hidden_layers={hf['num_hidden_layers']}.",
        )
    rope_theta, rope_scaling = _rope_from_hf(hf, file)
    return hf, dict(
        **_hf_config.decoder_from_hf(hf, _MAX_LEN[model_type]),
        moe_hidden_dim=hf["moe_intermediate_size"],
        n_routed_experts=hf["n_routed_experts"],
        n_shared_experts=hf["n_shared_experts"] or 0,
        top_k=hf["num_experts_per_tok"],
        first_k_dense=first_k,
        kv_lora_rank=hf["kv_lora_rank"],
        q_lora_rank=hf["q_lora_rank"],
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=hf["v_head_dim"],
        topk_method=topk_method,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=bool(hf["norm_topk_prob"]),
        routed_scaling_factor=hf["routed_scaling_factor"],
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rope_interleave=bool(hf.get("rope_interleave", True)),
    )


def _rope_from_hf(hf: dict, file: str) -> tuple[float, YarnRopeScaling | None]:
    """RoPE base and YaRN scaling from `rope_parameters` (transformers 5) or the older
    `rope_theta` + `rope_scaling` (DeepSeek's own configs)."""
    theta, rope_type, params = _hf_config.rope_from_hf(hf, file)
    if rope_type not in ("default", "yarn"):
        raise _hf_config.unsupported(
            "rope type",
            rope_type,
            "the zoo's DeepSeek implements 'default' (plain RoPE) and 'yarn' only.",
        )
    allowed = _YARN_KEYS if rope_type == "yarn" else ()
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise _hf_config.unsupported(
            f"{rope_type!r} RoPE parameters",
            unknown,
            f"the zoo reads {sorted(allowed)} besides rope_type and rope_theta.",
        )
    if rope_type == "default":
        return theta, None
    lacking = [k for k in ("factor", "original_max_position_embeddings") if params.get(k) is None]
    if lacking:
        raise _hf_config.unsupported(
            "'yarn' RoPE parameters", sorted(params), f"they lack {lacking}."
        )
    return theta, YarnRopeScaling(**{k: v for k, v in params.items() if v is not None})


def config_to_hf(c: Any) -> dict:
    """The `config.json` of the `DeepSeekConfig` `c`: DeepSeek-V3 for `"noaux_tc"`
    routing, else DeepSeek-V2."""
    v3 = c.topk_method == "noaux_tc"
    if not v3 and (c.norm_topk_prob or not c.rope_interleave):
        raise ValueError(
            f"to_hf writes topk_method={c.topk_method!r} as DeepSeek-V2, whose transformers "
            "model neither normalises the routing weights nor rotates RoPE halves; got "
            f"norm_topk_prob={c.norm_topk_prob}, rope_interleave={c.rope_interleave}."
        )
    model_type = "deepseek_v3" if v3 else "deepseek_v2"
    scaling = None
    if c.rope_scaling is not None:
        fields = dataclasses.asdict(c.rope_scaling)
        scaling = {"rope_type": "yarn", **{k: v for k, v in fields.items() if v is not None}}
    hf = {
        **_hf_config.decoder_to_hf(c, model_type, _ARCHITECTURES),
        "moe_intermediate_size": c.moe_hidden_dim,
        "num_key_value_heads": c.n_heads,
        "n_routed_experts": c.n_routed_experts,
        "n_shared_experts": c.n_shared_experts,
        "num_experts_per_tok": c.top_k,
        "first_k_dense_replace": c.first_k_dense,
        "kv_lora_rank": c.kv_lora_rank,
        "q_lora_rank": c.q_lora_rank,
        "qk_nope_head_dim": c.qk_nope_head_dim,
        "qk_rope_head_dim": c.qk_rope_head_dim,
        "v_head_dim": c.v_head_dim,
        "n_group": c.n_group,
        "topk_group": c.topk_group,
        "norm_topk_prob": c.norm_topk_prob,
        "routed_scaling_factor": c.routed_scaling_factor,
        "rope_scaling": scaling,
        "attention_bias": False,
    }
    if v3:
        hf.update(rope_interleave=c.rope_interleave, num_nextn_predict_layers=0)
    else:
        hf.update(topk_method=c.topk_method, mlp_bias=False)
    return hf
