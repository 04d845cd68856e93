"""Memory per GPU: model states under ZeRO, kept activations, in-flight micro-batches.

Model states in mixed precision (Megatron's accounting, 18 bytes per parameter with
Adam): half-precision weights 2, fp32 gradients 4, fp32 master weights 4, optimizer
moments 8 (SGD momentum 4). Pure bf16 training (``training.param_dtype``) keeps
weights, gradients and moments in 2 bytes each and no master (8 bytes with Adam). ZeRO-1 shards the optimizer states (master + moments)
over the ZeRO shard ranks (``dp_shard x cp``), ZeRO-2 the gradients too. ZeRO-3 is
FSDP2 as torchtitan runs it: fp32 sharded parameters (no separate master), fp32
sharded gradients and moments, plus unsharded half-precision copies of the blocks
being computed. ZeRO-2 and 3 (FSDP2) also hold the unsharded fp32 gradients of the
modules being reduce-scattered. fp32 training has no master copy.

Under a pipeline (``pp > 1``) with sharded states, every ZeRO stage is FSDP2 that keeps
each stage's weights gathered and accumulates its gradients unsharded in fp32 until
the step's last micro-batch (:attr:`~planner.parallel_dims.ParallelDims.gathered_under_pipeline`): ZeRO-1, 2 and 3 hold the
same bytes there, ZeRO-3's states plus the stage's unsharded weights and gradients.

Gradients stay held from one step to the next in frameworks that keep them in buffers
(``grads_persist``: Megatron-Core, DeepSpeed) and under DDP (views into its buckets);
PyTorch's optimizers free them at ``zero_grad``, so a step of one micro-batch peaks
either at the start of its backward, holding only the gradients of the modules being
computed, or at the optimizer step, holding them all and no activations. With several
micro-batches DDP's ``no_sync`` ones accumulate fresh gradients beside its buckets (two
copies), and FSDP2 reduce-scatters each micro-batch's into the shards, freeing the
gathered weights after each backward (ZeRO-1/2 too: the step holds the shards only).

Activations per micro-batch follow the graph's saved bytes (Korthikanti et al. 2022
for the built-in blocks); full recompute keeps only each block's input, and
re-running one block's forward before its backward holds that block's other
activations once more (its input is already kept).
:class:`MemoryModel` adds a rank's peak terms in bytes: logits, communication buffers
and workspaces, compression buffers and the caching allocator's margin.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from planner.cost.compression import reduce_dtype_bytes
from planner.cost.compute import attention_elements
from planner.cost.context_parallel import cp_mask_bytes
from planner.cost.optimizer_step import step_temporary_elements
from planner.cost.options import CostOptions
from planner.dtypes import ELEMENT_BYTES, FP32_BYTES
from planner.graph import OpGraph, OpKind, OpNode
from planner.parallel_dims import ParallelDims
from planner.spec import CompressionKind, DType, Schedule, Strategy, Training

if TYPE_CHECKING:
    from planner.cost.ranks import RankSums

__all__ = [
    "GIB",
    "PIPELINED_FSDP_NOTE",
    "MemoryModel",
    "ModelStateBytes",
    "boundary_bytes",
    "head_in_flight",
    "in_flight_microbatches",
    "pending_weight_gradients",
    "gradient_element_bytes",
    "weight_element_bytes",
    "model_state_bytes",
]

GIB = 2**30
PIPELINED_FSDP_NOTE = (
    "under pp > 1, each stage's weights stay gathered and its gradients unsharded until the "
    "last micro-batch (FSDP2 under torch.distributed.pipelining, torchtitan's "
    "reshard_after_forward=False; Megatron's distributed optimizer), so ZeRO-1, 2 and 3 hold "
    "the same memory and move the same bytes here: only fp32 parameters, reduced gradients "
    "and optimizer states are sharded"
)


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes per GPU for ``params`` parameters (already split by TP and PP); ``updated``:
    the elements the optimizer step updates on the GPU (its shard under ZeRO)."""

    weights: float
    gradients: float
    optimizer: float
    updated: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


