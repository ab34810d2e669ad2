"""The Hugging Face checkpoint format of `models.kimi_linear`: `config.json` of Kimi Linear
to and from `KimiLinearConfig`, and the tensor names.

Moonshot's checkpoints (and transformers' `save_pretrained`, which writes them back in that
form) keep the KDA convolutions as three `[channels, 1, width]` tensors, the MoE layers
under `block_sparse_moe` with one tensor per expert (`experts.{e}.w1` gate, `w3` up, `w2`
down) and the dense layers under `mlp`; transformers writes its dense layers under
`block_sparse_moe` too, and both are read. Weights map by transposing and reshaping only.

`config.json` has two spellings of several keys: Moonshot's (`num_experts`,
`num_experts_per_token`, `moe_renormalize`, `num_expert_group`, `num_shared_experts`,
`model_max_length`, what transformers writes too) and transformers' aliases of them
(`num_local_experts`, `num_experts_per_tok`, `norm_topk_prob`, `n_group`,
`n_shared_experts`, `max_position_embeddings`); either is read. Where Moonshot's code and
transformers' defaults differ (RMSNorm epsilon, shared experts, the routed scaling factor,
the dense layers, the layer kinds), the key is required.

This module never imports `models.kimi_linear` (which imports it): configs arrive as
arguments and leave as the keyword arguments of `KimiLinearConfig`.
"""

from typing import Any

from . import _deepseek_hf, _hf, _hf_config, _hf_io, _hybrid

