"""FLOP conventions for MFU and HFU, named so numbers from different sources compare.

The cost model counts the graph's matmul and attention FLOPs: 2 per multiply-add, backward = 2x forward, causal attention
whole and embedding lookups free, which is torchtitan's ``6 (N - N_embedding) + 12 l h s``
per token and, for GPT, Megatron's ``72 B s l h^2 (1 + s/6h + V/12lh)`` per step.
Model FLOPs (MFU) exclude recomputation; hardware FLOPs (HFU) add the recomputed
forward FLOPs (Narayanan et al.'s ``96 B s l h^2 (1 + s/6h + V/16lh)`` with full
recompute).
"""

from __future__ import annotations

from planner.hardware import load_profile
from planner.spec import DType, Prediction

__all__ = [
    "FLOP_CONVENTION",
    "bf16_peak_mfu",
    "megatron_model_flops",
    "megatron_hardware_flops",
    "titan_model_flops",
]

FLOP_CONVENTION = (
    "model FLOPs = 6*(N - N_embedding) + 12*l*h*s per token (Megatron 72Bslh^2(1+s/6h+V/12lh) "
    "for GPT; N counts a mixture of experts' active parameters: routed experts top_k times; "
    "causal attention counted whole; recompute excluded); HFU adds recomputed "
    "forward FLOPs; peak = the training dtype's dense peak (fp8 runs: the fp8 peak)"
)


def megatron_model_flops(
    batch: int, seq: int, layers: int, hidden: int, vocab: int, ffn: int | None = None
) -> float:
    """Megatron model FLOPs per step: ``72 B s l h^2 (1 + s/6h + V/12lh)`` when ffn = 4h."""
    ffn = ffn or 4 * hidden
    linear = 6 * batch * seq * layers * (4 * hidden**2 + 2 * hidden * ffn)
    attention = 12 * batch * seq**2 * layers * hidden
    logits = 6 * batch * seq * vocab * hidden
    return float(linear + attention + logits)


def megatron_hardware_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Narayanan et al. hardware FLOPs with full recompute: ``96 B s l h^2 (1 + s/6h + V/16lh)``."""
    return (
        96
        * batch
        * seq
        * layers
        * hidden**2
        * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    )


def titan_model_flops(
    tokens: float, params_non_embedding: float, layers: int, hidden: int, seq: int
) -> float:
    """torchtitan model FLOPs for ``tokens``: ``6 (N - N_emb) + 12 l h s`` per token."""
    return tokens * (6 * params_non_embedding + 12 * layers * hidden * seq)


def bf16_peak_mfu(prediction: Prediction, *, dtype: DType, gpu: str) -> float | None:
    """MFU of an fp8 run against the dense bf16 peak of ``gpu`` (a profile name or path):
    the figure torchtitan reports, next to the prediction's own MFU (against the fp8
    peak). ``None`` for other dtypes or a profile without a bf16 peak."""
    if dtype is not DType.FP8:
        return None
    profile = load_profile(gpu)
    if DType.BF16 not in profile.peak_tflops:
        return None
    return prediction.model_tflops_per_gpu * 1e12 / profile.peak_flops(DType.BF16)
