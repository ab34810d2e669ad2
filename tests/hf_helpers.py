"""Helpers of the Hugging Face parity tests. They need torch, transformers and safetensors
(extra: hf), imported by `hf_modules` when a test uses them, so that the cases of a module
that need none of them still run without the extra."""

import json
import shutil

import equinox as eqx
import numpy as np
import pytest

HF_REASON = "the Hugging Face parity tests need torch, transformers and safetensors (extra: hf)"


def hf_modules():
    """`(torch, transformers)`; skips the calling test (or fixture) without the hf extra."""
    torch = pytest.importorskip("torch", reason=HF_REASON)
    transformers = pytest.importorskip("transformers", reason=HF_REASON)
    pytest.importorskip("safetensors", reason=HF_REASON)
    return torch, transformers


def randomize_biases_and_norms(model):
    """Give a fresh transformers model random biases, norm scales and routing biases
    (DeepSeek-V3's `e_score_correction_bias`); they start at 0 and 1, which would hide one
    loaded into the wrong place."""
    torch, _ = hf_modules()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    return model


def model_builder(families, small, **config_attrs):
    """`build_hf(family, seed=0, **changes)` of a parity test module: a random float32
    transformers causal LM of `families[family]` (`(config class name, extra config fields,
    ...)`) over the `small` config fields and `changes`, with `config_attrs` set on the config (e.g.
    `_attn_implementation="eager"`), and `randomize_biases_and_norms`."""

    def build_hf(family: str, seed: int = 0, **changes):
        torch, transformers = hf_modules()
        cls_name, extra = families[family][:2]
        config = getattr(transformers, cls_name)(**{**small, **extra, **changes})
        for name, value in config_attrs.items():
            setattr(config, name, value)
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        return randomize_biases_and_norms(model.eval())

    return build_hf


def hf_logits(model, tokens) -> np.ndarray:
    torch, _ = hf_modules()
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def hf_generate(model, prompt, new: int) -> tuple[np.ndarray, np.ndarray]:
    """transformers' greedy `(tokens [new], logits [new, vocab])` of `model` after one
    unpadded `prompt`."""
    torch, _ = hf_modules()
    with torch.no_grad():
        out = model.generate(
            torch.as_tensor(prompt[None], dtype=torch.long), do_sample=False,
            max_new_tokens=new, return_dict_in_generate=True, output_logits=True,
        )  # fmt: skip
    return out.sequences[0, len(prompt) :].numpy(), torch.stack(out.logits, 1)[0].numpy()


@eqx.filter_jit
def forward(model, tokens, positions=None, segment_ids=None):
    return model(tokens, positions, segment_ids)


def max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def save_checkpoints(tmp_path_factory, families, build_hf, tokens) -> dict:
    """`{family: (directory, reference logits)}`: each family's model saved once."""
    out = {}
    for family in families:
        model = build_hf(family)
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path)
        out[family] = (path, hf_logits(model, tokens))
    return out


def checkpoint_fixtures(families, build_hf, shape: tuple[int, int], vocab: int):
    """The module-scoped fixtures of a parity test module, to assign to their names there:
    `tokens, checkpoints = checkpoint_fixtures(FAMILIES, build_hf, (BATCH, SEQ), VOCAB)`.

    `tokens` are random `[batch, seq]` int32 ids below `vocab`; `checkpoints` is
    `{family: (directory, reference logits)}`, each of `families` built by `build_hf` and
    saved once.
    """

    @pytest.fixture(scope="module")
    def tokens():
        return np.random.default_rng(0).integers(0, vocab, shape).astype(np.int32)

    @pytest.fixture(scope="module")
    def checkpoints(tmp_path_factory, tokens):
        hf_modules()
        return save_checkpoints(tmp_path_factory, families, build_hf, tokens)

    return tokens, checkpoints


def copy_of(checkpoints, family: str, tmp_path):
    """A writable copy of `family`'s checkpoint (`tmp_path / family`), for a test to edit."""
    path = tmp_path / family
    shutil.copytree(checkpoints[family][0], path)
    return path


def edit_config(path, **changes):
    """Set (or, for `None`, remove) keys of `path/config.json`; `null=[keys]` writes nulls."""
    config = json.loads((path / "config.json").read_text())
    for key in changes.pop("null", ()):
        config[key] = None
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def load_tensors(file) -> dict:
    """The tensors of a safetensors `file`, as NumPy arrays."""
    hf_modules()
    from safetensors.numpy import load_file

    return load_file(file)


def edit_tensors(path, edit):
    """Apply `edit` to the dict of tensors of `path/model.safetensors`, and write it back."""
    from safetensors.numpy import save_file

    tensors = load_tensors(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
