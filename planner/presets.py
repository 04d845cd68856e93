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

# Mixture-of-experts models, from their published Hugging Face config.json, trained at
# 4096 tokens (Megatron-Core's MoE benchmarks). Qwen3-MoE's heads are 128 wide (32 x 128
# query features on a 2048 hidden state, 64 x 128 on 4096), each query and key head
# RMS-normalised before rotary.
_MIXTRAL = {
    "vocab_size": 32000,
    "seq_len": 4096,
    "rope_theta": 1e6,
    "num_kv_heads": 8,
    "num_experts": 8,
    "top_k": 2,
}
_QWEN3_MOE = {
    "vocab_size": 151936,
    "seq_len": 4096,
    "rope_theta": 1e6,
    "norm_eps": 1e-6,
    "num_kv_heads": 4,
    "head_dim": 128,
    "qk_norm": True,
    "num_experts": 128,
    "top_k": 8,
}
# DeepSeek-V3 without its multi-token-prediction module (one extra block and head used
# only as a training objective): 671B of its published 685B parameters.
_DEEPSEEK_V3 = {
    "vocab_size": 129280,
    "seq_len": 4096,
    "norm_eps": 1e-6,
    "ffn_hidden_size": 18432,
    "num_experts": 256,
    "top_k": 8,
    "moe_ffn_hidden_size": 2048,
    "num_shared_experts": 1,
    "dense_layers": 3,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}
_TINY_MOE = {
    "num_kv_heads": 2,
    "vocab_size": 256,
    "seq_len": 64,
    "num_experts": 8,
    "top_k": 2,
    "moe_ffn_hidden_size": 32,
    "num_shared_experts": 1,
    "dense_layers": 1,
}

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
        _spec("mixtral-8x7b", Family.LLAMA, 32, 4096, 32, ffn_hidden_size=14336, **_MIXTRAL),
        _spec("mixtral-8x22b", Family.LLAMA, 56, 6144, 48, ffn_hidden_size=16384,
              **{**_MIXTRAL, "vocab_size": 32768}),
        _spec("qwen3-30b-a3b", Family.LLAMA, 48, 2048, 32, ffn_hidden_size=6144,
              moe_ffn_hidden_size=768, **_QWEN3_MOE),
        _spec("qwen3-235b-a22b", Family.LLAMA, 94, 4096, 64, ffn_hidden_size=12288,
              moe_ffn_hidden_size=1536, **_QWEN3_MOE),
        _spec("deepseek-v3", Family.LLAMA, 61, 7168, 128, **_DEEPSEEK_V3),
        _spec("olmoe-1b-7b", Family.LLAMA, 16, 2048, 16, ffn_hidden_size=1024, vocab_size=50304,
              seq_len=4096, num_experts=64, top_k=8),
        _spec("tiny-moe", Family.LLAMA, 4, 64, 4, **_TINY_MOE),
    )
}  # fmt: skip
ALIASES = {
    "llama3.1-8b": "llama3-8b", "llama3.1-70b": "llama3-70b", "llama3-405b": "llama3.1-405b",
    "mixtral-8x7b-v0.1": "mixtral-8x7b", "mixtral-8x22b-v0.1": "mixtral-8x22b",
    "deepseek-v3-671b": "deepseek-v3", "olmoe-1b-7b-0924": "olmoe-1b-7b",
}  # fmt: skip


def get_preset(name: str) -> ModelSpec:
    name = ALIASES.get(name, name)
    if name not in PRESETS:
        raise UnknownNameError("model preset", name, [*PRESETS, *ALIASES])
    return PRESETS[name]
