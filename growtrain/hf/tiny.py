"""Tiny randomly initialised Hugging Face decoders, built from a config (nothing downloads).

For tests, examples and the CPU demo run: ``tiny_model("llama")`` has hidden size 32, 2
layers, vocabulary 64 by default. ``python -m growtrain.hf.tiny --arch llama --vocab 256
--out runs/tiny-llama`` writes one with ``save_pretrained`` so that a config can point
``model.pretrained`` at a local model directory, as it would at a downloaded checkpoint.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

__all__ = ["ARCHS", "tiny_config", "tiny_model"]

ARCHS = ("gpt2", "gpt_neox", "gpt_neox_sequential", "llama", "mistral", "qwen2")


def tiny_config(arch: str = "llama", *, vocab: int = 64, hidden: int = 32, layers: int = 2, heads: int = 4,
                context: int = 64, **overrides: Any):  # fmt: skip
    """A ``transformers`` config of ``arch`` (one of ``ARCHS``) at toy size."""
    import transformers as tf

    if arch not in ARCHS:
        raise ValueError(f"arch: expected one of {ARCHS}, got {arch!r}")
    # Special tokens inside the small vocabulary (the defaults, e.g. GPT-2's 50256, are not).
    special = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": None}
    if arch == "gpt2":
        kw = dict(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=context)
        cls = tf.GPT2Config
    elif arch.startswith("gpt_neox"):
        kw = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=2 * hidden,
                  max_position_embeddings=context, use_parallel_residual=arch == "gpt_neox")  # fmt: skip
        cls = tf.GPTNeoXConfig
    else:
        kw = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
                  intermediate_size=2 * hidden, max_position_embeddings=context)  # fmt: skip
        cls = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config}[arch]
        if arch == "mistral":
            kw["sliding_window"] = None
    return cls(vocab_size=vocab, **special, **{**kw, **overrides})


def tiny_model(arch: str = "llama", seed: int = 0, **kwargs: Any):
    """A freshly initialised ``AutoModelForCausalLM`` of ``tiny_config(arch, **kwargs)``, in eval mode."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_config(arch, **kwargs))
    return model.eval()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a tiny random Hugging Face decoder with save_pretrained.")
    parser.add_argument("--arch", default="llama", choices=ARCHS)
    parser.add_argument("--vocab", type=int, default=256, help="vocabulary size (256 = byte tokens)")
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="directory to write (config.json + model.safetensors)")
    a = parser.parse_args(argv)
    model = tiny_model(a.arch, a.seed, vocab=a.vocab, hidden=a.hidden, layers=a.layers, heads=a.heads, context=a.context)
    model.save_pretrained(a.out)
    print(f"wrote {type(model).__name__} ({sum(p.numel() for p in model.parameters())} parameters) to {a.out}")


if __name__ == "__main__":  # pragma: no cover
    main()
