"""The inference planner (`plan_generate`, `python -m eqx_longctx.plan --generate`) against
the cache `init_cache` builds and against XLA.

The cache bytes per device must equal those of `init_cache` traced abstractly under an
Explicit `jax.make_mesh` (each array's shard shape, from the sharding JAX gives it). The
prefill and decode-step peaks must be within `TOLERANCE` of XLA's memory analysis of the
real prefill and decode step, compiled (never run) for abstract arrays.
"""

import json
import math
import re

import equinox as eqx
import jax
import pytest

import eqx_longctx as el
from eqx_longctx.inference import init_cache
from eqx_longctx.plan import compile_generate, compiled_bytes, main, plan_generate
from models.deepseek import DeepSeekConfig
from models.llama import LlamaConfig

TOLERANCE = 0.2
MIXED = ("sliding_attention", "sliding_attention", "full_attention", "full_attention")


def _config(family: str, **kw):
    if family == "llama":  # GQA (8 query, 4 K/V heads), sliding and full layers
        return LlamaConfig.from_preset(
            "tiny", **{"sliding_window": 256, "layer_types": MIXED, **kw}
        )
    if family == "deepseek":
        return DeepSeekConfig.from_preset("tiny", **kw)
    return el.model_family(family).config.from_preset("tiny", **kw)


def _spec(shape: dict | None, **kw) -> el.ShardingSpec | None:
    if shape is None:
        return None
    return el.ShardingSpec(jax.make_mesh(tuple(shape.values()), tuple(shape)), **kw)


def _model(family: str, config, spec):
    return eqx.filter_eval_shape(el.model_family(family).model, config, key=jax.random.key(0),
                                 spec=spec)  # fmt: skip


def _init_cache_bytes(model, batch: int, seq: int, dtype=None) -> int:
    """Bytes per device of `init_cache`, traced abstractly: each array's shard shape."""
    total = 0
    for leaf in jax.tree.leaves(eqx.filter_eval_shape(init_cache, model, batch, seq, dtype=dtype)):
        shape = leaf.shape if model.spec is None else leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shape) * leaf.dtype.itemsize
    return total


