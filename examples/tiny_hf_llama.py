"""Write a tiny random Llama with transformers, and a byte-level BPE tokenizer trained on the
trainer's default corpus, as a Hugging Face checkpoint directory: the starting point of the
README's fine-tuning recipe (`--init-hf DIR`). Needs the hf extra.

    python examples/tiny_hf_llama.py /tmp/tiny-llama [--context 64]
"""

import argparse

WORDS = 512  # tokenizer vocabulary: 256 bytes, 3 specials, the rest merges
SPECIALS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2


def write_tiny_llama(path, texts, *, context: int = 64, seed: int = 0):
    """Train a tokenizer on `texts` and write it with a random Llama of `context`
    positions to `path`; **returns** the transformers model."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=WORDS,
            special_tokens=SPECIALS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    config = transformers.LlamaConfig(
        vocab_size=WORDS, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    tok.save(f"{path}/tokenizer.json")
    return model


def main() -> None:
    from eqx_longctx.data import load_corpus

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path", help="the checkpoint directory to write")
    p.add_argument("--context", type=int, default=64, help="max_position_embeddings")
    p.add_argument("--max-bytes", type=int, default=2**20, help="tokenizer training text")
    args = p.parse_args()
    write_tiny_llama(args.path, load_corpus(max_bytes=args.max_bytes), context=args.context)
    print(f"wrote a tiny Llama ({args.context} positions) and its tokenizer to {args.path}")


if __name__ == "__main__":
    main()
