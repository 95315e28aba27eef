"""Hugging Face ``transformers`` decoders for growtrain (``pip install -e ".[hf]"`` from a checkout).

``growable(model)`` makes a loaded GPT-2, GPT-NeoX (Pythia), Llama, Mistral or Qwen2 causal LM
measurable and growable in place; ``HFCausalLM`` trains one with ``GrowUntilSaturated``;
``HFTextDataModule`` tokenizes a text corpus with the model's own tokenizer. See docs/hf.md.
Importing this package does not import ``transformers``; using its classes does.
"""

from growtrain.hf.adapter import DECODERS, DecoderSpec, HFCandidate, HFGrowable, growable, register_decoder

__all__ = [
    "DECODERS",
    "DecoderSpec",
    "HFCandidate",
    "HFGrowable",
    "growable",
    "register_decoder",
    "HFCausalLM",
    "HFTextDataModule",
]


def __getattr__(name):  # Lightning-dependent parts load on first use
    if name == "HFCausalLM":
        from growtrain.hf.lightning import HFCausalLM

        return HFCausalLM
    if name == "HFTextDataModule":
        from growtrain.hf.data import HFTextDataModule

        return HFTextDataModule
    raise AttributeError(f"module 'growtrain.hf' has no attribute {name!r}")
