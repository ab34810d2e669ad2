"""The Hugging Face checkpoint format of `models.gpt_oss`: `config.json` of GPT-OSS to and
from `GptOssConfig`, and the tensor names.

Attention maps as Llama's does (q/k/v/o `nn.Linear` weights and biases), plus one `sinks`
logit per query head. The experts are stored per layer, all experts in one tensor each,
already `[in, out]` (no transpose): `gate_up_proj` `[experts, embed, 2 * hidden]` holds
the gate and up projections *interleaved* (column `2i` is the gate's `i`, `2i + 1` the
up's), and `gate_up_proj_bias` `[experts, 2 * hidden]` likewise; the zoo keeps `w_gate`
and `w_up` apart, so both are `Fused` tensors (`models/_hf_fused.py`) whose parts are the
two halves of a trailing axis of 2. The router is an `nn.Linear` with a bias.

OpenAI's released checkpoints store the experts in MXFP4 (`quantization_config`); the
zoo reads unquantized weights only, so those are refused with the way to dequantize.

This module never imports `models.gpt_oss` (which imports it): configs arrive as arguments
and leave as the keyword arguments of `GptOssConfig`.
"""

import dataclasses
from typing import Any

from eqx_longctx.nn import YarnRopeScaling

from . import _hf_config, _hf_io
from ._hf import HFTensor
from ._hf_fused import Fused
from ._hybrid import runs

FAMILY = "models.gpt_oss"
_ARCHITECTURES = {"gpt_oss": "GptOssForCausalLM"}
_REQUIRED = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "num_local_experts", "num_experts_per_tok",
)  # fmt: skip
_KEYS = {
    "gpt_oss": _REQUIRED + (
        "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_theta",
        "rope_scaling", "rope_parameters", "tie_word_embeddings", "attention_dropout",
        "attention_bias", "sliding_window", "layer_types", "swiglu_alpha", "swiglu_limit",
        # the training-time router loss: no effect on the logits
        "router_aux_loss_coef", "output_router_logits",
        # OpenAI's own names in the released config.json (transformers ignores them)
        "experts_per_token", "initial_context_length",
    ),
}  # fmt: skip
_YARN_KEYS = (
    "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
    "mscale_all_dim", "attention_factor", "truncate",
)  # fmt: skip
HF_DEFAULT_THETA = 150000.0  # GptOssConfig.default_theta
HF_DEFAULT_YARN = YarnRopeScaling(32.0, 4096, 32.0, 1.0, truncate=False)
"""transformers' `rope_parameters` when a GPT-OSS `config.json` gives none (the released
models' own)."""


def tables(c: Any, hf: dict, path: str | None) -> _hf_io.HFTables:
    """The `HFFormat.tables` of `models.gpt_oss` for the config `c`: zoo parameter path
    -> Hugging Face tensor, and the fused expert tensors."""
    table = _hf_io.decoder_ends(c)
    fused: list[Fused] = []
    E, D, F = c.n_experts, c.dim, c.hidden_dim
    for n, (_, first, _) in enumerate(runs(c.layer_types)):  # one LayerStack per run
        stack, offsets = f"layers.{n}.layers.", (("layer", first),) if first else ()
        one = _hf_io.block_tensors(table, stack, offsets)
        for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
            one(f"attn.w{ours}", f"self_attn.{theirs}.weight", "linear")
            if c.attention_bias:
                one(f"attn.b{ours}", f"self_attn.{theirs}.bias", "flat")
        one("attn.wo", "self_attn.o_proj.weight", "linear", 2)
        if c.attention_bias:
            one("attn.bo", "self_attn.o_proj.bias")
        one("attn.sinks", "self_attn.sinks")
        one("mlp.router", "mlp.router.weight", "linear")
        one("mlp.router_bias", "mlp.router.bias")
        one("mlp.w_down", "mlp.experts.down_proj")
        one("mlp.b_down", "mlp.experts.down_proj_bias")
        # gate and up interleaved: the parts are [..., hidden, 1] each, fused along the last
        for theirs, (gate, up), shape in (
            ("gate_up_proj", ("w_gate", "w_up"), (E, D, F)),
            ("gate_up_proj_bias", ("b_gate", "b_up"), (E, F)),
        ):
            name = f"model.layers.{{layer}}.mlp.experts.{theirs}"
            stored = (*shape[:-1], 2 * F)
            tensor = HFTensor(name, "same", 1, offsets, stored)
            parts = tuple((f"{stack}mlp.{ours}", (*shape, 1)) for ours in (gate, up))
            fused.append(Fused(tensor, parts, len(shape)))
    return _hf_io.HFTables(table, fused)