def gradient_element_bytes(
    training: Training, options: CostOptions, compression: CompressionKind
) -> int:
    """Bytes per gradient element as a rank keeps it: the reduction's dtype where the
    framework accumulates into a buffer of it (``options.grads_in_reduce_dtype``), else
    the kept parameters' (:attr:`~planner.spec.Training.state_bytes`)."""
    if options.grads_in_reduce_dtype:
        return reduce_dtype_bytes(compression, options.grad_reduce_bytes)
    return training.state_bytes


def weight_element_bytes(training: Training, options: CostOptions) -> int:
    """Bytes per element of the weights the GEMMs read, as kept and gathered: the compute
    dtype's, 1 under fp8 training whose weights are fp8 (``options.fp8_param_gather``)."""
    if training.dtype is DType.FP8 and options.fp8_param_gather:
        return ELEMENT_BYTES["fp8"]
    return training.dtype.activation_bytes


def model_state_bytes(
    params: float, *, zero: int, shard: int, training: Training, gradient_bytes: int,
    weight_bytes: int | None = None,
) -> ModelStateBytes:  # fmt: skip
    """Weights, gradients and optimizer states for ``params`` under ZeRO stage ``zero``,
    kept in ``training``'s precision (:attr:`~planner.spec.Training.state_bytes`: pure
    bf16 keeps every state, moments included, in 2 bytes and no fp32 copy), gradients in
    ``gradient_bytes`` per element (:func:`gradient_element_bytes`), the compute weights
    in ``weight_bytes`` (:func:`weight_element_bytes`; None: the compute dtype's)."""
    kept, moments = training.state_bytes, training.moment_bytes
    if zero >= 3:
        return ModelStateBytes(
            kept * params / shard, gradient_bytes * params / shard, moments * params / shard,
            params / shard,
        )  # fmt: skip
    # the shard the optimizer updates beside the gathered compute weights: the fp32
    # master under mixed precision, else the parameters' own shard (FSDP2's sharded
    # parameters, DeepSpeed's partition)
    master = FP32_BYTES if training.master_copy else (kept if zero >= 1 and shard > 1 else 0)
    updated = params / (shard if zero >= 1 else 1)
    gradient_total = gradient_bytes * params / (shard if zero >= 2 else 1)
    weight = training.dtype.activation_bytes if weight_bytes is None else weight_bytes
    return ModelStateBytes(weight * params, gradient_total, (master + moments) * updated, updated)


def in_flight_microbatches(
    schedule: Schedule, *, pp: int, rank: int, num_microbatches: int, virtual_stages: int = 1
) -> float:
    """Micro-batches whose activations pipeline rank ``rank`` holds at its peak.

    In units of the rank's whole activation per micro-batch (all its model chunks).
    GPipe keeps every micro-batch; 1F1B keeps ``pp - rank``; interleaved 1F1B keeps
    ``2(pp - rank - 1) + (v - 1) pp + 1`` chunk-micro-batches, i.e. ``1 + (pp - 1)/(pp v)``
    times 1F1B's on the first rank (Korthikanti et al.). Zero-bubble as torch runs it
    (``ScheduleInterleavedZeroBubble``, the paper's ZB1P) keeps a micro-batch's
    activations until its deferred weight gradient, ``pp`` micro-batches on every rank
    (the paper's ZB-H1 bound, ``pp - rank``, is not what its order gives).
    """
    m = num_microbatches
    if pp == 1 or schedule is Schedule.GPIPE:
        return float(m) if schedule is Schedule.GPIPE else 1.0
    if schedule is Schedule.INTERLEAVED_1F1B:
        v = virtual_stages
        chunk_mbs = min(m * v, 2 * (pp - rank - 1) + (v - 1) * pp + 1)
        return chunk_mbs / v
    if schedule is Schedule.ZERO_BUBBLE:
        return float(min(m, pp))
    return float(min(m, pp - rank))


