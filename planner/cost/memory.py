"""Memory per GPU: model states under ZeRO, kept activations, in-flight micro-batches.

Model states in mixed precision (Megatron's accounting, 18 bytes per parameter with
Adam): half-precision weights 2, fp32 gradients 4, fp32 master weights 4, optimizer
moments 8 (SGD momentum 4). ZeRO-1 shards the optimizer states (master + moments)
over the ``dp_shard`` axis, ZeRO-2 the gradients too. ZeRO-3 is FSDP2 as torchtitan
runs it: fp32 sharded parameters (no separate master), fp32 sharded gradients and
moments, plus unsharded half-precision copies of the blocks being computed. fp32
training has no master copy.

Activations per micro-batch follow the graph's saved bytes (Korthikanti et al. 2022
for the built-in blocks); full recompute keeps only each block's input.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.spec import DType, Optimizer, Schedule

__all__ = ["ModelStateBytes", "model_state_bytes", "in_flight_microbatches"]


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes per GPU for ``params`` parameters (already split by TP and PP)."""

    weights: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


def model_state_bytes(
    params: float, *, zero: int, shard: int, optimizer: Optimizer, dtype: DType
) -> ModelStateBytes:
    """Weights, gradients and optimizer states for ``params`` under ZeRO stage ``zero``."""
    moments = optimizer.state_bytes_per_param
    if zero >= 3:
        return ModelStateBytes(4 * params / shard, 4 * params / shard, moments * params / shard)
    mixed = dtype is not DType.FP32
    weight_bytes = 2 if mixed else 4
    master = 4 if mixed else 0
    optimizer_bytes = (master + moments) * params / (shard if zero >= 1 else 1)
    gradient_bytes = 4 * params / (shard if zero >= 2 else 1)
    return ModelStateBytes(weight_bytes * params, gradient_bytes, optimizer_bytes)


def in_flight_microbatches(
    schedule: Schedule, *, pp: int, rank: int, num_microbatches: int, virtual_stages: int = 1
) -> float:
    """Micro-batches whose activations pipeline rank ``rank`` holds at its peak.

    In units of the rank's whole activation per micro-batch (all its model chunks).
    GPipe keeps every micro-batch; 1F1B and zero-bubble (ZB-H1) keep ``pp - rank``;
    interleaved 1F1B keeps ``2(pp - rank - 1) + (v - 1) pp + 1`` chunk-micro-batches,
    i.e. ``1 + (pp - 1)/(pp v)`` times 1F1B's on the first rank (Korthikanti et al.).
    """
    m = num_microbatches
    if pp == 1 or schedule is Schedule.GPIPE:
        return float(m) if schedule is Schedule.GPIPE else 1.0
    if schedule is Schedule.INTERLEAVED_1F1B:
        v = virtual_stages
        chunk_mbs = min(m * v, 2 * (pp - rank - 1) + (v - 1) * pp + 1)
        return chunk_mbs / v
    return float(min(m, pp - rank))
