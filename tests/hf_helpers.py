"""Helpers of the Hugging Face parity tests (they need torch: import after importorskip)."""

import numpy as np
import torch


def randomize_biases_and_norms(model):
    """Give a fresh transformers model random biases and norm scales (they start at 0 and
    1, which would hide a bias or a norm weight loaded into the wrong place)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    return model


def hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


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
