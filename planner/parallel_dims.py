"""Every fact about a strategy's mesh that more than one layer needs, each stated once.

As torchtitan's ``ParallelDims``: which ranks shard model states, which reduce
gradients, what must divide the sequence and the batch, and which gradient
compression the mesh can run. The search's candidate filter, the cost model,
validation, the exporters and the runtime ask :class:`ParallelDims`; none restates a
rule. Torch-free.

The mesh order itself is :data:`planner.spec.MESH_ORDER` (tensor parallelism innermost).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.spec import MESH_ORDER, Axis, CompressionKind, Schedule

if TYPE_CHECKING:
    from planner.spec import Strategy

__all__ = ["ParallelDims"]


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of one mesh: ``dp = dp_replicate * dp_shard``; ``zero`` the ZeRO
    stage (0: DDP replicas); ``sp`` sequence parallelism over the ``tp`` ranks; ``ep``
    expert parallelism and ``etp`` expert tensor parallelism (see :attr:`expert_block`)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero: int = 0
    dp_shard: int = 1
    sp: bool = False
    ep: int = 1
    etp: int = 1

    @classmethod
    def of(cls, strategy: Strategy) -> ParallelDims:
        return cls(
            dp=strategy.dp, tp=strategy.tp, pp=strategy.pp, cp=strategy.cp,
            zero=strategy.zero, dp_shard=strategy.shard_degree, sp=strategy.sequence_parallel,
            ep=strategy.ep, etp=strategy.etp,
        )  # fmt: skip

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def replicas(self) -> int:
        """Ranks holding the same parameters, whose gradients are averaged: ``dp x cp``
        (context-parallel ranks hold the same weights and see other tokens)."""
        return self.dp * self.cp

    @property
    def zero_shard_ranks(self) -> int:
        """Ranks that ZeRO (FSDP2) shards model states over: ``dp_shard x cp`` under
        ZeRO >= 1, else 1."""
        return self.dp_shard * self.cp if self.zero >= 1 else 1

    @property
    def gathered_under_pipeline(self) -> bool:
        """Whether FSDP2 runs under a pipeline schedule: torch's pipelining then turns off
        FSDP2's resharding after backward and its gradient sync until the schedule's last
        micro-batch, so every ZeRO stage keeps the stage's weights gathered and its
        gradients unsharded for the schedule (the step, unless its gradient-accumulation
        steps run schedules of their own): ZeRO-3 is ZeRO-2 there."""
        return self.pp > 1 and self.shards_parameters

    @property
    def sharded_per_microbatch(self) -> bool:
        """Whether ZeRO shards the states with no pipeline schedule keeping the stage
        gathered: each micro-batch's gathers and reductions are the framework's to time
        (:class:`~planner.cost.options.ZeroAccumulation`)."""
        return self.shards_parameters and not self.gathered_under_pipeline

    @property
    def uses_ddp(self) -> bool:
        """Whether DDP averages the gradients: replicas without FSDP2."""
        return self.replicas > 1 and not self.shards_parameters

    @property
    def hybrid_sharding(self) -> bool:
        """ZeRO shards within groups of ``dp_shard`` and replicates across them (HSDP)."""
        return self.zero >= 1 and 1 < self.dp_shard < self.dp

    @property
    def shards_parameters(self) -> bool:
        """Whether FSDP2 runs (ZeRO >= 1 over more than one rank)."""
        return self.zero_shard_ranks > 1

    # ----- expert parallelism ------------------------------------------------------------
    # With ep > 1 each MoE layer routes its own tokens on every tp rank (split there, or
    # by sequence parallelism already), sends each routed token to the rank holding its
    # expert with an all-to-all over the EP group, and returns the results the same way.
    # Megatron-Core's expert layout (its expert rank generator): within a stage's
    # expert block, ``etp`` consecutive ranks split each expert's width (expert tensor
    # parallelism; they gather the tokens they receive and reduce-scatter the partial
    # outputs), EP groups are ``ep`` ranks ``etp`` apart, and the rest replicate. Which
    # frameworks run which layout is planner.frameworks' to say. With ep = 1 experts
    # are ordinary parameters.

    @property
    def expert_block(self) -> int:
        """Consecutive ranks of a pipeline stage that EP groups are carved from: the
        ranks sharding dense states (``dp_shard x cp x tp``) under ZeRO >= 1, else every
        rank of the stage (``dp x cp x tp``)."""
        return (self.dp_shard if self.zero >= 1 else self.dp) * self.cp * self.tp

    @property
    def expert_group(self) -> int:
        """Consecutive ranks holding one copy of every expert: ``ep x etp``."""
        return self.ep * self.etp

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same experts, whose expert gradients are averaged
        (Megatron's expert data parallel size): ``dp x cp x tp / (ep x etp)``; for
        ep = 1 experts are ordinary parameters (:attr:`replicas`)."""
        return self.dp * self.cp * self.tp // self.expert_group if self.ep > 1 else self.replicas

    @property
    def expert_shard_ranks(self) -> int:
        """Ranks that ZeRO shards one rank's experts over: ``expert_block / (ep x etp)``
        under ZeRO >= 1 (the rest of :attr:`expert_replicas` replicate, as HSDP), else 1.
        They sit :attr:`expert_group` ranks apart."""
        if self.ep == 1:
            return self.zero_shard_ranks
        return self.expert_block // self.expert_group if self.zero >= 1 else 1

    def expert_blocker(self, num_experts: int) -> str | None:
        """Why ``ep`` (and ``etp``) cannot split ``num_experts`` experts on this mesh, or
        ``None``."""
        if self.ep == 1:
            return None if self.etp == 1 else f"etp({self.etp}) > 1 needs ep > 1"
        if not num_experts:
            return f"ep({self.ep}) > 1 on a model without experts: use ep = 1"
        if num_experts % self.ep:
            return (
                f"ep({self.ep}) does not divide num_experts ({num_experts}): each EP rank "
                "holds num_experts / ep whole experts; choose ep dividing num_experts"
            )
        if self.expert_block % self.expert_group:
            what = "dp_shard" if self.zero >= 1 else "dp"
            split = f"ep({self.ep})" if self.etp == 1 else f"ep({self.ep}) * etp({self.etp})"
            return (
                f"{split} does not divide {what} * cp * tp = {self.expert_block}: EP groups "
                f"are consecutive ranks of the {'ZeRO shard group' if self.zero >= 1 else 'stage'};"
                " choose degrees dividing it"
            )
        return None

    def sequence_blocker(self, seq_len: int) -> str | None:
        """Why ``seq_len`` tokens cannot be split on this mesh, or ``None``.

        Context parallelism cuts every sequence into ``2 cp`` equal chunks (the
        load-balanced layout of causal attention that Megatron-LM, torchtitan and this
        runtime use: rank ``i`` holds chunks ``i`` and ``2 cp - 1 - i``); sequence parallelism then
        splits each rank's ``seq / cp`` tokens over the ``tp`` ranks.
        """
        if self.cp > 1 and seq_len % (2 * self.cp):
            return (
                f"seq_len {seq_len} is not divisible by 2 * cp({self.cp}) = {2 * self.cp}: "
                "context parallelism splits each sequence into 2 cp equal chunks; choose "
                f"seq_len divisible by {2 * self.cp}"
            )
        local = seq_len // self.cp
        if self.sp and local % self.tp:
            return (
                f"seq_len {seq_len} / cp({self.cp}) = {local} tokens per rank is not divisible "
                f"by tp({self.tp}): sequence parallelism splits them over the tensor-parallel "
                "ranks; choose seq_len divisible by cp * tp or turn sequence parallelism off"
            )
        return None

    def batch_blocker(
        self, global_batch: int, micro_batch: int, num_microbatches: int
    ) -> str | None:
        """Why the batch arithmetic does not hold (``dp * micro * count == global``)."""
        per_step = self.dp * micro_batch * num_microbatches
        if per_step == global_batch:
            return None
        return (
            f"training.global_batch_size = {global_batch} != dp({self.dp}) * "
            f"micro_batch_size({micro_batch}) * num_microbatches({num_microbatches}) = "
            f"{per_step}: make them agree"
        )

    def ddp_blocker(self, *, tied: bool) -> str | None:
        """Why plain data parallelism (ZeRO-0, DDP) cannot replicate over ``dp x cp``,
        or ``None`` when it can. DDP's reducer cannot run the several backwards a
        pipeline schedule runs per step (torch 2.13), and DDP over tensor-parallel shards
        loses tied weights (``tied``: the model shares parameters); ZeRO >= 1 (FSDP2)
        replicates the same gradients in both cases."""
        if self.replicas == 1:
            return None
        if self.pp > 1:
            return f"pp({self.pp}) > 1: DDP cannot run under a pipeline schedule"
        if self.tp > 1 and tied:
            return (
                f"tp({self.tp}) > 1 with tied weights: DDP cannot run over tensor-parallel "
                "shards (it loses the tie)"
            )
        return None

    def compression_blocker(self, kind: CompressionKind, *, tied: bool = False) -> str | None:
        """Why gradient compression ``kind`` cannot run on this mesh, or ``None``.

        fp16/bf16 run as FSDP2's reduce dtype (ZeRO >= 1) or as a DDP hook over
        ``dp x cp``; int8 replaces FSDP2's reduce-scatter; PowerSGD and local SGD are DDP
        hooks over ``dp`` alone (no context parallelism). DDP hooks need ZeRO 0 and a mesh
        DDP runs on (:meth:`ddp_blocker`).
        """
        if kind is CompressionKind.NONE:
            return None
        if self.replicas == 1:
            return (
                f"compression.kind = {kind.value!r} needs dp({self.dp}) * cp({self.cp}) > 1: there "
                "is no gradient reduction to compress"
            )
        if kind is CompressionKind.INT8:
            if self.zero_shard_ranks > 1:
                return None
            return (
                f"compression.kind = 'int8' with zero = {self.zero} and no sharded data-parallel "
                "axis: int8 replaces FSDP2's gradient reduce-scatter; use zero >= 1, or "
                "compression 'fp16'/'bf16' with DDP"
            )
        if kind.half and self.zero >= 1:
            return None
        return self._ddp_hook_blocker(kind, tied=tied)

    def _ddp_hook_blocker(self, kind: CompressionKind, *, tied: bool) -> str | None:
        if self.zero >= 1:
            return (
                f"compression.kind = {kind.value!r} with zero = {self.zero}: it is a DDP "
                "communication hook; use zero = 0, or compression 'fp16'/'bf16' with FSDP"
            )
        if self.cp > 1 and kind is CompressionKind.LOCAL_SGD:
            return (
                f"compression.kind = 'local_sgd' with cp({self.cp}) > 1: context-parallel ranks "
                "must stay identical, but local SGD lets groups drift; use cp = 1"
            )
        if self.cp > 1 and kind is CompressionKind.POWERSGD:
            return (
                f"compression.kind = 'powersgd' with cp({self.cp}) > 1: this runtime does not "
                "run PowerSGD over context-parallel replicas; use cp = 1, or compression "
                "'fp16'/'bf16'"
            )
        blocker = self.ddp_blocker(tied=tied)
        return None if blocker is None else f"compression.kind = {kind.value!r}: {blocker}"

    def schedule_blocker(
        self, schedule: Schedule, num_microbatches: int, *, selective: bool = False
    ) -> str | None:
        """Why ``schedule`` cannot run ``num_microbatches`` per step on ``pp`` ranks (with
        ``selective`` recompute on some stage): 1F1B needs a micro-batch per stage,
        interleaved 1F1B whole rounds of ``pp``; zero-bubble runs two backward passes over
        each micro-batch, which torch's selective activation checkpoint does not allow
        (torchtitan's own zero-bubble tests run full recompute)."""
        if self.pp == 1:
            return None
        if schedule is Schedule.ZERO_BUBBLE and selective:
            return (
                "strategy.schedule = 'zero-bubble' with recompute 'selective': zero-bubble "
                "runs two backward passes over each micro-batch (input, then weight "
                "gradients) and selective activation checkpointing allows one; use "
                "recompute 'full' or 'none', or another schedule"
            )
        if schedule is Schedule.ONE_F_ONE_B and num_microbatches < self.pp:
            return (
                f"strategy.num_microbatches = {num_microbatches} < pp({self.pp}): the 1f1b "
                "schedule needs at least one micro-batch per stage; raise num_microbatches "
                "or use gpipe"
            )
        if schedule is Schedule.INTERLEAVED_1F1B and num_microbatches % self.pp:
            return (
                f"strategy.num_microbatches = {num_microbatches} is not a multiple of "
                f"pp({self.pp}): interleaved 1f1b runs micro-batches in rounds of pp; raise "
                "num_microbatches to a multiple of pp or use 1f1b"
            )
        return None

    def local_sgd_blocker(self, local_group: int | None) -> str | None:
        """Why ``local_group`` cannot be local SGD's group: more than one group of
        consecutive dp ranks, all of one size."""
        if local_group is not None and local_group < self.dp and self.dp % local_group == 0:
            return None
        example = max((d for d in range(1, self.dp) if self.dp % d == 0), default=1)
        return (
            f"compression.local_group = {local_group} with dp({self.dp}): local SGD "
            "needs a local_group smaller than dp that divides it (dp ranks split into groups "
            f"of consecutive ranks that reduce every step); e.g. local_group = {example}"
        )

    def stride(self, innermost: Axis) -> int:
        """GPUs between neighbouring ranks of a group of mesh axes whose innermost axis is
        ``innermost``: the product of the degrees inside it (:data:`MESH_ORDER`)."""
        sizes = {
            Axis.PP: self.pp,
            Axis.DP_REPLICATE: self.dp // self.dp_shard,
            Axis.DP_SHARD: self.dp_shard,
            Axis.CP: self.cp,
            Axis.TP: self.tp,
        }
        inside = MESH_ORDER[MESH_ORDER.index(innermost) + 1 :]
        return math.prod(sizes[axis] for axis in inside)
