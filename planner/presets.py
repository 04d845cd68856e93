"""The built-in model presets as :class:`~planner.spec.ModelSpec` (torch-free).

:mod:`planner.models` builds them as ``nn.Module``; the cost model reads them as specs.
"""

from __future__ import annotations

from planner.errors import UnknownNameError
from planner.spec import Family, ModelSpec

__all__ = ["ALIASES", "PRESETS", "get_preset"]


def _spec(
    name: str, family: Family, layers: int, hidden: int, heads: int, **kw: object
) -> ModelSpec:
    return ModelSpec.model_validate(
        {"name": name, "family": family, "num_layers": layers, "hidden_size": hidden,
         "num_heads": heads, **kw}
    )  # fmt: skip


# Vocabularies padded to a multiple of 128, as Megatron-LM does, so tensor parallelism
# splits the embedding and the output head evenly (GPT-2's 50257, BERT's 30522).
_GPT2 = {"vocab_size": 50304, "seq_len": 1024, "tied_embeddings": True}
_GPT3 = {"vocab_size": 51200, "seq_len": 2048}  # Megatron pads 50257 to 51200
_LLAMA2 = {"vocab_size": 32000, "seq_len": 4096}
_LLAMA3 = {"vocab_size": 128256, "seq_len": 8192, "rope_theta": 500000.0}
_BERT = {"vocab_size": 30592, "seq_len": 512, "tied_embeddings": True, "norm_eps": 1e-12}

PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        _spec("gpt2", Family.GPT, 12, 768, 12, **_GPT2),
        _spec("gpt2-medium", Family.GPT, 24, 1024, 16, **_GPT2),
        _spec("gpt2-large", Family.GPT, 36, 1280, 20, **_GPT2),
        _spec("gpt2-xl", Family.GPT, 48, 1600, 25, **_GPT2),
        _spec("gpt3-1.3b", Family.GPT, 24, 2048, 16, **_GPT3),
        _spec("gpt3-2.7b", Family.GPT, 32, 2560, 32, **_GPT3),
        _spec("gpt3-6.7b", Family.GPT, 32, 4096, 32, **_GPT3),
        _spec("gpt3-13b", Family.GPT, 40, 5120, 40, **_GPT3),
        _spec("gpt3-175b", Family.GPT, 96, 12288, 96, **_GPT3),
        _spec("llama2-7b", Family.LLAMA, 32, 4096, 32, ffn_hidden_size=11008, **_LLAMA2),
        _spec("llama2-13b", Family.LLAMA, 40, 5120, 40, ffn_hidden_size=13824, **_LLAMA2),
        _spec("llama2-70b", Family.LLAMA, 80, 8192, 64, num_kv_heads=8, ffn_hidden_size=28672,
              **_LLAMA2),
        _spec("llama3.2-1b", Family.LLAMA, 16, 2048, 32, num_kv_heads=8, ffn_hidden_size=8192,
              **_LLAMA3, tied_embeddings=True),
        _spec("llama3-8b", Family.LLAMA, 32, 4096, 32, num_kv_heads=8, ffn_hidden_size=14336,
              **_LLAMA3),
        _spec("llama3-70b", Family.LLAMA, 80, 8192, 64, num_kv_heads=8, ffn_hidden_size=28672,
              **_LLAMA3),
        _spec("llama3.1-405b", Family.LLAMA, 126, 16384, 128, num_kv_heads=8,
              ffn_hidden_size=53248, **_LLAMA3),
        _spec("bert-base", Family.ENCODER, 12, 768, 12, **_BERT),
        _spec("bert-large", Family.ENCODER, 24, 1024, 16, **_BERT),
        _spec("tiny-gpt", Family.GPT, 4, 64, 4, vocab_size=256, seq_len=32),
        _spec("tiny-llama", Family.LLAMA, 4, 64, 4, num_kv_heads=2, ffn_hidden_size=160,
              vocab_size=256, seq_len=32),
    )
}  # fmt: skip
ALIASES = {"llama3.1-8b": "llama3-8b", "llama3.1-70b": "llama3-70b", "llama3-405b": "llama3.1-405b"}


def get_preset(name: str) -> ModelSpec:
    name = ALIASES.get(name, name)
    if name not in PRESETS:
        raise UnknownNameError("model preset", name, [*PRESETS, *ALIASES])
    return PRESETS[name]
