"""The zoo Llama under Hugging Face's names: ``LlamaForCausalLM`` tensor names and config.

The zoo's Llama (:class:`planner.models.transformer.Transformer`, family ``llama``) is
Hugging Face's ``LlamaForCausalLM`` renamed: the same projections, unfused and
unbiased, rotate-half rotary embeddings at the same frequencies, RMSNorm scaled after the
cast, SiLU-gated MLP. So a checkpoint moves between the two by renaming alone, with no
permutation or fusing. With ``qk_norm`` (per-head query and key RMSNorms before rotary)
it is ``Qwen3ForCausalLM``, Llama's layout plus ``self_attn.q_norm``/``k_norm``. The zoo's GPT and encoder families differ from their Hugging Face
counterparts in the maths (GPT-2's fused ``c_attn`` in ``Conv1D`` layout, tanh GELU), so
they have no Hugging Face layout here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from torch import nn

from planner.errors import SpecError
from planner.models.transformer import Transformer
from planner.spec import Family, ModelSpec

__all__ = ["check_hf_layout", "hf_name", "zoo_name", "hf_names_for", "hf_llama_config"]

# (zoo pattern, Hugging Face pattern); {i} is the block index.
_RENAMES = (
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("layers.{i}.attention.wq.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("layers.{i}.attention.wk.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("layers.{i}.attention.wv.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("layers.{i}.attention.wo.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("layers.{i}.attention.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    ("layers.{i}.attention.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
    ("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
)


def _compiled(source: str) -> re.Pattern[str]:
    return re.compile(re.escape(source).replace(r"\{i\}", r"(?P<i>\d+)") + "$")


_TO_HF = tuple((_compiled(zoo), hf) for zoo, hf in _RENAMES)
_FROM_HF = tuple((_compiled(hf), zoo) for zoo, hf in _RENAMES)


def _rename(name: str, table: tuple[tuple[re.Pattern[str], str], ...], what: str) -> str:
    for pattern, target in table:
        match = pattern.match(name)
        if match is not None:
            return target.format(**match.groupdict())
    raise SpecError(f"{what} {name!r} has no counterpart in Hugging Face's LlamaForCausalLM")


def check_hf_layout(spec: ModelSpec) -> None:
    """Raise unless the zoo model of ``spec`` has Hugging Face's Llama layout."""
    if spec.family is not Family.LLAMA:
        raise SpecError(
            f"model {spec.name!r} is a zoo {spec.family.value} model, whose maths differ from "
            "its Hugging Face counterpart; only zoo llama models load from or export to Hugging "
            "Face safetensors (use parallel.save/load checkpoints for the others)"
        )
    for field, value, what in (
        ("num_experts", spec.num_experts, "experts"),
        ("kv_lora_rank", spec.kv_lora_rank, "multi-head latent attention"),
    ):
        if value:
            raise SpecError(
                f"model {spec.name!r} has {what} ({field}={value}), which LlamaForCausalLM "
                "has not; save it with parallel.save/load checkpoints instead"
            )


def hf_name(fqn: str) -> str:
    """The Hugging Face name of the zoo Llama's tensor ``fqn``."""
    return _rename(fqn, _TO_HF, "zoo tensor")


def zoo_name(name: str) -> str:
    """The zoo Llama's FQN of Hugging Face's tensor ``name``."""
    return _rename(name, _FROM_HF, "Hugging Face tensor")


def hf_names_for(model: nn.Module) -> Callable[[str], str]:
    """How ``model``'s FQNs are named in Hugging Face safetensors: renamed for the zoo
    Llama, unchanged for Hugging Face models and user modules (whose own names they are);
    raises for the zoo's other families."""
    if not isinstance(model, Transformer):
        return lambda fqn: fqn
    check_hf_layout(model.spec)
    return hf_name


def hf_llama_config(spec: ModelSpec, *, dtype: str = "float32") -> dict[str, Any]:
    """``config.json`` of the ``LlamaForCausalLM`` (``Qwen3ForCausalLM`` with
    ``qk_norm``) equal to the zoo model of ``spec``."""
    check_hf_layout(spec)
    architecture, model_type = ("Qwen3", "qwen3") if spec.qk_norm else ("Llama", "llama")
    return {
        "architectures": [f"{architecture}ForCausalLM"],
        "model_type": model_type,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.ffn_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_size,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.seq_len,
        "rms_norm_eps": spec.norm_eps,
        "rope_theta": spec.rope_theta,  # transformers < 5; 5 reads rope_parameters
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": spec.tied_embeddings,
        "torch_dtype": dtype,  # transformers < 5; 5 reads dtype
        "dtype": dtype,
    }
