"""The zoo Llama under Hugging Face's names: ``LlamaForCausalLM`` tensor names and config.

The zoo's Llama (:class:`planner.models.transformer.Transformer`, family ``llama``) is
Hugging Face's ``LlamaForCausalLM`` renamed: the same projections, unfused and
unbiased, rotate-half rotary embeddings at the same frequencies, RMSNorm scaled after the
cast, SiLU-gated MLP. So a checkpoint moves between the two by renaming alone, with no
permutation or fusing. With ``qk_norm`` (per-head query and key RMSNorms before rotary)
it is ``Qwen3ForCausalLM``, Llama's layout plus ``self_attn.q_norm``/``k_norm``. With
experts (``num_experts``) a MoE block is ``MixtralForCausalLM``'s under Mixtral's names
(``block_sparse_moe.gate`` the router, ``block_sparse_moe.experts.{e}.w1/w3/w2`` each
expert's gate, up and down projections), its shared experts, which Mixtral has not,
under DeepSeek-V3's ``shared_experts.gate_proj/up_proj/down_proj``; dense blocks keep
Llama's ``mlp``.

Grouped experts (transformers' and the zoo's ``gate_up_proj [E, 2F, H]``, gate rows
first, and ``down_proj [E, H, F]``) lie on disk one tensor per expert:
:func:`per_expert_layouts` says under which names. The zoo's GPT and encoder families
differ from their Hugging Face counterparts in the maths (GPT-2's fused ``c_attn`` in ``Conv1D`` layout, tanh GELU), so
they have no Hugging Face layout here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from planner.errors import SpecError
from planner.io import read_json
from planner.models.transformer import Transformer
from planner.spec import Family, ModelSpec

__all__ = [
    "check_hf_layout",
    "check_hf_config",
    "hf_name",
    "zoo_name",
    "hf_names_for",
    "hf_llama_config",
    "ExpertTensors",
    "grouped_experts",
    "per_expert_layouts",
    "hf_aliases",
]

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
    ("layers.{i}.feed_forward.router.weight", "model.layers.{i}.block_sparse_moe.gate.weight"),
    (
        "layers.{i}.feed_forward.experts.gate_up_proj",
        "model.layers.{i}.block_sparse_moe.experts.gate_up_proj",
    ),
    (
        "layers.{i}.feed_forward.experts.down_proj",
        "model.layers.{i}.block_sparse_moe.experts.down_proj",
    ),
    (
        "layers.{i}.feed_forward.shared_experts.w1.weight",
        "model.layers.{i}.block_sparse_moe.shared_experts.gate_proj.weight",
    ),
    (
        "layers.{i}.feed_forward.shared_experts.w3.weight",
        "model.layers.{i}.block_sparse_moe.shared_experts.up_proj.weight",
    ),
    (
        "layers.{i}.feed_forward.shared_experts.w2.weight",
        "model.layers.{i}.block_sparse_moe.shared_experts.down_proj.weight",
    ),
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
    if spec.kv_lora_rank:
        raise SpecError(
            f"model {spec.name!r} has multi-head latent attention (kv_lora_rank="
            f"{spec.kv_lora_rank}), which LlamaForCausalLM has not; save it with "
            "parallel.save/load checkpoints instead"
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


def check_hf_config(model: nn.Module, directory: Path) -> None:
    """Raise when the ``config.json`` beside Hugging Face safetensors (if there is one)
    describes maths the zoo model of ``model`` does not compute (Llama 3.1's scaled
    rotary frequencies, another norm epsilon, a sliding window): its weights would load
    by name and shape into a model that computes otherwise."""
    file = directory / "config.json"
    if not isinstance(model, Transformer) or not file.is_file():
        return
    theirs = _maths(read_json(file, what="config", finite=False))
    ours = _maths(_llama_config(model.spec, dtype="float32"))  # any zoo Llama, experts too
    for setting, value in theirs.items():
        if value != ours[setting]:
            raise SpecError(
                f"weights {str(directory)!r}: its config.json has {setting} = {value!r}, "
                f"where the zoo model {model.spec.name!r} has {ours[setting]!r}, so the "
                "weights would train a model that computes otherwise; train Hugging Face's "
                f"model of that config (plan --hf-config {str(directory)!r}, "
                "planner.hf.resolve_hf_config) or a zoo model whose settings match"
            )


def _maths(config: Mapping[str, Any]) -> dict[str, Any]:
    """What a Llama-style ``config.json`` says beyond the tensors' shapes, read as
    transformers reads it (rotary settings under ``rope_parameters`` from version 5,
    ``rope_theta`` and ``rope_scaling`` before)."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    windowed = config.get("use_sliding_window", True)
    return {
        "rope_type": rope.get("rope_type", rope.get("type", "default")),
        "rope_theta": float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        "rms_norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "hidden_act": config.get("hidden_act", "silu"),
        "attention_bias": bool(config.get("attention_bias", False)),
        "mlp_bias": bool(config.get("mlp_bias", False)),
        "sliding_window": config.get("sliding_window") if windowed else None,
    }


