"""What a transformer block keeps for backward, counted by autograd, against what is priced.

Autograd's saved tensors of one block (distinct storages, weights and their casts left
out) are counted with ``torch.autograd.graph.saved_tensors_hooks`` on the CPU, in the
three ways this runtime trains: fp32; bf16 parameters under autocast (FSDP2's
``MixedPrecisionPolicy``); fp32 parameters under autocast (no sharding: DDP, one GPU,
TP or PP alone). The zoo's Llama and GPT blocks are priced by the formula graph; a
Hugging Face Llama and nanoGPT (``tests/user_models.py``: a fused ``c_attn`` split into
q, k and v) by their trace, as models users bring are. Figures are bytes per token and
hidden unit (a Megatron GPT block without recompute: 34).

    python benchmarks/bench_saved_activations.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from planner.cost.build import spec_graph
from planner.graph import OpGraph
from planner.models import build, handle_for_module
from planner.presets import get_preset
from planner.spec import DType, ModelSpec, Training
from planner.tracing import trace

BATCH, SEQ = 3, 40  # no weight has a dimension of 3 or 3 * 40
SMALL = {"num_layers": 2, "hidden_size": 128, "num_heads": 4, "num_kv_heads": 2,
         "ffn_hidden_size": 512, "vocab_size": 128, "seq_len": SEQ, "tied_embeddings": False}  # fmt: skip
MODES = {  # parameter dtype, autocast dtype
    "fp32": (torch.float32, None),
    "bf16 weights, autocast": (torch.bfloat16, torch.bfloat16),
    "fp32 weights, autocast": (torch.float32, torch.bfloat16),
}


def small_spec(preset: str) -> ModelSpec:
    """``preset``'s architecture at 2 layers, hidden 128, sequence 40."""
    return get_preset(preset).model_copy(update=SMALL)


def saved_by_block(model: nn.Module, mode: str, block: str = "layers.1") -> tuple[int, torch.dtype]:
    """Bytes of the activations ``block`` of ``model`` keeps for backward in a forward of
    ``BATCH`` x ``SEQ`` tokens trained as ``mode`` (a key of :data:`MODES`), and the
    dtype of the block's input (what full recompute keeps and a pipeline sends)."""
    param_dtype, autocast = MODES[mode]
    model = model.to(param_dtype)
    saved: dict[int, int] = {}
    inputs: list[torch.dtype] = []
    inside = [False]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if inside[0] and tensor.dim() > 0 and tensor.shape[0] in (BATCH, BATCH * SEQ):
            storage = tensor.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    def enter(_: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        inside[0] = True
        inputs.append(args[0].dtype)

    module = model.get_submodule(block)
    hooks = (
        module.register_forward_pre_hook(enter),
        module.register_forward_hook(lambda *_: inside.__setitem__(0, False)),
    )
    tokens = torch.randint(0, 128, (BATCH, SEQ))
    with (
        torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
    ):
        model(tokens)
    for hook in hooks:
        hook.remove()
    return sum(saved.values()), inputs[0]


def priced_block_bytes(graph: OpGraph) -> float:
    """Saved bytes of ``graph``'s (batch-1) transformer block for ``BATCH`` sequences."""
    block = next(seg_type for seg_type in graph.types.values() if seg_type.kind == "block")
    return BATCH * sum(node.saved_bytes for node in block.nodes)


def training_dtype(mode: str) -> DType:
    return DType.FP32 if MODES[mode][1] is None else DType.BF16


def zoo_priced(spec: ModelSpec, mode: str) -> float:
    """The formula graph's saved bytes of one of ``spec``'s blocks."""
    training = Training(global_batch_size=BATCH, seq_len=SEQ, dtype=training_dtype(mode))
    return priced_block_bytes(spec_graph(spec, training))


def hf_llama() -> nn.Module:
    """A Hugging Face Llama of :data:`SMALL`'s shape, with SDPA attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=SMALL["hidden_size"], intermediate_size=SMALL["ffn_hidden_size"],
        num_hidden_layers=SMALL["num_layers"], num_attention_heads=SMALL["num_heads"],
        num_key_value_heads=SMALL["num_kv_heads"], vocab_size=SMALL["vocab_size"],
        max_position_embeddings=SEQ, attn_implementation="sdpa",
    )  # fmt: skip
    return LlamaForCausalLM(config)


def nanogpt() -> nn.Module:
    """The repository's nanoGPT-style user model at :data:`SMALL`'s width."""
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    from tests.user_models import GPT

    return GPT(vocab=SMALL["vocab_size"], n_embd=SMALL["hidden_size"],
               n_head=SMALL["num_heads"], n_layer=SMALL["num_layers"], block_size=SEQ)  # fmt: skip


def traced_priced(model: nn.Module, mode: str) -> float:
    """The trace's saved bytes of one of ``model``'s blocks."""
    dtype = "fp32" if training_dtype(mode) is DType.FP32 else "bf16"
    return priced_block_bytes(
        trace(handle_for_module(model), batch_size=1, seq_len=SEQ, dtype=dtype)
    )


TRACED: dict[str, tuple[Callable[[], nn.Module], str]] = {  # model, its second block
    "Hugging Face Llama": (hf_llama, "model.layers.1"),
    "nanoGPT": (nanogpt, "transformer.h.1"),
}


def rows() -> list[tuple[str, str, int, float]]:
    """(model, mode, measured bytes, priced bytes) of one block, every model and mode."""
    table = []
    for preset in ("llama3.2-1b", "gpt3-1.3b"):
        spec = small_spec(preset)
        for mode in MODES:
            measured, _ = saved_by_block(build(spec, device="cpu", seed=0), mode)
            table.append((f"zoo {preset}", mode, measured, zoo_priced(spec, mode)))
    for label, (make, block) in TRACED.items():
        for mode in MODES:
            model = make()
            measured, _ = saved_by_block(model, mode, block)
            table.append((label, mode, measured, traced_priced(model, mode)))
    return table


def main() -> None:
    per_unit = BATCH * SEQ * SMALL["hidden_size"]
    print(f"{'model':<22}{'mode':<24}{'autograd':>10}{'priced':>10}{'error':>9}")
    for model, mode, measured, priced in rows():
        error = priced / measured - 1
        print(f"{model:<22}{mode:<24}{measured / per_unit:>10.1f}{priced / per_unit:>10.1f}"
              f"{error:>+9.1%}")  # fmt: skip
    print("bytes per token and hidden unit kept by one block, measured by autograd and priced")


if __name__ == "__main__":
    main()