_ARCHITECTURES = {"kimi_linear": "KimiLinearForCausalLM"}
# transformers' alias -> the key Moonshot's config.json (and transformers' writer) uses
_ALIASES = {
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "norm_topk_prob": "moe_renormalize",
    "n_group": "num_expert_group",
    "n_shared_experts": "num_shared_experts",
    "max_position_embeddings": "model_max_length",
}
_REQUIRED = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "num_experts", "num_experts_per_token",
    "num_shared_experts", "routed_scaling_factor", "rms_norm_eps",
)  # fmt: skip
_KEYS = {
    "kimi_linear": _REQUIRED + (
        "q_lora_rank", "num_key_value_heads", "head_dim", "qk_head_dim", "hidden_act",
        "model_max_length", "tie_word_embeddings", "attention_bias", "attention_dropout",
        "num_expert_group", "topk_group", "moe_renormalize", "moe_router_activation_func",
        "use_grouped_topk", "moe_layer_freq", "first_k_dense_replace", "mlp_layer_types",
        "layer_types", "linear_attn_config", "linear_num_heads", "linear_head_dim",
        "linear_conv_kernel_dim", "mla_use_nope", "num_nextn_predict_layers", "rope_theta",
        "rope_scaling",
        # Training-time and bookkeeping keys: the forward pass ignores them.
        "output_router_logits", "pretraining_tp", "auto_map",
    )
}  # fmt: skip
# linear_attn_config key -> the top-level key transformers also reads it from
_LINEAR = {
    "num_heads": "linear_num_heads",
    "head_dim": "linear_head_dim",
    "short_conv_kernel_size": "linear_conv_kernel_dim",
}
_KIMI_48B_LINEAR = {"num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4}
ATTENTION_KINDS = ("linear_attention", "full_attention")
"""The `layer_types` entries: a Kimi Delta Attention layer, a multi-head latent attention
layer (transformers' names)."""


def layer_kinds(c: Any) -> tuple[str, ...]:
    """Each layer's kind, `"{attention}/{ffn}"`: `attention` from `c.attention_types`, `ffn`
    `"dense"` for the first `c.first_k_dense` layers and `"moe"` after them."""
    return tuple(
        f"{attn}/{'dense' if i < c.first_k_dense else 'moe'}"
        for i, attn in enumerate(c.attention_types)
    )


def hf_table(c: Any, *, dense_prefix: str = "mlp") -> dict[str, _hf.HFTensor]:
    """Zoo parameter path -> Hugging Face tensor, for the `KimiLinearConfig` `c`; the dense
    layers' feed-forward is under `dense_prefix` (`"mlp"`, as Moonshot writes them, or
    `"block_sparse_moe"`, as transformers does)."""
    table = _hf_io.decoder_ends(c)
    h, conv = c.linear_n_heads, (c.linear_n_heads * c.linear_head_dim, 1, c.conv_size)
    for i, (kind, first, _) in enumerate(_hybrid.runs(layer_kinds(c))):
        attn, ffn = kind.split("/")
        add = _hf_io.block_tensors(table, f"stacks.{i}.layers.", (("layer", first),))
        if attn == "linear_attention":
            for ours in ("q", "k", "v"):
                add(f"attn.w{ours}", f"self_attn.{ours}_proj.weight", "linear")
                add(f"attn.conv_{ours}", f"self_attn.{ours}_conv1d.weight", stored_shape=conv)
            for ours, theirs in (("f_a", "f_a"), ("f_b", "f_b"), ("g_a", "g_a"),
                                 ("g_b", "g_b"), ("wb", "b")):  # fmt: skip
                add(f"attn.{ours}", f"self_attn.{theirs}_proj.weight", "linear")
            add("attn.dt_bias", "self_attn.dt_bias", "flat")
            add("attn.a_log", "self_attn.A_log", stored_shape=(1, 1, h, 1))
            add("attn.norm", "self_attn.o_norm.weight")
            add("attn.wo", "self_attn.o_proj.weight", "linear", n_in=2)
        else:
            _deepseek_hf.add_mla(add, c.q_lora_rank)
        if ffn == "dense":
            for ours, theirs in _hf_io.SWIGLU:
                add(f"mlp.{ours}", f"{dense_prefix}.{theirs}.weight", "linear")
            continue
        add("mlp.router", "block_sparse_moe.gate.weight", "linear")
        add("mlp.score_bias", "block_sparse_moe.gate.e_score_correction_bias")
        for ours, theirs in (("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2")):
            add(f"mlp.{ours}", "block_sparse_moe.experts.{expert}." + theirs + ".weight", "linear")
        if c.n_shared_experts:
            for ours, theirs in _hf_io.SWIGLU:
                add(f"mlp.shared.{ours}", f"block_sparse_moe.shared_experts.{theirs}.weight",
                    "linear")  # fmt: skip
    return table


def dense_prefix(names: set[str]) -> str:
    """Where a checkpoint with tensors `names` keeps its dense layers' feed-forward:
    `"block_sparse_moe"` when transformers wrote it, else `"mlp"` (Moonshot's)."""
    dense = [n for n in names if n.endswith(".block_sparse_moe.gate_proj.weight")]
    return "block_sparse_moe" if dense else "mlp"


def tables(c: Any, hf: dict, path: str | None) -> _hf_io.HFTables:
    """The `HFFormat.tables` of `models.kimi_linear`: `hf_table`, the dense layers'
    feed-forward where the checkpoint at `path` keeps it (`dense_prefix`), or for writing
    (`path=None`) where Moonshot's do."""
    if path is None:
        return _hf_io.HFTables(hf_table(c))
    with _hf.SafetensorsCheckpoint(path) as checkpoint:
        prefix = dense_prefix(checkpoint.names)
    return _hf_io.HFTables(hf_table(c, dense_prefix=prefix))


def config_from_hf(hf: dict, file: str) -> tuple[dict, dict[str, Any]]:
    """`config.json` (`hf`, read from `file`) with its values' types checked, and the
    `KimiLinearConfig` fields it describes (the checkpoint's dtype, no `from_hf`
    overrides)."""
    hf = _unalias(hf)
    _, hf = _hf_config.check_config(
        hf, file, "models.kimi_linear", _ARCHITECTURES, _KEYS, _REQUIRED,
        why="the zoo does not guess them (Moonshot's code and transformers' defaults "
        "differ). State them in config.json.",
        ints=(
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
            "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "q_lora_rank",
            "qk_nope_head_dim", "v_head_dim", "num_experts", "num_experts_per_token",
            "model_max_length", "num_expert_group", "topk_group", "num_key_value_heads",
            "qk_head_dim", "moe_layer_freq", "linear_num_heads", "linear_head_dim",
            "linear_conv_kernel_dim",
        ),
        non_negative_ints=(
            "num_shared_experts", "first_k_dense_replace", "qk_rope_head_dim",
            "num_nextn_predict_layers", "head_dim",
        ),
        reals=("rms_norm_eps", "routed_scaling_factor", "rope_theta"),
        bools=(
            "moe_renormalize", "tie_word_embeddings", "attention_bias", "use_grouped_topk",
            "mla_use_nope",
        ),
        objects=("linear_attn_config", "rope_scaling"),
        lists=("layer_types", "mlp_layer_types"),
    )  # fmt: skip
    n_layers, n_heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    nope, rope = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
    n_group = hf.get("num_expert_group") or 1
    # (key, value seen, values the zoo implements, why)
    rules = [
        ("hidden_act", hf.get("hidden_act", "silu"), ("silu", "swish"),
         "the FFNs are SwiGLU and the short convolutions use SiLU."),
        ("attention_bias", hf.get("attention_bias", False), (False,),
         "the zoo's MLA projections have no biases."),
        ("attention_dropout", hf.get("attention_dropout") or 0.0, (0.0,),
         "the zoo's attention has no dropout."),
        ("num_key_value_heads", hf.get("num_key_value_heads"), (None, n_heads),
         "MLA up-projects one key and value per attention head, so it must equal "
         f"num_attention_heads={n_heads}."),
        ("qk_head_dim", hf.get("qk_head_dim"), (None, nope + rope),
         f"it is qk_nope_head_dim + qk_rope_head_dim = {nope + rope}."),
        ("mla_use_nope", hf.get("mla_use_nope", True), (True,),
         "transformers' Kimi Linear applies no RoPE in its MLA layers (NoPE), which is "
         "what the zoo implements; set it to true."),
        ("rope_scaling", hf.get("rope_scaling"), (None,),
         "the MLA layers use no position encoding (NoPE), so there is nothing to scale."),
        ("moe_router_activation_func", hf.get("moe_router_activation_func"), (None, "sigmoid"),
         "Kimi Linear routes with sigmoid scores."),
        ("use_grouped_topk", hf.get("use_grouped_topk", True) or n_group == 1, (True,),
         "transformers always picks the experts group-limited; with num_expert_group > 1 "
         "ungrouped routing differs. Set it to true (or num_expert_group to 1)."),
        ("moe_layer_freq", hf.get("moe_layer_freq"), (None, 1),
         "every layer after the dense ones is an MoE layer."),
        ("num_nextn_predict_layers", hf.get("num_nextn_predict_layers") or 0, (0,),
         "the zoo reads no multi-token-prediction layers."),
    ]  # fmt: skip
    for key, value, allowed, why in rules:
        if value not in allowed:
            raise _hf_config.unsupported(key, value, why)
    linear = _linear_dims(hf)
    return hf, dict(
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        n_layers=n_layers,
        n_heads=n_heads,
        hidden_dim=hf["intermediate_size"],
        moe_hidden_dim=hf["moe_intermediate_size"],
        n_routed_experts=hf["num_experts"],
        n_shared_experts=hf["num_shared_experts"],
        top_k=hf["num_experts_per_token"],
        first_k_dense=_first_k_dense(hf, n_layers),
        kv_lora_rank=hf["kv_lora_rank"],
        q_lora_rank=hf.get("q_lora_rank"),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=hf["v_head_dim"],
        layer_types=_layer_types(hf, n_layers),
        linear_n_heads=linear["num_heads"],
        linear_head_dim=linear["head_dim"],
        conv_size=linear["short_conv_kernel_size"],
        n_group=n_group,
        topk_group=hf.get("topk_group") or 1,
        norm_topk_prob=bool(hf.get("moe_renormalize", True)),
        routed_scaling_factor=hf["routed_scaling_factor"],
        norm_eps=hf["rms_norm_eps"],
        max_seq_len=hf.get("model_max_length") or 1048576,  # both codes' default
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        param_dtype=_hf_config.stored_dtype(hf),
        compute_dtype=_hf_config.stored_dtype(hf),
    )


def _unalias(hf: dict) -> dict:
    """`hf` with transformers' aliases renamed to Moonshot's keys."""
    out = dict(hf)
    for alias, key in _ALIASES.items():
        if alias not in out:
            continue
        value = out.pop(alias)
        if key in out and out[key] != value:
            raise ValueError(
                f"config.json gives {key}={out[key]!r} and its transformers alias "
                f"{alias}={value!r}; keep one."
            )
        out[key] = value
    return out


def _linear_dims(hf: dict) -> dict[str, int]:
    """KDA's heads, head width and convolution width, from `linear_attn_config` (which
    transformers prefers) or the top-level `linear_*` keys; Kimi-Linear-48B's where the
    model has no KDA layer."""
    lac = hf.get("linear_attn_config") or {}
    known = set(_LINEAR) | {"kda_layers", "full_attn_layers"}
    unknown = sorted(set(lac) - known)
    if unknown:
        raise _hf_config.unsupported(
            "linear_attn_config keys", unknown, f"the zoo reads {sorted(known)} (others may "
            "change the KDA layers, e.g. a gate bound)."
        )  # fmt: skip
    lac = _hf_config.check_config_types(
        lac, "config.json", ints=tuple(_LINEAR), prefix="linear_attn_config."
    )
    has_kda = "linear_attention" in _layer_types(hf, hf["num_hidden_layers"])
    out = {}
    for key, top in _LINEAR.items():
        nested, flat = lac.get(key), hf.get(top)
        if nested is not None and flat is not None and nested != flat:
            raise _hf_config.unsupported(
                f"linear_attn_config.{key}/{top}", (nested, flat), "they must agree."
            )
        value = nested if nested is not None else flat
        if value is None and has_kda:
            raise ValueError(
                f"config.json lacks linear_attn_config.{key} (or {top}), which the KDA "
                "layers need; the zoo does not guess it. State it in config.json."
            )
        out[key] = value if value is not None else _KIMI_48B_LINEAR[key]
    return out


def _layer_types(hf: dict, n_layers: int) -> tuple[str, ...]:
    """Each layer's attention, from `linear_attn_config`'s 1-based `kda_layers` and
    `full_attn_layers` (Moonshot's) or `layer_types` (transformers', which it prefers); if
    both are given they must agree."""
    lac = hf.get("linear_attn_config") or {}
    from_lists = None
    if "kda_layers" in lac or "full_attn_layers" in lac:
        kda, full = lac.get("kda_layers"), lac.get("full_attn_layers")
        if not (isinstance(kda, list) and isinstance(full, list)) or sorted(kda + full) != list(
            range(1, n_layers + 1)
        ):
            raise _hf_config.unsupported(
                "linear_attn_config kda_layers/full_attn_layers", (kda, full),
                f"together they must number each of the num_hidden_layers={n_layers} layers "
                "exactly once, counting from 1.",
            )  # fmt: skip
        from_lists = tuple(
            "linear_attention" if i + 1 in kda else "full_attention" for i in range(n_layers)
        )  # fmt: skip
    types = hf.get("layer_types")
    if types is not None:
        if len(types) != n_layers or not set(types) <= set(ATTENTION_KINDS):
            raise _hf_config.unsupported(
                "layer_types", types, f"it needs num_hidden_layers={n_layers} entries, each "
                f"one of {ATTENTION_KINDS}."
            )  # fmt: skip
        if from_lists is not None and tuple(types) != from_lists:
            raise _hf_config.unsupported(
                "layer_types", types, "it disagrees with linear_attn_config's kda_layers and "
                "full_attn_layers (transformers reads layer_types, Moonshot's code the lists); "
                "make them agree."
            )  # fmt: skip
        return tuple(types)
    if from_lists is None:
        raise ValueError(
            "config.json names neither layer_types nor linear_attn_config's kda_layers and "
            "full_attn_layers; the zoo does not guess which layers are KDA (transformers and "
            "Moonshot's code default differently). State them in config.json."
        )
    return from_lists


def _first_k_dense(hf: dict, n_layers: int) -> int:
    """The number of leading dense layers, from `mlp_layer_types` (transformers', which it
    prefers) or `first_k_dense_replace` (Moonshot's); if both are given they must agree."""
    first_k, types = hf.get("first_k_dense_replace"), hf.get("mlp_layer_types")
    if types is not None:
        k = types.count("dense")
        if len(types) != n_layers or types != ["dense"] * k + ["sparse"] * (n_layers - k):
            raise _hf_config.unsupported(
                "mlp_layer_types", types, f"the zoo builds num_hidden_layers={n_layers} "
                "layers, the first ones 'dense' and the rest 'sparse' (MoE)."
            )  # fmt: skip
        if first_k is not None and first_k != k:
            raise _hf_config.unsupported(
                "first_k_dense_replace", first_k, f"mlp_layer_types has {k} leading dense "
                "layers (transformers reads mlp_layer_types, Moonshot's code "
                "first_k_dense_replace); make them agree."
            )  # fmt: skip
        return k
    if first_k is None:
        raise ValueError(
            "config.json names neither first_k_dense_replace nor mlp_layer_types; the zoo does "
            "not guess the dense layers (transformers defaults to 1, Moonshot's code to 0). "
            "State first_k_dense_replace in config.json."
        )
    if first_k > n_layers:
        raise _hf_config.unsupported(
            "first_k_dense_replace", first_k, f"it must be <= num_hidden_layers={n_layers}."
        )
    return first_k


def config_to_hf(c: Any) -> dict:
    """The `config.json` of the `KimiLinearConfig` `c`, in Moonshot's form (which
    transformers reads)."""
    kinds = c.attention_types
    return {
        "architectures": [_ARCHITECTURES["kimi_linear"]],
        "model_type": "kimi_linear",
        "vocab_size": c.vocab_size,
        "hidden_size": c.dim,
        "intermediate_size": c.hidden_dim,
        "moe_intermediate_size": c.moe_hidden_dim,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_heads,
        "hidden_act": "silu",
        "rms_norm_eps": c.norm_eps,
        "model_max_length": c.max_seq_len,
        "tie_word_embeddings": c.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "kv_lora_rank": c.kv_lora_rank,
        "q_lora_rank": c.q_lora_rank,
        "qk_nope_head_dim": c.qk_nope_head_dim,
        "qk_rope_head_dim": c.qk_rope_head_dim,
        "v_head_dim": c.v_head_dim,
        "mla_use_nope": True,
        "linear_attn_config": {
            "kda_layers": [i + 1 for i, k in enumerate(kinds) if k == "linear_attention"],
            "full_attn_layers": [i + 1 for i, k in enumerate(kinds) if k == "full_attention"],
            "num_heads": c.linear_n_heads,
            "head_dim": c.linear_head_dim,
            "short_conv_kernel_size": c.conv_size,
        },
        "num_experts": c.n_routed_experts,
        "num_experts_per_token": c.top_k,
        "num_shared_experts": c.n_shared_experts,
        "first_k_dense_replace": c.first_k_dense,
        "moe_layer_freq": 1,
        "moe_renormalize": c.norm_topk_prob,
        "moe_router_activation_func": "sigmoid",
        "use_grouped_topk": True,
        "num_expert_group": c.n_group,
        "topk_group": c.topk_group,
        "routed_scaling_factor": c.routed_scaling_factor,
        "num_nextn_predict_layers": 0,
        # transformers' defaults (Kimi's tokenizer ids) would not fit another vocabulary.
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": c.param_dtype,
    }
