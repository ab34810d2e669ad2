"""Checkpoints keep loading: every parameter's pytree path, shape and dtype, for each
family's presets and the Llama variants (q/k norm, biases, sliding windows, tied
embeddings) and DeepSeek variants (direct queries, no dense or no MoE blocks), equal those
recorded before the block and RoPE were unified (commit 665ea13).

The fixture `tests/data/param_paths.json` was written by running this file as a script
against that commit: `PYTHONPATH=<checkout of 665ea13> python tests/test_param_paths.py`.
Only shapes are traced (`eqx.filter_eval_shape`), so the full-size presets cost nothing.
"""

import json
import sys
from pathlib import Path

import equinox as eqx
import jax
import pytest

FIXTURE = Path(__file__).resolve().parent / "data" / "param_paths.json"

LLAMA_VARIANTS = {
    "qk_norm": dict(qk_norm=True),
    "attention_bias": dict(attention_bias=True),
    "tie_embeddings": dict(tie_embeddings=True),
    "sliding_window": dict(sliding_window=16),
    "mixed_windows": dict(
        sliding_window=16,
        layer_types=("full_attention", "sliding_attention", "sliding_attention", "full_attention"),
        qk_norm=True,
    ),
    "bfloat16": dict(param_dtype="bfloat16"),
}
DEEPSEEK_VARIANTS = {
    "direct_queries": dict(q_lora_rank=None),
    "all_moe": dict(first_k_dense=0),
    "all_dense": dict(first_k_dense=3),
    "tie_embeddings": dict(tie_embeddings=True),
}


def configs() -> dict[str, tuple[type, object]]:
    """name -> (model class, config) for every case the fixture records."""
    from models import deepseek, llama

    cases = {}
    for module, model, variants in (
        (llama, llama.Llama, LLAMA_VARIANTS),
        (deepseek, deepseek.DeepSeek, DEEPSEEK_VARIANTS),
    ):
        family = module.__name__.split(".")[-1]
        for name, config in module.PRESETS.items():
            cases[f"{family}/{name}"] = (model, config)
        config_cls = type(module.PRESETS["tiny"])
        for name, overrides in variants.items():
            cases[f"{family}/tiny+{name}"] = (model, config_cls.from_preset("tiny", **overrides))
    return cases


def param_paths(model_cls: type, config: object) -> list[list]:
    """`[key path, shape, dtype]` of every array leaf of the model, in pytree order."""
    model = eqx.filter_eval_shape(model_cls, config, key=jax.random.key(0))
    params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return [[jax.tree_util.keystr(p), list(a.shape), str(a.dtype)] for p, a in leaves]


def recorded() -> dict[str, list[list]]:
    return json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}


@pytest.mark.parametrize("case", sorted(recorded()))
def test_parameter_paths_shapes_and_dtypes_unchanged(case):
    assert param_paths(*configs()[case]) == recorded()[case]


def test_fixture_covers_every_case():
    assert sorted(recorded()) == sorted(configs())


if __name__ == "__main__":
    import models

    print(f"recording {models.__file__}", file=sys.stderr)
    table = {name: param_paths(*case) for name, case in configs().items()}
    cases = [
        f"{json.dumps(name)}: [\n" + ",\n".join(json.dumps(leaf) for leaf in leaves) + "\n]"
        for name, leaves in sorted(table.items())
    ]
    FIXTURE.write_text("{\n" + ",\n".join(cases) + "\n}\n")  # one leaf per line
    print(f"wrote {len(table)} cases to {FIXTURE}", file=sys.stderr)