def hf_llama_config(spec: ModelSpec, *, dtype: str = "float32") -> dict[str, Any]:
    """``config.json`` of the ``LlamaForCausalLM`` (``Qwen3ForCausalLM`` with
    ``qk_norm``, ``MixtralForCausalLM`` with experts) equal to the zoo model of ``spec``."""
    check_hf_layout(spec)
    architecture, model_type = ("Qwen3", "qwen3") if spec.qk_norm else ("Llama", "llama")
    if spec.moe:
        return _mixtral_config(spec, dtype)
    return _llama_config(spec, dtype) | {
        "architectures": [f"{architecture}ForCausalLM"],
        "model_type": model_type,
        "intermediate_size": spec.ffn_size,
        "mlp_bias": False,
    }


def _mixtral_config(spec: ModelSpec, dtype: str) -> dict[str, Any]:
    """``MixtralForCausalLM``'s config of a zoo MoE; raises for what Mixtral lacks."""
    for field, value, fix in (
        ("num_shared_experts", spec.num_shared_experts, "0"),
        ("dense_layers", spec.dense_layers, "0"),
        ("qk_norm", spec.qk_norm, "False"),
    ):
        if value:
            raise SpecError(
                f"model {spec.name!r} has {field}={value}, which MixtralForCausalLM has not: "
                f"its weights export (and load back here) but no config.json describes them; "
                f"set {field}={fix} for a Mixtral, or export without a config"
            )
    return _llama_config(spec, dtype) | {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "intermediate_size": spec.expert_ffn_size,
        "num_local_experts": spec.num_experts,
        "num_experts_per_tok": spec.top_k,
        "router_aux_loss_coef": 0.0,
        "output_router_logits": False,
    }


def _llama_config(spec: ModelSpec, dtype: str) -> dict[str, Any]:
    """The config fields Llama, Qwen3 and Mixtral share."""
    return {
        "hidden_size": spec.hidden_size,
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
        "tie_word_embeddings": spec.tied_embeddings,
        "torch_dtype": dtype,  # transformers < 5; 5 reads dtype
        "dtype": dtype,
    }


# ---- grouped experts, one tensor per expert on disk

_GROUPED = ("gate_up_proj", "down_proj")
# (gate, up, down) suffixes of one expert's tensors: Mixtral's first (what export writes
# under block_sparse_moe), then Qwen3-MoE's, DeepSeek-V3's and OLMoE's
_EXPERT_NAMINGS = (
    ("w1.weight", "w3.weight", "w2.weight"),
    ("gate_proj.weight", "up_proj.weight", "down_proj.weight"),
)
_MIXTRAL_BLOCK, _MLP = ".block_sparse_moe.", ".mlp."


@dataclass(frozen=True)
class ExpertTensors:
    """A grouped experts weight stored one tensor per expert: expert ``e``'s part ``p``
    is ``{prefix}.{e}.{p}``; ``parts`` lie along dim 1 of the grouped tensor in order
    (``gate_up_proj [E, 2F, H]``: gate ``[F, H]`` then up; ``down_proj [E, H, F]``:
    down ``[H, F]``)."""

    prefix: str
    parts: tuple[str, ...]

    def name(self, expert: int, part: str) -> str:
        return f"{self.prefix}.{expert}.{part}"

    def names(self, experts: int) -> list[str]:
        return [self.name(e, part) for e in range(experts) for part in self.parts]

    def describe(self) -> str:
        return f"{self.prefix}.{{e}}.{'|'.join(self.parts)}"


def grouped_experts(name: str) -> tuple[str, str] | None:
    """``(experts module, parameter)`` of a grouped experts weight name
    (``...experts.gate_up_proj`` or ``...experts.down_proj``), else ``None``."""
    module, _, parameter = name.rpartition(".")
    return (module, parameter) if parameter in _GROUPED and module else None


def per_expert_layouts(name: str) -> list[ExpertTensors]:
    """Where the grouped experts weight ``name`` (Hugging Face's name: see
    :func:`grouped_experts`) may lie one tensor per expert, the most likely first:
    Mixtral's ``w1/w3/w2`` under ``block_sparse_moe``, ``gate_proj/up_proj/down_proj``
    under ``mlp``, each under both spellings (:func:`hf_aliases`)."""
    grouped = grouped_experts(name)
    if grouped is None:
        return []
    module, parameter = grouped
    namings = _EXPERT_NAMINGS if _MIXTRAL_BLOCK in f"{module}." else _EXPERT_NAMINGS[::-1]
    return [
        ExpertTensors(prefix, (gate, up) if parameter == "gate_up_proj" else (down,))
        for prefix in hf_aliases(module)
        for gate, up, down in namings
    ]


def hf_aliases(name: str) -> tuple[str, ...]:
    """``name`` and its other spelling in Hugging Face checkpoints: Mixtral's files say
    ``block_sparse_moe`` where transformers >= 5 says ``mlp``, and back."""
    dotted = f".{name}."
    for ours, theirs in ((_MLP, _MIXTRAL_BLOCK), (_MIXTRAL_BLOCK, _MLP)):
        if ours in dotted:
            return name, dotted.replace(ours, theirs, 1)[1:-1]
    return (name,)