# id: (family, mesh or None for one device, batch, seq). Llama on one device, all layers
# sliding, is compiled through the CLI (test_cli_json_compiles_and_has_a_row_per_phase).
CASES = {
    "llama-data-context": ("llama", {"data": 2, "context": 4}, 2, 2048),
    "deepseek-one-device": ("deepseek", None, 2, 2048),
    "deepseek-data-context": ("deepseek", {"data": 2, "context": 4}, 2, 2048),
    # Hybrids: linear stacks' fixed-size states and their rule's prefill temporaries
    # (Gated DeltaNet on zig-zag; KDA, whose per-channel decays dominate, contiguous).
    "qwen3_next-context8-zigzag": ("qwen3_next", {"context": 8}, 1, 2048),
    "kimi_linear-data-context": ("kimi_linear", {"data": 2, "context": 4}, 2, 2048),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_prediction_is_within_tolerance_of_compiled(case):
    family, shape, batch, seq = CASES[case]
    config, spec = _config(family), _spec(shape)
    plan = plan_generate(family, config, spec, batch=batch, seq=seq)
    model = _model(family, config, spec)
    assert plan.memory.cache == _init_cache_bytes(model, batch, seq)
    prefill, decode = (compiled_bytes(c) for c in compile_generate(model, batch=batch, seq=seq))
    for name, compiled in (("prefill", prefill), ("decode", decode)):
        ratio = getattr(plan.memory, name) / compiled.device
        assert abs(ratio - 1) <= TOLERANCE, (name, ratio, plan.memory, compiled)
    # What XLA keeps between steps is the parameters and the cache: the decode step's
    # arguments, less its tokens.
    assert decode.aliased == plan.memory.cache


def test_the_plans_strategy_is_the_one_the_prefill_runs():
    """Under "auto" the prefill runs what `resolve_strategy` picks (forward and backward
    weighed: an attention call cannot know it is not differentiated); the plan priced ring
    while the compiled prefill ran Ulysses."""
    config = LlamaConfig.from_preset("tiny", max_seq_len=4096)
    spec = _spec({"data": 2, "context": 4}, strategy="auto")
    plan = plan_generate("llama", config, spec, batch=2, seq=4096)
    prefill, _ = compile_generate(_model("llama", config, spec), batch=2, seq=4096)
    text = prefill.as_text()
    ran = "ulysses" if " all-to-all(" in text else "ring" if "collective-permute" in text else "?"
    assert plan.problem["strategy"] == ran, (plan.problem["strategy"], ran)


@pytest.mark.parametrize(
    "family,shape,window,load_balance,tensor,cache_dtype",
    [
        ("llama", {"context": 8}, 100, "zigzag", None, None),  # ring of 104 slots
        ("llama", {"data": 2, "context": 4}, 256, "none", None, "bfloat16"),
        ("llama", {"tensor": 2, "context": 4}, 1000, "striped", "tensor", None),
        ("llama", {"context": 8}, 4096, "zigzag", None, None),  # window > cache: full
        ("deepseek", {"tensor": 2, "context": 4}, None, "zigzag", "tensor", "bfloat16"),
    ],
)
def test_cache_bytes_equal_init_cache(family, shape, window, load_balance, tensor, cache_dtype):
    kw = {"sliding_window": window} if family == "llama" else {}
    kw["vocab_size"] = 260  # the embedding splits over the tensor axis
    config = _config(family, **kw)
    spec = _spec(shape, load_balance=load_balance, tensor_axis=tensor,
                 batch_axis="data" if "data" in shape else None)  # fmt: skip
    for batch, seq in ((2, 1000), (4, 2048)):
        plan = plan_generate(family, config, spec, batch=batch, seq=seq, cache_dtype=cache_dtype)
        model = _model(family, config, spec)
        assert plan.memory.cache == _init_cache_bytes(model, batch, seq, cache_dtype)


def test_mla_caches_the_latent_not_per_head_keys_and_values():
    config = DeepSeekConfig.from_preset("tiny")
    plan = plan_generate("deepseek", config, None, batch=1, seq=1024)
    width = config.kv_lora_rank + config.qk_rope_head_dim
    assert len(plan.stacks) == 2  # the dense and the MoE layers
    assert all(s.entries == ((s.n_layers, 1, 1, 1024, width),) for s in plan.stacks)


GEN = ["--model", "llama", "--preset", "tiny", "--generate", "--batch", "2", "--seq", "2048"]


def test_cli_prints_the_cache_and_both_peaks(capsys):
    main([*GEN, "--mesh", "data=2,context=4", "--override", "sliding_window=256"])
    text = capsys.readouterr().out
    for word in ("cache per layer stack", "ring 256 slots", "prefill", "decode step", "peak"):
        assert word in text, text


def test_cli_json_compiles_and_has_a_row_per_phase(capsys):
    # Llama, GQA, every layer sliding (a ring of 256 slots), on one device.
    main([*GEN, "--mesh", "context=1", "--override", "sliding_window=256", "--compile", "--json"])
    record = json.loads(capsys.readouterr().out)
    assert [r["phase"] for r in record["rows"]] == ["prefill", "decode"]
    for row in record["rows"]:
        ratio = row["predicted_bytes_per_device"] / row["compiled_bytes_per_device"]
        assert abs(ratio - 1) <= TOLERANCE, row
    assert [s["ring"] for s in record["stacks"]] == [256]
    config = LlamaConfig.from_preset("tiny", sliding_window=256, max_seq_len=2048)
    spec = _spec({"context": 1})
    assert record["cache_bytes_per_device"] == _init_cache_bytes(
        _model("llama", config, spec), 2, 2048
    )


@pytest.mark.parametrize(
    "argv,match",
    [
        ([*GEN, "--train"], "--generate plans inference .*--train is a flag of the train-step"),
        ([*GEN, "--remat", "full"], "--remat is a flag of the train-step planner"),
        ([*GEN, "--memory-budget-gib", "8"], "--memory-budget-gib is a flag of the train-step"),
        ([a for a in GEN if a not in ("--seq", "2048")], "--generate needs --seq"),
        (
            ["--model", "llama", "--generate", "--seq", "64"],
            "--generate needs --model and --preset",
        ),
        ([*GEN[:4], "--train", "--seq", "64", "--prompt-len", "8"], "add --generate"),
        ([*GEN, "--prompt-len", "4096"], "1 <= prompt_len <= seq"),
        ([*GEN, "--mesh", "data=4,context=2"], "batch must be divisible by 4"),
    ],
)
def test_cli_errors_name_the_rule_and_the_fix(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert re.search(match, err), err
    assert "Traceback" not in err
    assert len([line for line in err.splitlines() if "error:" in line]) == 1