def pending_weight_gradients(
    schedule: Schedule, *, pp: int, rank: int, num_microbatches: int, virtual_stages: int = 1
) -> float:
    """Micro-batches whose weight gradients pipeline rank ``rank`` has deferred at its
    peak, each holding its weighted operators' output gradients until then.

    In units of the rank's whole model chunks, like :func:`in_flight_microbatches`.
    torch's zero-bubble order computes rank ``r``'s weight gradients ``r + 1``
    chunk-micro-batches after their input gradients; the other schedules compute both at
    once (none deferred).
    """
    if schedule is not Schedule.ZERO_BUBBLE or pp == 1:
        return 0.0
    return min(num_microbatches * virtual_stages, rank + 1) / virtual_stages


def head_in_flight(schedule: Schedule, num_microbatches: int, pp: int) -> float:
    """Micro-batches whose head activations (logits) the last rank holds at once: the
    head's backward follows its forward at once, so one; but GPipe and zero-bubble keep
    them with the rank's other activations (:func:`in_flight_microbatches`), zero-bubble
    until their deferred weight gradients."""
    if schedule in (Schedule.GPIPE, Schedule.ZERO_BUBBLE):
        return in_flight_microbatches(
            schedule, pp=pp, rank=pp - 1, num_microbatches=num_microbatches
        )
    return 1.0


def boundary_bytes(graph: OpGraph) -> float:
    """Bytes of the activation passed between blocks, per sequence (batch 1); for a
    model without repeated blocks, the largest segment output."""
    types = list(graph.types.values())
    blocks = [t for t in types if t.kind == "block"] or types
    return max(t.nodes[-1].bytes_written for t in blocks if t.nodes)