def config_from_hf(hf: dict, file: str) -> tuple[dict, dict[str, Any]]:
    """`config.json` (`hf`, read from `file`) with its values' types checked, and the
    `GptOssConfig` fields it describes (the checkpoint's dtype, no `from_hf` overrides)."""
    quant = hf.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise _hf_config.unsupported(
            "quantization_config", {"quant_method": method},
            "the zoo reads unquantized weights only. Dequantize the checkpoint first, e.g. "
            "load it with transformers' GptOssForCausalLM.from_pretrained(path, "
            "quantization_config=Mxfp4Config(dequantize=True)) and save_pretrained it.",
        )  # fmt: skip
    _, hf = _hf_config.check_config(
        hf, file, FAMILY, _ARCHITECTURES, _KEYS, _REQUIRED,
        why="every gpt_oss config states them.",
        ints=_REQUIRED + (
            "head_dim", "max_position_embeddings", "sliding_window", "experts_per_token",
            "initial_context_length",
        ),
        reals=("rms_norm_eps", "rope_theta", "swiglu_alpha", "swiglu_limit"),
        bools=("tie_word_embeddings", "attention_bias"),
        objects=("rope_scaling", "rope_parameters"),
        lists=("layer_types",),
    )  # fmt: skip
    if hf.get("attention_dropout") not in (None, 0, 0.0):
        raise _hf_config.unsupported(
            "attention_dropout", hf["attention_dropout"], "the zoo's attention has no dropout."
        )
    top_k = hf["num_experts_per_tok"]
    if hf.get("experts_per_token") not in (None, top_k):
        raise _hf_config.unsupported(
            "experts_per_token", hf["experts_per_token"],
            f"it contradicts num_experts_per_tok={top_k} (which transformers uses); make "
            "them equal.",
        )  # fmt: skip
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:  # transformers' default: sliding, full, sliding, ...
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    if len(types) != n or not set(types) <= {"sliding_attention", "full_attention"}:
        raise _hf_config.unsupported(
            "layer_types", types,
            f"it needs 'sliding_attention' or 'full_attention' for each of the {n} layers.",
        )  # fmt: skip
    window = hf.get("sliding_window", 128)
    if window is None and "sliding_attention" in types:
        raise _hf_config.unsupported(
            "sliding_window", None,
            "layer_types marks sliding layers, which need a window; set sliding_window.",
        )  # fmt: skip
    rope_theta, rope_scaling = _rope_from_hf(hf, file)
    return hf, dict(
        **_hf_config.decoder_from_hf(hf, 131072),
        n_kv_heads=hf["num_key_value_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        n_experts=hf["num_local_experts"],
        top_k=top_k,
        sliding_window=window if "sliding_attention" in types else None,
        layer_types=tuple(types),
        attention_bias=bool(hf.get("attention_bias", True)),
        swiglu_alpha=float(hf.get("swiglu_alpha") or 1.702),
        swiglu_limit=float(hf.get("swiglu_limit") or 7.0),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
    )


def _rope_from_hf(hf: dict, file: str) -> tuple[float, YarnRopeScaling | None]:
    """RoPE base and YaRN scaling from `rope_parameters` (transformers 5) or the older
    `rope_theta` + `rope_scaling` (the released config.json); transformers' defaults (base
    150000, `HF_DEFAULT_YARN`) where the file gives none."""
    stated = hf.get("rope_parameters") or hf.get("rope_scaling")
    theta, rope_type, params = _hf_config.rope_from_hf(hf, file)
    if hf.get("rope_theta") is None and (stated or {}).get("rope_theta") is None:
        theta = HF_DEFAULT_THETA
    if not stated:
        return theta, HF_DEFAULT_YARN
    if rope_type not in ("default", "yarn"):
        raise _hf_config.unsupported(
            "rope type", rope_type, "the zoo's GPT-OSS implements 'yarn' and 'default' only."
        )
    allowed = _YARN_KEYS if rope_type == "yarn" else ()
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise _hf_config.unsupported(
            f"{rope_type!r} RoPE parameters", unknown,
            f"the zoo reads {sorted(allowed)} besides rope_type and rope_theta.",
        )  # fmt: skip
    if rope_type == "default":
        return theta, None
    lacking = [k for k in ("factor", "original_max_position_embeddings") if params.get(k) is None]
    if lacking:
        raise _hf_config.unsupported(
            "'yarn' RoPE parameters", sorted(params), f"they lack {lacking}."
        )
    return theta, YarnRopeScaling(**{k: v for k, v in params.items() if v is not None})


def config_to_hf(c: Any) -> dict:
    """The `config.json` of the `GptOssConfig` `c` (see `models.gpt_oss.to_hf`)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling is not None:
        fields = dataclasses.asdict(c.rope_scaling)
        rope.update(rope_type="yarn", **{k: v for k, v in fields.items() if v is not None})
    hf = {
        **_hf_config.decoder_to_hf(c, "gpt_oss", _ARCHITECTURES),
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "num_local_experts": c.n_experts,
        "num_experts_per_tok": c.top_k,
        "sliding_window": c.sliding_window,
        "layer_types": list(c.layer_types),
        "attention_bias": c.attention_bias,
        "swiglu_alpha": c.swiglu_alpha,
        "swiglu_limit": c.swiglu_limit,
        "rope_parameters": rope,
    }
    del hf["rope_theta"]
    return hf
