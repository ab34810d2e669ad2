"""The zoo's two families as `eqx_longctx.ModelFamily` plugins, registered under the
`eqx_longctx.models` entry-point group in `pyproject.toml`.

Each family module (`models/llama.py`, `models/deepseek.py`) is imported on first use, so
looking one family up does not import the other.
"""

import dataclasses
import importlib
import math
from typing import Any

from eqx_longctx.family import AttentionShape, ModelFamily, MoEShape


class _ZooFamily(ModelFamily):
    """A family whose config class, model class, presets and Hugging Face converters live
    in one module of this package."""

    _module: str
    _names: tuple[str, str]  # config class, model class

    @property
    def _mod(self):
        return importlib.import_module(self._module)

    @property
    def config(self) -> type:  # type: ignore[override]
        return getattr(self._mod, self._names[0])

    @property
    def model(self) -> type:  # type: ignore[override]
        return getattr(self._mod, self._names[1])

    @property
    def presets(self):  # type: ignore[override]
        return self._mod.PRESETS

    def from_hf(self, path: Any, **kwargs) -> Any:
        """Read a Hugging Face checkpoint (see the family module's `from_hf`)."""
        return self._mod.from_hf(path, **kwargs)

    def config_from_hf(self, path: Any, **kwargs) -> Any:
        """Read a Hugging Face checkpoint's config (see the family module's
        `config_from_hf`)."""
        return self._mod.config_from_hf(path, **kwargs)

    def to_hf(self, model: Any, path: Any, **kwargs) -> None:
        """Write a Hugging Face checkpoint (see the family module's `to_hf`)."""
        self._mod.to_hf(model, path, **kwargs)