@dataclass(eq=False)
class MemoryModel:
    """Bytes per GPU by term at a pipeline rank's peak, for ``graph`` trained as ``training``."""

    graph: OpGraph
    training: Training
    options: CostOptions

    def states(
        self, strategy: Strategy, params: float, expert_params: float = 0.0
    ) -> ModelStateBytes:
        """Weights, gradients and optimizer bytes of ``params`` dense and ``expert_params``
        EP-held parameters under the strategy's ZeRO (ZeRO shards experts over
        :attr:`~planner.parallel_dims.ParallelDims.expert_shard_ranks`; under a pipeline,
        FSDP2's gathered weights and unsharded gradients included)."""
        return self._states(strategy, ParallelDims.of(strategy), params, expert_params)

    def _states(
        self, strategy: Strategy, dims: ParallelDims, params: float, expert_params: float
    ) -> ModelStateBytes:
        dense = self._sharded_states(strategy, dims, params, dims.zero_shard_ranks)
        if not expert_params:
            return dense
        experts = self._sharded_states(strategy, dims, expert_params, dims.expert_shard_ranks)
        return ModelStateBytes(
            dense.weights + experts.weights,
            dense.gradients + experts.gradients,
            dense.optimizer + experts.optimizer,
            dense.updated + experts.updated,
        )

    def _sharded_states(
        self, strategy: Strategy, dims: ParallelDims, params: float, shard: int
    ) -> ModelStateBytes:
        pipelined = dims.gathered_under_pipeline
        gradient = gradient_element_bytes(self.training, self.options, strategy.compression.kind)
        weight = weight_element_bytes(self.training, self.options)
        states = model_state_bytes(
            params, zero=3 if pipelined else strategy.zero, shard=shard, training=self.training,
            gradient_bytes=gradient, weight_bytes=weight,
        )  # fmt: skip
        if not pipelined:
            return states
        # accumulated unsharded in the reduction's dtype (fp32 unless the buffer is kept in it)
        accumulated = gradient if self.options.grads_in_reduce_dtype else FP32_BYTES
        return ModelStateBytes(
            states.weights + weight * params,
            states.gradients + accumulated * params,
            states.optimizer,
            states.updated,
        )

    def peak(
        self, strategy: Strategy, ranks: Sequence[RankSums], *, logits_bytes: float,
        compression: Callable[[RankSums], float | None], schedule_microbatches: int,
    ) -> dict[str, float]:  # fmt: skip
        """The terms of the rank with the largest peak. ``logits_bytes``: the head's logits
        per micro-batch (held by the last rank, for the micro-batches in flight in a
        schedule of ``schedule_microbatches``); ``compression(rank)``: the compression
        buffers' bytes, or ``None`` without compression."""
        dims = ParallelDims.of(strategy)
        worst: dict[str, float] = {}
        for index, rank in enumerate(ranks):
            logits = 0.0
            if index == len(ranks) - 1:
                held = head_in_flight(strategy.schedule, schedule_microbatches, strategy.pp)
                logits = logits_bytes * held
            parts = self._rank_memory(strategy, dims, rank, logits, compression(rank))
            if sum(parts.values()) > sum(worst.values()):
                worst = parts
        return worst

    def _rank_memory(
        self, strategy: Strategy, dims: ParallelDims, rank: RankSums, logits: float,
        compression: float | None,
    ) -> dict[str, float]:  # fmt: skip
        states = self._states(strategy, dims, rank.params, rank.expert_params)
        weights, transient, computing = states.weights, 0.0, 0.0
        if not dims.gathered_under_pipeline:
            unsharded = sum(rank.largest_params)  # the modules being gathered and computed
            computing = weight_element_bytes(self.training, self.options) * unsharded
            if strategy.zero >= 3:
                weights += computing
            if strategy.zero >= 3 or (strategy.zero == 2 and dims.shards_parameters):
                # FSDP2 reduce-scatters each module's unsharded gradient in fp32
                transient = FP32_BYTES * unsharded
        held = {
            "weights": weights,
            "gradients": states.gradients + transient,
            "optimizer": states.optimizer,
            "buffers": self._buffer_bytes(strategy, dims, states.gradients),
        }
        if compression is not None:
            held["compression"] = compression
        parts = {
            **held,
            "activations": rank.activation_bytes - logits + rank.recompute_peak_bytes,
            "logits": logits,
        }
        if self._backward_starts_without_grads(strategy, dims):
            computed = gradient_element_bytes(
                self.training, self.options, strategy.compression.kind
            )
            parts["gradients"] = transient or computed * sum(rank.largest_params)
        if self._accumulates_beside_buckets(strategy, dims):
            parts["gradients"] += states.gradients
        stepping = {  # the optimizer step's: no activations, the update's temporaries
            **held,
            "optimizer": held["optimizer"] + self._step_temporary_bytes(strategy, rank, states),
            "activations": 0.0, "logits": 0.0,
        }  # fmt: skip
        if strategy.zero < 3 and self.options.fsdp_per_microbatch(strategy):
            # FSDP2 frees each module's gathered weights after its backward, as ZeRO-3 does:
            # the backward ends (and the step starts) holding those of the last modules only
            stepping["weights"] = computing
        if sum(stepping.values()) > sum(parts.values()):
            parts = stepping
        parts["allocator_margin"] = self.options.allocator_margin * sum(parts.values())
        return parts

    def _step_temporary_bytes(
        self, strategy: Strategy, rank: RankSums, states: ModelStateBytes
    ) -> float:
        """Bytes the optimizer step allocates beside the states
        (:func:`~planner.cost.optimizer_step.step_temporary_elements`); the largest tensor
        is the graph's largest weight, split by TP and held in the share of the rank's
        parameters its optimizer updates (ZeRO's shard)."""
        held = rank.params + rank.expert_params
        share = states.updated / held if held else 0.0
        largest = self._largest_weight / strategy.tp * share
        elements = step_temporary_elements(
            self.options.optimizer_impl, self.training.optimizer, states.updated, largest
        )
        return elements * self.training.state_bytes

    @cached_property
    def _largest_weight(self) -> float:
        """Elements of the graph's largest weight tensor."""
        return max(
            (
                float(node.param_count - node.bias_count)
                for seg_type in self.graph.types.values() for node in seg_type.nodes
            ),
            default=0.0,
        )  # fmt: skip

    def _backward_starts_without_grads(self, strategy: Strategy, dims: ParallelDims) -> bool:
        """Whether the step's backward starts holding no gradients: the optimizer frees
        them (not ``grads_persist``, nor DDP's, which are views into its buckets) and the
        step is one micro-batch (no earlier backward's left to accumulate into). Its peak
        then holds only those of the modules being computed (FSDP2's unsharded ones);
        all of them at the optimizer step."""
        freed = not (self.options.grads_persist or dims.uses_ddp)
        return freed and strategy.num_microbatches == 1

    def _accumulates_beside_buckets(self, strategy: Strategy, dims: ParallelDims) -> bool:
        """Whether PyTorch DDP holds a step's gradients twice in its backward: under
        ``no_sync`` the micro-batches before the last create each ``.grad`` afresh (the
        optimizer freed them: not ``grads_persist``) beside the buckets DDP keeps, which
        they become views of in the last micro-batch only."""
        several = strategy.num_microbatches > 1 and self.options.ddp_no_sync
        return dims.uses_ddp and not self.options.grads_persist and several

    def _buffer_bytes(self, strategy: Strategy, dims: ParallelDims, gradients: float) -> float:
        """Communication buffers and library workspaces (with ``separate_grad_buckets``,
        ZeRO-0/1/2's gradient buckets, two in flight and never more than the
        ``gradients`` bytes they hold; FSDP2 under a pipeline reduces from its unsharded
        gradients)."""
        buffers = self.options.workspace_gib * GIB
        if (
            self.options.separate_grad_buckets and strategy.dp > 1 and strategy.zero < 3
            and not dims.gathered_under_pipeline
        ):  # fmt: skip
            buffers += min(2 * self.options.dp_bucket_bytes, gradients)
        if strategy.sequence_parallel:
            buffers += self._boundary_bytes * strategy.micro_batch_size / strategy.cp
        return buffers + self._cp_buffer_bytes(strategy)

    def _cp_buffer_bytes(self, strategy: Strategy) -> float:
        """Context parallelism's gathered whole-sequence K and V, and their gradients, and
        its implementation's causal masks (:func:`~planner.cost.context_parallel.cp_mask_bytes`)."""
        if strategy.cp == 1:
            return 0.0
        gathered = 2 * self._largest_kv_bytes * strategy.micro_batch_size / strategy.tp
        local_tokens = self._attention_tokens // strategy.cp
        masks = cp_mask_bytes(
            self.options.cp_attention, strategy.cp, self.options.causal, local_tokens
        )
        return gathered + masks

    @cached_property
    def _attentions(self) -> list[OpNode]:
        """The graph's attentions whose queries, keys and values were traced."""
        return [
            node for seg_type in self.graph.types.values() for node in seg_type.nodes
            if node.kind is OpKind.ATTENTION and len(node.input_shapes) >= 3
        ]  # fmt: skip

    @cached_property
    def _attention_tokens(self) -> int:
        """The longest sequence an attention reads, in tokens (0 without attention)."""
        return max((node.input_shapes[0][-2] for node in self._attentions), default=0)

    @cached_property
    def _boundary_bytes(self) -> float:
        return boundary_bytes(self.graph)

    @cached_property
    def _largest_kv_bytes(self) -> float:
        """The largest attention's K and V per sequence (bytes)."""
        largest = max((attention_elements(node)[1] for node in self._attentions), default=0.0)
        return largest * self.training.dtype.activation_bytes
