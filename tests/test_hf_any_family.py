"""`eqx_longctx.from_hf` / `to_hf`: one reader and one writer for every installed family,
picked by `config.json`'s `model_type` and by the model's class."""

import json

import equinox as eqx
import jax
import numpy as np
import pytest

import eqx_longctx as el
from models.deepseek import DeepSeek, DeepSeekConfig
from models.llama import Llama, LlamaConfig

pytest.importorskip("safetensors")


def _same_weights(a, b):
    la = jax.tree.leaves(eqx.filter(a, eqx.is_array))
    lb = jax.tree.leaves(eqx.filter(b, eqx.is_array))
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(
    "model",
    [
        lambda: Llama(LlamaConfig(64, 32, 2, 4, 48, n_kv_heads=2), key=jax.random.key(0)),
        lambda: DeepSeek(DeepSeekConfig.from_preset("tiny", n_layers=2), key=jax.random.key(1)),
    ],
    ids=["llama", "deepseek"],
)
def test_round_trip_through_the_generic_reader(tmp_path, model):
    model = model()
    el.to_hf(model, tmp_path)
    model_type = json.loads((tmp_path / "config.json").read_text())["model_type"]
    family = el.family_for_model_type(model_type)
    assert isinstance(model, family.model)
    back = el.from_hf(tmp_path)
    assert type(back) is type(model)
    _same_weights(back, model)


def test_every_family_declares_what_it_reads():
    families = el.model_families()
    declared = [t for f in families.values() for t in f.model_types]
    assert len(declared) == len(set(declared)), "two families claim one model_type"
    assert {"llama", "mistral", "qwen2", "qwen3", "deepseek_v2", "deepseek_v3"} <= set(declared)
    for family in families.values():
        for model_type in family.model_types:
            assert el.family_for_model_type(model_type) is family


def test_unknown_model_type_lists_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba9"}))
    with pytest.raises(ValueError, match=r"model_type 'mamba9'.*'deepseek_v3'.*'llama'") as e:
        el.from_hf(tmp_path)
    assert "\n" not in str(e.value)


def test_a_directory_without_a_config_or_a_model_type(tmp_path):
    with pytest.raises(ValueError, match="readable config.json"):
        el.from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 4}))
    with pytest.raises(ValueError, match="names no model_type"):
        el.from_hf(tmp_path)


def test_to_hf_of_something_no_family_builds(tmp_path):
    with pytest.raises(TypeError, match="no installed model family builds dict"):
        el.to_hf({}, tmp_path)