def _local_routing(c: Any, expert: int) -> dict[str, Any]:
    """Config fields of the routed experts one device computes with under an expert axis
    of size `expert` (`{}` without one): `n_routed_experts / expert` experts, or more when
    the rows they receive outnumber them (`expert x top_k` per token dropless, `capacity
    x top_k` with a capacity; a token reaches each expert once), routed ungrouped."""
    if expert <= 1:
        return {}
    cf = c.capacity_factor
    rows = c.top_k * expert if cf is None else math.ceil(c.top_k * cf)
    local = min(c.n_routed_experts, max(c.n_routed_experts // expert, rows))
    return dict(n_routed_experts=local, top_k=min(local, rows), n_group=1, topk_group=1,
                capacity_factor=None)  # fmt: skip


def _mla_shape(c: Any) -> AttentionShape:
    """Multi-head latent attention's shape: keys and values up-projected per query head."""
    return AttentionShape(
        c.n_heads, c.n_heads, c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
    )


def _moe_after_dense(c: Any) -> MoEShape | None:
    """The routed experts of the `n_layers - first_k_dense` MoE layers (`None`: none)."""
    if c.n_layers <= c.first_k_dense:
        return None
    return MoEShape(
        c.n_routed_experts, c.top_k, c.capacity_factor, c.n_layers - c.first_k_dense,
        c.moe_hidden_dim,
    )  # fmt: skip


class LlamaFamily(_ZooFamily):
    """Llama 3 / Mistral / Qwen2 / Qwen3 (`models.llama`): GQA attention, SwiGLU MLP."""

    name = "llama"
    model_types = ("llama", "mistral", "qwen2", "qwen3")
    _module = "models.llama"
    _names = ("LlamaConfig", "Llama")

    def local_config(self, config: Any, *, tensor: int = 1, expert: int = 1) -> Any:
        """One layer, heads and SwiGLU width divided by `tensor` (`expert` is unused)."""
        c = config
        return dataclasses.replace(
            c, n_layers=1, layer_types=None, n_heads=c.n_heads // tensor,
            n_kv_heads=c.n_kv_heads // tensor, hidden_dim=c.hidden_dim // tensor,
            head_dim=c.head_dim,
        )  # fmt: skip

    def attention_shape(self, config: Any) -> AttentionShape:
        """`n_heads` query and `n_kv_heads` key/value heads of `head_dim`."""
        c = config
        return AttentionShape(c.n_heads, c.n_kv_heads or c.n_heads, c.head_dim, c.head_dim)


class DeepSeekFamily(_ZooFamily):
    """DeepSeek-V2 / V3 (`models.deepseek`): multi-head latent attention and routed
    experts after `first_k_dense` dense layers."""

    name = "deepseek"
    model_types = ("deepseek_v2", "deepseek_v3")
    _module = "models.deepseek"
    _names = ("DeepSeekConfig", "DeepSeek")

    def local_config(self, config: Any, *, tensor: int = 1, expert: int = 1) -> Any:
        """At most one dense and one MoE layer, heads and the dense MLP's width divided by
        `tensor`. The routed experts keep their width: their weights are stored split over a
        tensor axis but each tensor shard computes its experts whole.

        Under expert parallelism over `expert` devices, a device holds `n_routed_experts /
        expert` of the experts, and they multiply the rows its buffers receive: `expert x
        tokens x top_k` of them when dropless (every buffer has room for all of a device's
        copies), `capacity_factor x tokens x top_k` with a capacity. The local layer has
        the device's experts (more when a token's copies outnumber them) and gets as many
        rows by routing each token to that many of them (greedy routing, so that any count
        is allowed)."""
        c = config
        dense, moe = min(1, c.first_k_dense), min(1, c.n_layers - c.first_k_dense)
        routing = _local_routing(c, expert)
        if routing:
            routing["topk_method"] = "greedy"
        return dataclasses.replace(
            c, n_layers=dense + moe, first_k_dense=dense, n_heads=c.n_heads // tensor,
            hidden_dim=c.hidden_dim // tensor, **routing,
        )  # fmt: skip

    def attention_shape(self, config: Any) -> AttentionShape:
        """MLA: keys and values are up-projected per query head, so `n_heads` twice, a
        query/key width of `qk_nope_head_dim + qk_rope_head_dim` and `v_head_dim`."""
        return _mla_shape(config)

    def moe_shape(self, config: Any) -> MoEShape | None:
        """The routed experts of the `n_layers - first_k_dense` MoE layers."""
        return _moe_after_dense(config)


class KimiLinearFamily(_ZooFamily):
    """Kimi Linear (`models.kimi_linear`): Kimi Delta Attention and NoPE multi-head latent
    attention layers, routed experts after `first_k_dense` dense layers."""

    name = "kimi_linear"
    model_types = ("kimi_linear",)
    _module = "models.kimi_linear"
    _names = ("KimiLinearConfig", "KimiLinear")

    def local_config(self, config: Any, *, tensor: int = 1, expert: int = 1) -> Any:
        """One layer of each kind (attention and MLP) in order of first appearance (the
        planner pairs the full model's stacks with the local ones by kind); the MLA and KDA
        heads and the dense MLP's width divided by `tensor`; under expert parallelism the
        routed experts a device holds and the rows they receive, as
        `DeepSeekFamily.local_config` sizes them."""
        c = config
        kinds = list(dict.fromkeys(c.layer_kinds))  # the dense layers come first
        routing = _local_routing(c, expert)
        return dataclasses.replace(
            c, n_layers=len(kinds), layer_types=tuple(k.split("/")[0] for k in kinds),
            first_k_dense=sum(k.endswith("/dense") for k in kinds), n_heads=c.n_heads // tensor,
            linear_n_heads=c.linear_n_heads // tensor, hidden_dim=c.hidden_dim // tensor,
            **routing,
        )  # fmt: skip

    def attention_shape(self, config: Any) -> AttentionShape:
        """The MLA layers' shape: `n_heads` query and key/value heads (keys and values are
        up-projected per head), a query/key width of `qk_nope_head_dim + qk_rope_head_dim`
        and `v_head_dim`. The planner prices the MLA layers' attention with it; the KDA layers
        (`"linear_attention"`: linear in the sequence, no keys or values to move) are priced
        by the linear cost model (`eqx_longctx.linear.linear_attention_cost`)."""
        return _mla_shape(config)

    def moe_shape(self, config: Any) -> MoEShape | None:
        """The routed experts of the `n_layers - first_k_dense` MoE layers."""
        return _moe_after_dense(config)


class Qwen3NextFamily(_ZooFamily):
    """Qwen3-Next (`models.qwen3_next`): Gated DeltaNet and gated softmax attention layers
    (`layer_types`), routed experts with a gated shared expert."""

    name = "qwen3_next"
    model_types = ("qwen3_next",)
    _module = "models.qwen3_next"
    _names = ("Qwen3NextConfig", "Qwen3Next")

    def local_config(self, config: Any, *, tensor: int = 1, expert: int = 1) -> Any:
        """One layer of each kind (attention and MLP) in order of first appearance (as
        `KimiLinearFamily.local_config`: the planner pairs the full model's stacks with the
        local ones by kind); attention and DeltaNet heads, the dense MLP's and the shared
        expert's widths divided by `tensor`; under expert parallelism the routed experts a
        device holds and the rows they receive, as `DeepSeekFamily.local_config` sizes
        them."""
        c = config
        kinds = list(dict.fromkeys(c.kinds))
        routing = {}
        if expert > 1 and c.n_experts:
            cf = c.capacity_factor
            rows = c.top_k * expert if cf is None else math.ceil(c.top_k * cf)
            local = min(c.n_experts, max(c.n_experts // expert, rows))
            routing = dict(n_experts=local, top_k=min(local, rows), capacity_factor=None)
        return dataclasses.replace(
            c, n_layers=len(kinds), layer_types=tuple(k.split("/")[0] for k in kinds),
            decoder_sparse_step=1,
            mlp_only_layers=tuple(i for i, k in enumerate(kinds) if k.endswith("/dense")),
            n_heads=c.n_heads // tensor, n_kv_heads=max(1, c.n_kv_heads // tensor),
            linear_n_heads=c.linear_n_heads // tensor,
            linear_n_key_heads=max(1, c.linear_n_key_heads // tensor),
            hidden_dim=c.hidden_dim // tensor,
            shared_hidden_dim=c.shared_hidden_dim // tensor if c.shared_hidden_dim else 0,
            **routing,
        )  # fmt: skip

    def attention_shape(self, config: Any) -> AttentionShape:
        """The gated softmax attention's shape: `n_heads` query and `n_kv_heads` key/value
        heads of `head_dim`. The planner prices the softmax layers' attention with it; the
        DeltaNet layers (`"linear_attention"`: linear in the sequence, no keys or values to
        move) are priced by the linear cost model
        (`eqx_longctx.linear.linear_attention_cost`)."""
        c = config
        return AttentionShape(c.n_heads, c.n_kv_heads, c.head_dim, c.head_dim)

    def moe_shape(self, config: Any) -> MoEShape | None:
        """The routed experts of the layers `Qwen3NextConfig.moe_layers` marks."""
        c = config
        layers = sum(c.moe_layers)
        if not layers:
            return None
        return MoEShape(c.n_experts, c.top_k, c.capacity_factor, layers, c.moe_hidden_dim)


class Llama4TextFamily(_ZooFamily):
    """Llama 4 text (`models.llama4`; the text part of `llama4` checkpoints too): chunked
    RoPE and global NoPE attention layers, experts with a shared expert interleaved with
    dense layers."""

    name = "llama4_text"
    model_types = ("llama4_text", "llama4")
    _module = "models.llama4"
    _names = ("Llama4Config", "Llama4")

    def local_config(self, config: Any, *, tensor: int = 1, expert: int = 1) -> Any:
        """One layer of each kind in order of first appearance (as
        `KimiLinearFamily.local_config`), heads and the dense MLP's width divided by
        `tensor` (the experts and the shared expert, one width, keep it, as DeepSeek's);
        under expert parallelism the routed experts a device holds and the rows they
        receive, as `DeepSeekFamily.local_config` sizes them."""
        c = config
        kinds = list(dict.fromkeys(c.kinds))
        routing = {}
        if expert > 1:
            cf = c.capacity_factor
            rows = c.top_k * expert if cf is None else math.ceil(c.top_k * cf)
            local = min(c.n_experts, max(c.n_experts // expert, rows))
            routing = dict(n_experts=local, top_k=min(local, rows), capacity_factor=None)
        return dataclasses.replace(
            c, n_layers=len(kinds), no_rope_layers=tuple(int(k.startswith("rope")) for k in kinds),
            layer_types=tuple(f"{k.split('/')[1]}_attention" for k in kinds),
            moe_layers=tuple(i for i, k in enumerate(kinds) if k.endswith("/moe")),
            n_heads=c.n_heads // tensor, n_kv_heads=max(1, c.n_kv_heads // tensor),
            hidden_dim=c.hidden_dim // tensor, **routing,
        )  # fmt: skip

    def attention_shape(self, config: Any) -> AttentionShape:
        """`n_heads` query and `n_kv_heads` key/value heads of `head_dim`."""
        c = config
        return AttentionShape(c.n_heads, c.n_kv_heads, c.head_dim, c.head_dim)

    def moe_shape(self, config: Any) -> MoEShape | None:
        """The routed experts of the layers in `moe_layers`."""
        c = config
        if not c.moe_layers:
            return None
        return MoEShape(c.n_experts, c.top_k, c.capacity_factor, len(c.moe_layers),
                        c.moe_hidden_dim)  # fmt: skip


class Qwen35Family(Qwen3NextFamily):
    """Qwen3.5 (`models.qwen3_next`, presets `QWEN3_5_PRESETS`): the Qwen3-Next decoder with
    Qwen3.5's checkpoint layout; the text model of its vision-language checkpoints."""

    name = "qwen3_5"
    model_types = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")

    @property
    def presets(self):  # type: ignore[override]
        return self._mod.QWEN3_5_PRESETS


class Gemma2Family(_ZooFamily):
    """Gemma 2 (`models.gemma`): local (sliding-window) and global GQA layers in turn,
    soft-capped scores and logits, four norms per block, GeGLU."""

    name = "gemma2"
    model_types = ("gemma2",)
    _module = "models.gemma"
    _names = ("GemmaConfig", "Gemma")

    def local_config(self, config: Any, *, tensor: int = 1, expert: int = 1) -> Any:
        """One global layer (every layer is built of the same modules; a global one keeps
        the most), heads and GeGLU width divided by `tensor` (`expert` is unused)."""
        c = config
        return dataclasses.replace(
            c, n_layers=1, layer_types=None, sliding_window=None, n_heads=c.n_heads // tensor,
            n_kv_heads=max(1, c.n_kv_heads // tensor), hidden_dim=c.hidden_dim // tensor,
            head_dim=c.head_dim,
        )  # fmt: skip

    def attention_shape(self, config: Any) -> AttentionShape:
        """`n_heads` query and `n_kv_heads` key/value heads of `head_dim`."""
        c = config
        return AttentionShape(c.n_heads, c.n_kv_heads, c.head_dim, c.head_dim)


class Gemma3TextFamily(Gemma2Family):
    """Gemma 3 text (`models.gemma`, presets `GEMMA3_PRESETS`; the text model of `gemma3`
    vision-language checkpoints too): five local layers per global one, q/k norms, a RoPE
    base per layer kind."""

    name = "gemma3_text"
    model_types = ("gemma3_text", "gemma3")

    @property
    def presets(self):  # type: ignore[override]
        return self._mod.GEMMA3_PRESETS


class GptOssFamily(_ZooFamily):
    """GPT-OSS (`models.gpt_oss`): attention with sinks, alternating sliding and full
    layers, experts with biases and a clamped SwiGLU in every layer."""

    name = "gpt_oss"
    model_types = ("gpt_oss",)
    _module = "models.gpt_oss"
    _names = ("GptOssConfig", "GptOss")

    def local_config(self, config: Any, *, tensor: int = 1, expert: int = 1) -> Any:
        """One layer of each kind (sliding, full) in order of first appearance (as
        `KimiLinearFamily.local_config`), the attention heads divided by `tensor` (the
        experts keep their width, as DeepSeek's); under expert parallelism the routed
        experts a device holds and the rows they receive, as `DeepSeekFamily.local_config`
        sizes them."""
        c = config
        kinds = tuple(dict.fromkeys(c.layer_types))
        routing = {}
        if expert > 1:
            cf = c.capacity_factor
            rows = c.top_k * expert if cf is None else math.ceil(c.top_k * cf)
            local = min(c.n_experts, max(c.n_experts // expert, rows))
            routing = dict(n_experts=local, top_k=min(local, rows), capacity_factor=None)
        return dataclasses.replace(
            c, n_layers=len(kinds), layer_types=kinds, n_heads=c.n_heads // tensor,
            n_kv_heads=max(1, c.n_kv_heads // tensor), **routing,
        )  # fmt: skip

    def attention_shape(self, config: Any) -> AttentionShape:
        """`n_heads` query and `n_kv_heads` key/value heads of `head_dim`."""
        c = config
        return AttentionShape(c.n_heads, c.n_kv_heads, c.head_dim, c.head_dim)

    def moe_shape(self, config: Any) -> MoEShape | None:
        """The routed experts of every layer."""
        c = config
        return MoEShape(c.n_experts, c.top_k, c.capacity_factor, c.n_layers, c.hidden_dim)


LLAMA = LlamaFamily()
"""The Llama family plugin (`--model llama`)."""
DEEPSEEK = DeepSeekFamily()
"""The DeepSeek family plugin (`--model deepseek`)."""
KIMI_LINEAR = KimiLinearFamily()
"""The Kimi Linear family plugin (`--model kimi_linear`)."""
QWEN3_NEXT = Qwen3NextFamily()
"""The Qwen3-Next family plugin (`--model qwen3_next`)."""
QWEN3_5 = Qwen35Family()
"""The Qwen3.5 family plugin (`--model qwen3_5`)."""
LLAMA4_TEXT = Llama4TextFamily()
"""The Llama 4 text family plugin (`--model llama4_text`)."""
GEMMA2 = Gemma2Family()
"""The Gemma 2 family plugin (`--model gemma2`)."""
GEMMA3_TEXT = Gemma3TextFamily()
"""The Gemma 3 text family plugin (`--model gemma3_text`)."""
GPT_OSS = GptOssFamily()
"""The GPT-OSS family plugin (`--model gpt_oss`)."""
