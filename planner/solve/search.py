"""The strategy search: enumerate, prune by memory, bound by compute, cost the rest.

Every candidate is a point of the space

    dp x tp x pp x cp = num_gpus   (every factorisation; tp and cp may cross nodes)
    ep dividing the experts and the ranks EP is carved from (MoE models only), and
    expert tensor parallelism etp in {1, tp} where the target runs it
    zero in 0..3, dp_shard in {dp, ranks per node, a pinned divisor of dp} (hybrid
    sharding), sequence parallel,
    recompute in {none, selective, full}, micro-batch size, pipeline schedule and
    virtual stages, and the lossy gradient compression the user allows
    (:mod:`planner.solve.lossy`: on the meshes the runtime can run it on)

restricted by the model (heads divisible by tp, blocks for every pipeline chunk) and
by the mesh rules of :class:`~planner.parallel_dims.ParallelDims`, which validation
asks too: experts split over the EP group (:meth:`~ParallelDims.expert_blocker`;
beside sequence parallelism only where the target runs it,
:func:`~planner.frameworks.experts_beside_sequence_parallel_refusal`, and split over
tensor-parallel ranks likewise, :func:`~planner.frameworks.expert_tensor_parallel_refusal`),
the sequence splits on the mesh (:meth:`~ParallelDims.sequence_blocker`:
``2 cp`` equal chunks, and ``seq / cp`` divisible by tp under sequence parallelism),
plain data parallelism only where DDP runs (:func:`~planner.frameworks.ddp_blocker`), and
compression, pinned or allowed, only where it runs
(:meth:`~ParallelDims.compression_blocker`). Heuristic restrictions on top: at least
256 tokens per context-parallel rank unless cp is pinned; micro-batches of at most 16;
interleaving only with micro-batches a multiple of pp, and with more than 4 virtual
stages only when they divide the blocks evenly (or are pinned); ZeRO only with more than one replica,
over all of dp or one node's share of it. ZeRO-1 is searched only when pinned: ZeRO-2
sends the same bytes and keeps fewer, so it dominates; under a pipeline ZeRO-3 only when
pinned too, since torch's pipelining keeps the weights gathered all step and ZeRO-3 is
then ZeRO-2. Candidates are small frozen
dataclasses compared field by field until they are costed. Two bounds, both computed
from per-(tp, cp, sp, micro-batch, recompute) segment costs that
:class:`~planner.cost.CostModel` caches:

- memory: model states plus kept activations of the evenest split, a lower bound of
  the cost model's peak; a candidate over the GPU's memory is dropped uncosted;
- time: ``work / pp * (num_microbatches + fill)``, the busiest rank's compute and the
  schedule's least fill and drain when the stages are perfectly balanced, a lower
  bound of the step time.

Candidates are costed in order of the time bound; a group whose pipelined compute
(:meth:`~planner.cost.CostModel.pipeline_floor_s`, a tighter bound priced once for all
its ZeRO variants) already exceeds the ``top_k``-th best step time is skipped, and the
search stops when the first bound does, so the answer is the cost model's
optimum over the space (branch and bound), deterministic (ties break on the group's
fields, in the order :class:`_Group` declares them).
"""

from __future__ import annotations

import bisect
import functools
import heapq
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import NamedTuple

from pydantic import ValidationError

from planner.cost import CostModel
from planner.cost.memory import (
    gradient_element_bytes,
    in_flight_microbatches,
    model_state_bytes,
    weight_element_bytes,
)
from planner.cost.model import WholeModelCost
from planner.cost.options import ZeroAccumulation
from planner.cost.pipeline import schedule_rounds
from planner.errors import InfeasibleError, SpecError
from planner.frameworks import (
    PLANNER,
    Refusal,
    Target,
    blockless_chunk_refusal,
    compressed_experts_refusal,
    ddp_blocker,
    expert_tensor_parallel_refusal,
    experts_beside_sequence_parallel_refusal,
    strategy_refusal,
)
from planner.parallel_dims import ParallelDims
from planner.solve.lossy import (
    CompressionKey,
    LossyCompression,
    compression_blocker,
    decode,
    encode,
    option_name,
)
from planner.spec import (
    Cluster,
    Compression,
    CompressionKind,
    Prediction,
    RecomputeMode,
    Schedule,
    SolverStats,
    Strategy,
    Training,
    virtual_stages_problem,
)

__all__ = ["Headroom", "ModelLimits", "Pins", "Scored", "SearchResult", "in_search_space", "search"]

log = logging.getLogger(__name__)
_GIB = 2**30
_RECOMPUTE_ORDER = (RecomputeMode.NONE, RecomputeMode.SELECTIVE, RecomputeMode.FULL)
_MAX_MICRO_BATCH = 16
_MAX_UNEVEN_VIRTUAL = 4  # virtual stages that need not divide the blocks evenly
_MIN_CP_TOKENS = 256  # shorter sequence shards per context-parallel rank are not searched
_Experts = tuple[int, int]  # (ep, etp)


@dataclass(frozen=True)
class Pins:
    """Strategy fields the user fixed; ``None`` leaves a field to the search."""

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    ep: int | None = None
    etp: int | None = None
    zero: int | None = None
    dp_shard: int | None = None
    sequence_parallel: bool | None = None
    recompute: RecomputeMode | None = None
    micro_batch_size: int | None = None
    schedule: Schedule | None = None
    virtual_stages: int | None = None
    compression: Compression | None = None  # a pinned option is allowed even if lossy

    def allows(self, name: str, value: object) -> bool:
        pinned = getattr(self, name)
        return pinned is None or pinned == value

    @classmethod
    def of(cls, strategy: Strategy) -> Pins:
        """Pins that fix every searched field to ``strategy``'s value."""
        return cls(
            dp=strategy.dp, tp=strategy.tp, pp=strategy.pp, cp=strategy.cp, ep=strategy.ep,
            etp=strategy.etp, zero=strategy.zero, dp_shard=strategy.shard_degree if strategy.zero else None,
            sequence_parallel=strategy.sequence_parallel, recompute=strategy.recompute,
            micro_batch_size=strategy.micro_batch_size, schedule=strategy.schedule,
            virtual_stages=strategy.virtual_stages, compression=strategy.compression,
        )  # fmt: skip

    def describe(self) -> str:
        values = ((f.name, getattr(self, f.name)) for f in fields(self))
        shown = (
            (name, value.describe() if isinstance(value, Compression) else value)
            for name, value in values
        )
        return ", ".join(f"{name}={value}" for name, value in shown if value is not None) or "none"


@dataclass(frozen=True)
class Headroom:
    """Memory a plan must leave free on each GPU: ``gib`` plus ``fraction`` of the GPU's
    memory (fragmentation, communication buffers, what the cost model does not see)."""

    gib: float = 0.0
    fraction: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.gib) and self.gib >= 0):
            raise SpecError(f"memory headroom = {self.gib} GiB: give a non-negative size")
        if not 0 <= self.fraction < 1:
            raise SpecError(
                f"memory headroom = {self.fraction:.0%}: give a share of memory below 100%"
            )

    @classmethod
    def parse(cls, text: str) -> Headroom:
        """``8`` or ``8GiB`` (GiB per GPU) or ``10%`` (of each GPU's memory)."""
        value = text.strip()
        try:
            if value.endswith("%"):
                return cls(fraction=float(value[:-1]) / 100)
            return cls(gib=float(value.removesuffix("GiB").removesuffix("GB")))
        except ValueError:
            raise SpecError(
                f"--memory-headroom = {text!r}: write GiB per GPU (8, 8GiB) or a share of "
                "memory (10%)"
            ) from None

    def gib_of(self, capacity_gib: float) -> float:
        """The headroom in GiB on a GPU of ``capacity_gib``."""
        return self.gib + self.fraction * capacity_gib


@dataclass(frozen=True)
class ModelLimits:
    """What the model allows: ``heads`` (None: any tp), blocks, sequence length.

    ``max_tp`` caps the tensor-parallel degree (None: any); ``layout_problem(tp, sp)``
    says why no tensor-parallel layout of that degree runs the model (``None``: one does).
    """

    num_blocks: int
    seq_len: int
    num_heads: int | None = None
    num_kv_heads: int | None = None
    vocab_size: int | None = None  # split by Megatron's layout: tp must divide it
    pipeline_problem: str | None = None  # why the runtime cannot split it into stages
    context_parallel_problem: str | None = None  # why the runtime cannot shard its sequences
    selective_problem: str | None = None  # why selective recompute would train it wrong
    ddp_over_tp: bool = True  # whether DDP (and its hooks) can run over TP shards: no tied weights
    max_tp: int | None = None
    layout_problem: Callable[[int, bool], str | None] | None = None
    traced: bool = False  # priced on its trace, with the layouts the sharding ILP finds
    num_experts: int = 0  # routed experts per MoE layer (0: a dense model)
    expert_problem: str | None = None  # why the runtime cannot split its experts over ranks

    def allows_tp(self, tp: int) -> bool:
        return self.tp_blocker(tp) is None

    def tp_blocker(self, tp: int) -> str | None:
        """Why the model's shapes (or its layout's reach) rule out tensor parallelism ``tp``."""
        if self.max_tp is not None and tp > self.max_tp:
            return (
                f"tp({tp}) > {self.max_tp}, the GPUs of one node here: tensor parallelism of "
                "this model stays within a node (its layout is solved per degree up to that)"
            )
        heads = [h for h in (self.num_heads, self.num_kv_heads) if h is not None]
        if any(h % tp for h in heads):
            divisors = [d for d in (1, 2, 4, 8, 16) if all(h % d == 0 for h in heads)]
            counted = f"{self.num_heads} heads: num_attention_heads"
            if self.num_kv_heads not in (None, self.num_heads):
                counted = (
                    f"{self.num_heads} query and {self.num_kv_heads} key/value heads: "
                    "num_attention_heads and num_key_value_heads"
                )
            return f"tp({tp}) does not divide the attention heads ({counted}); use tp in {divisors}"
        if self.vocab_size is not None and self.vocab_size % tp:
            return (
                f"tp({tp}) does not divide the vocabulary ({self.vocab_size}): pad it to "
                "a multiple of 128, as Megatron-LM does"
            )
        return None

    def sequence_blocker(self, tp: int, cp: int, sp: bool) -> str | None:
        """Why the mesh cannot split this model's sequences
        (:meth:`ParallelDims.sequence_blocker`), or ``None``. A ``seq_len`` of 1 is a
        traced model's placeholder (no sequence length known: validation checks the
        plan's once it names one), so only context parallelism is refused there."""
        dims = ParallelDims(tp=tp, cp=cp, sp=sp and self.seq_len > 1)
        return dims.sequence_blocker(self.seq_len)

    def layout_blocker(self, tp: int, sp: bool) -> str | None:
        """Why tensor parallelism ``tp`` (with ``sp``) cannot run the model, if it cannot."""
        if tp == 1 or self.layout_problem is None:
            return None
        return self.layout_problem(tp, sp)


@dataclass(frozen=True)
class Scored:
    strategy: Strategy
    prediction: Prediction


@dataclass(frozen=True)
class SearchResult:
    """Fitting strategies, fastest first, and what the search did.

    ``costed`` holds every candidate the search priced (fitting or not), in the order it
    priced them; with ``pareto=True`` it contains the whole Pareto front of step time
    against peak memory.
    """

    ranked: tuple[Scored, ...]
    stats: SolverStats
    costed: tuple[Scored, ...] = ()

    @property
    def best(self) -> Scored:
        return self.ranked[0]


@dataclass(frozen=True, order=True)
class _Sharding:
    """How a group's candidate shards model states and compresses gradients, with the
    model-state bytes it keeps per parameter (the same for every group of a mesh)."""

    zero: int
    shard: int  # dp_shard: 1 under ZeRO-0
    state_bytes_per_param: float
    expert_state_bytes_per_param: float  # the experts' under EP (sharded apart)
    compression: CompressionKey


@dataclass(frozen=True, order=True)
class _Group:
    """Candidates alike but for ZeRO and compression: one time bound, the shardings that
    fit. Groups sort field by field in declaration order, the bound first; the search
    sorts thousands, so it compares :data:`_GROUP_ORDER` keys (the same order)."""

    bound_s: float
    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    sp: bool
    mbs: int
    recompute_rank: int
    schedule: str
    virtual: int
    shardings: tuple[_Sharding, ...]
    floors: tuple[float, ...] = field(compare=False)  # each sharding's memory floor, bytes

    def points(self) -> Iterator[tuple[_Point, float]]:
        """Each ZeRO and compression variant's point and its memory floor (bytes)."""
        for sharding, floor in zip(self.shardings, self.floors, strict=True):
            yield self.point(sharding), floor

    def point(self, sharding: _Sharding) -> _Point:
        return _Point(
            bound_s=self.bound_s, dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep,
            etp=self.etp, zero=sharding.zero, shard=sharding.shard, sp=self.sp, mbs=self.mbs,
            recompute_rank=self.recompute_rank, schedule=self.schedule, virtual=self.virtual,
            compression=sharding.compression,
        )  # fmt: skip


_GROUP_ORDER = attrgetter(*(f.name for f in fields(_Group) if f.compare))


@dataclass(frozen=True, order=True)
class _Point:
    """A candidate before costing: plain fields, so it orders deterministically."""

    bound_s: float
    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    zero: int
    shard: int
    sp: bool
    mbs: int
    recompute_rank: int
    schedule: str
    virtual: int
    compression: CompressionKey

    def strategy(self, global_batch: int) -> Strategy:
        return Strategy(
            dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, etp=self.etp,
            zero=self.zero,  # type: ignore[arg-type]
            dp_shard=self.shard if self.zero else None, sequence_parallel=self.sp,
            recompute=_RECOMPUTE_ORDER[self.recompute_rank], micro_batch_size=self.mbs,
            num_microbatches=global_batch // (self.dp * self.mbs),
            schedule=Schedule(self.schedule), virtual_stages=self.virtual,
            compression=decode(self.compression),
        )  # fmt: skip


def _divisors(n: int) -> list[int]:
    """Every divisor of ``n``, ascending, in ``sqrt(n)`` steps."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


class _Space:
    """Enumerates candidate points for one model, cluster and training set-up."""

    def __init__(
        self,
        model: CostModel,
        limits: ModelLimits,
        pins: Pins,
        lossy: LossyCompression,
        headroom_gib: float = 0.0,
        target: Target = PLANNER,
    ) -> None:
        self.model = model
        self.target = target  # what runs expert parallelism beside sequence parallelism
        self.limits = limits
        self.pins = pins
        self.lossy = lossy
        self.cluster = model.cluster
        self.training = model.training
        self.headroom_gib = headroom_gib
        if headroom_gib >= model.profile.memory_capacity_gib:
            raise SpecError(
                f"memory headroom = {headroom_gib:.3g} GiB per GPU leaves nothing of a "
                f"{model.cluster.gpu}'s {model.profile.memory_capacity_gib:.3g} GiB: keep "
                "less free (--memory-headroom)"
            )
        self.capacity = (model.profile.memory_capacity_gib - headroom_gib) * _GIB
        self.over_memory = 0  # candidates dropped by the memory bound
        self.enumerated = 0  # candidates that passed it
        self.leanest: _Point | None = None  # the dropped candidate with the smallest bound
        self._leanest_bytes = math.inf
        self.compression_blocked: str | None = None  # why a pinned compression was dropped
        # pipeline chunks at most: a block each, and where the target runs it, the
        # embedding and the head alone
        self.max_chunks = (
            model.most_chunks if blockless_chunk_refusal(target) is None else limits.num_blocks
        )
        self._work: dict[tuple[int, int, bool, int, int, int, int], WholeModelCost] = {}

    def fits(self, prediction: Prediction) -> bool:
        """Whether ``prediction`` fits with the reserved headroom to spare."""
        return prediction.fits and prediction.peak_memory_gib <= (
            prediction.memory_limit_gib - self.headroom_gib
        )

    def headroom_note(self) -> str:
        if not self.headroom_gib:
            return ""
        return f"memory headroom: {self.headroom_gib:.3g} GiB per GPU kept free"

    def work(
        self, tp: int, cp: int, sp: bool, mbs: int, recompute_rank: int, experts: _Experts
    ) -> WholeModelCost:
        key = (tp, cp, sp, mbs, recompute_rank, *experts)
        if key not in self._work:
            ep, etp = experts
            probe = Strategy(
                tp=tp, cp=cp, ep=ep, etp=etp, sequence_parallel=sp, micro_batch_size=mbs,
                recompute=_RECOMPUTE_ORDER[recompute_rank],
            )  # fmt: skip
            self._work[key] = self.model.whole_model(probe)
        return self._work[key]

    def meshes(self) -> Iterator[tuple[int, int, int, int]]:
        n, pins, limits = self.cluster.num_gpus, self.pins, self.limits
        for tp in _divisors(n):
            if not (pins.allows("tp", tp) and limits.allows_tp(tp)):
                continue
            for cp in _divisors(n // tp):
                if not pins.allows("cp", cp) or (cp > 1 and limits.context_parallel_problem):
                    continue
                if limits.sequence_blocker(tp, cp, sp=False) is not None:
                    continue
                if cp > 1 and limits.seq_len // cp < _MIN_CP_TOKENS and pins.cp is None:
                    continue
                for pp in _divisors(n // (tp * cp)):
                    dp = n // (tp * cp * pp)
                    if not (pins.allows("pp", pp) and pins.allows("dp", dp)):
                        continue
                    if pp > self.max_chunks or self.training.global_batch_size % dp:
                        continue
                    if pp > 1 and limits.pipeline_problem:
                        continue
                    yield dp, tp, pp, cp

    def shardings(self, dp: int, tp: int, pp: int, cp: int) -> Iterator[tuple[int, int]]:
        """(zero, dp_shard) pairs: plain DP, ZeRO 1-3 over all of dp, hybrid over a node.

        ZeRO shards over dp x cp (context-parallel ranks hold the same weights), so it
        applies with dp = 1 when cp > 1. Plain DP only where DDP runs
        (:func:`~planner.frameworks.ddp_blocker`).
        """
        dims = ParallelDims(dp=dp, tp=tp, pp=pp, cp=cp)
        if dims.replicas == 1:
            if self.pins.allows("zero", 0) and self.pins.allows("dp_shard", None):
                yield 0, 1
            return
        per_node = max(1, self.cluster.gpus_per_node // (tp * cp))
        ddp = ddp_blocker(self.target, dims, tied=not self.limits.ddp_over_tp) is None
        # under FSDP2 ZeRO-1 moves the bytes ZeRO-2 moves and keeps more: dominated (where
        # ZeRO-2 reduces every micro-batch and ZeRO-1 once a step, it is not)
        zero1_dominated = self.model.options.zero_accumulation is ZeroAccumulation.MICROBATCH
        for zero in (0, 1, 2, 3):
            if not self.pins.allows("zero", zero):
                continue
            if zero == 1 and self.pins.zero is None and zero1_dominated:
                continue
            if zero == 3 and pp > 1 and self.pins.zero is None:
                continue  # under a pipeline ZeRO-3 is ZeRO-2 (ParallelDims.gathered_under_pipeline)
            if zero == 0 and not ddp:
                continue
            shards = [1] if zero == 0 or dp == 1 else self._shard_degrees(dp, per_node)
            for shard in shards:
                if self.pins.allows("dp_shard", shard if zero else None):
                    yield zero, shard

    def _shard_degrees(self, dp: int, per_node: int) -> list[int]:
        """ZeRO shard group sizes to search over ``dp`` replicas: all of dp, its ranks in
        one node (``per_node``: hybrid sharding across nodes), and a pinned one that
        divides dp."""
        pinned = self.pins.dp_shard
        shards = {dp, math.gcd(dp, per_node)} | ({pinned} if pinned and dp % pinned == 0 else set())
        return sorted(shards - {1})

    def expert_degrees(self, dp: int, tp: int, cp: int) -> list[_Experts]:
        """(ep, etp) pairs to search on the mesh: (1, 1), and each divisor ``ep`` of the
        experts beside etp 1, etp = tp and a pinned etp where the target runs it
        (:func:`~planner.frameworks.expert_tensor_parallel_refusal`), ``ep x etp``
        dividing ``dp x cp x tp`` (whether a ZeRO sharding allows it is the variants')."""
        experts = 0 if self.limits.expert_problem else self.limits.num_experts
        eps = [ep for ep in _divisors(experts) if ep > 1] if experts else []
        etps = sorted({1, tp, self.pins.etp or 1})
        pairs = [(1, 1)] + [
            (ep, etp) for ep in eps for etp in etps
            if (dp * cp * tp) % (ep * etp) == 0
            and expert_tensor_parallel_refusal(self.target, ep=ep, etp=etp, tp=tp) is None
        ]  # fmt: skip
        return [
            (ep, etp) for ep, etp in pairs
            if self.pins.allows("ep", ep) and self.pins.allows("etp", etp)
        ]  # fmt: skip

    def schedules(self, pp: int, microbatches: int) -> Iterator[tuple[str, int]]:
        if pp == 1:  # no pipeline: a pinned schedule or virtual stages rule pp = 1 out
            if self.pins.allows("schedule", Schedule.ONE_F_ONE_B) and self.pins.allows(
                "virtual_stages", 1
            ):
                yield Schedule.ONE_F_ONE_B.value, 1
            return
        dims = ParallelDims(pp=pp)
        for schedule in (Schedule.ONE_F_ONE_B, Schedule.GPIPE, Schedule.ZERO_BUBBLE):
            if dims.schedule_blocker(schedule, microbatches) is not None:
                continue
            if self.pins.allows("schedule", schedule) and self.pins.allows("virtual_stages", 1):
                yield schedule.value, 1
        interleaved = Schedule.INTERLEAVED_1F1B
        if not self.pins.allows("schedule", interleaved) or dims.schedule_blocker(
            interleaved, microbatches
        ):
            return
        for virtual in range(2, self.max_chunks // pp + 1):
            chunks = pp * virtual  # beyond the blocks: one block each, ends alone
            even = self.limits.num_blocks % chunks == 0 or chunks >= self.limits.num_blocks
            pinned = self.pins.virtual_stages == virtual  # the user's, even or not
            if (even or virtual <= _MAX_UNEVEN_VIRTUAL or pinned) and self.pins.allows(
                "virtual_stages", virtual
            ):
                yield Schedule.INTERLEAVED_1F1B.value, virtual

    def micro_batches(self, dp: int) -> list[int]:
        per_rank = self.training.global_batch_size // dp
        sizes = [m for m in range(1, _MAX_MICRO_BATCH + 1) if per_rank % m == 0]
        if self.training.micro_batch_size is not None:
            sizes = [m for m in sizes if m == self.training.micro_batch_size]
        return [m for m in sizes if self.pins.allows("micro_batch_size", m)]

    def groups(self) -> Iterator[_Group]:
        """Candidates that differ only in ZeRO sharding, with the shardings that fit."""
        for dp, tp, pp, cp in self.meshes():
            sizes = self.micro_batches(dp)
            if not sizes:
                continue
            sps = [sp for sp in ((False, True) if tp > 1 else (False,)) if self._runs(tp, cp, sp)]
            if not sps:
                continue
            for ep, etp in self.expert_degrees(dp, tp, cp):
                variants = self.variants(dp, tp, pp, cp, (ep, etp))
                if not variants:
                    continue
                for mbs in sizes:
                    microbatches = self.training.global_batch_size // (dp * mbs)
                    for sp in sps:
                        if experts_beside_sequence_parallel_refusal(
                            self.target, ep=ep, sequence_parallel=sp
                        ):
                            continue
                        yield from self._groups(
                            (dp, tp, pp, cp, ep, etp), mbs, microbatches, sp, variants
                        )

    def _runs(self, tp: int, cp: int, sp: bool) -> bool:
        """Whether sequence parallelism ``sp`` is searched at tensor parallelism ``tp``:
        pinned so or free, the sequence splits (:meth:`ModelLimits.sequence_blocker`)
        and a layout runs the model."""
        if not self.pins.allows("sequence_parallel", sp):
            return False
        if sp and self.limits.sequence_blocker(tp, cp, sp) is not None:
            return False
        # another framework lays a zoo model out its own way (Megatron-LM runs experts
        # beside sequence parallelism); a traced model is priced on this runtime's layout
        other_layout = not self.target.is_planner and not self.limits.traced
        return other_layout or self.limits.layout_blocker(tp, sp) is None

    def variants(
        self, dp: int, tp: int, pp: int, cp: int, experts: _Experts
    ) -> tuple[_Sharding, ...]:
        """Every (zero, dp_shard) of the mesh that splits the experts ``ep x etp`` ways
        (:meth:`ParallelDims.expert_blocker`), with each compression that runs there."""
        variants = []
        ep, etp = experts
        for zero, shard in self.shardings(dp, tp, pp, cp):
            dims = ParallelDims(
                dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, dp_shard=shard, ep=ep, etp=etp
            )  # fmt: skip
            if dims.expert_blocker(self.limits.num_experts) is not None:
                continue
            per_param = self._state_bytes_per_param(zero, dims.zero_shard_ranks)
            per_expert = self._state_bytes_per_param(zero, dims.expert_shard_ranks)
            for key in self.compressions(dp, tp, pp, cp, zero, shard, ep):
                sharding = _Sharding(
                    zero=zero, shard=shard, state_bytes_per_param=per_param,
                    expert_state_bytes_per_param=per_expert, compression=key,
                )  # fmt: skip
                variants.append(sharding)
        return tuple(variants)

    def _groups(
        self,
        mesh: tuple[int, int, int, int, int, int],
        mbs: int,
        microbatches: int,
        sp: bool,
        variants: tuple[_Sharding, ...],
    ) -> Iterator[_Group]:
        dp, tp, pp, cp, ep, etp = mesh
        schedules = [
            (s, v, _fill_drain(s, pp, v), self._in_flight(s, pp, microbatches, v))
            for s, v in self.schedules(pp, microbatches)
        ]
        for rank, mode in enumerate(_RECOMPUTE_ORDER):
            if not self.pins.allows("recompute", mode):
                continue
            if mode is RecomputeMode.SELECTIVE and self.limits.selective_problem:
                continue
            work = self.work(tp, cp, sp, mbs, rank, (ep, etp))
            experts = work.expert_param_count / pp
            params = work.param_count / pp - experts
            kept = (self.limits.num_blocks // pp) * work.least_block_activation_bytes
            for schedule, virtual, fill, in_flight in schedules:
                if ParallelDims(pp=pp).schedule_blocker(
                    Schedule(schedule), microbatches, selective=mode is RecomputeMode.SELECTIVE
                ):
                    continue
                activations = kept * in_flight
                fitting: list[_Sharding] = []
                floors: list[float] = []
                over: list[tuple[float, _Sharding]] = []  # (bytes needed, variant)
                for variant in variants:
                    needed = (
                        params * variant.state_bytes_per_param
                        + experts * variant.expert_state_bytes_per_param
                        + activations
                    )
                    if needed <= self.capacity:
                        fitting.append(variant)
                        floors.append(needed)
                        continue
                    self.over_memory += 1
                    over.append((needed, variant))
                if not fitting and not over:
                    continue
                group = _Group(
                    bound_s=work.time_s / pp * (microbatches + fill), dp=dp, tp=tp, pp=pp,
                    cp=cp, ep=ep, etp=etp, sp=sp, mbs=mbs, recompute_rank=rank, schedule=schedule,
                    virtual=virtual, shardings=tuple(fitting), floors=tuple(floors),
                )  # fmt: skip
                self._note_leanest(group, over)
                if fitting:
                    self.enumerated += len(fitting)
                    yield group

    def _note_leanest(self, group: _Group, over: list[tuple[float, _Sharding]]) -> None:
        """Keep the leanest of ``group``'s variants the memory bound dropped, among those
        the target runs (what the no-fit message names)."""
        batch = self.training.global_batch_size
        for needed, variant in sorted(over, key=lambda item: item[0]):
            if needed >= self._leanest_bytes:
                return
            point = group.point(variant)
            if strategy_refusal(self.target, point.strategy(batch), self.training) is None:
                self.leanest, self._leanest_bytes = point, needed
                return

    def compressions(
        self, dp: int, tp: int, pp: int, cp: int, zero: int, shard: int, ep: int
    ) -> Iterator[CompressionKey]:
        """The pinned compression where it runs, or ``none`` and the allowed lossy options
        that run here."""
        pinned = self.pins.compression
        tied = not self.limits.ddp_over_tp
        if pinned is not None:
            dims = ParallelDims(dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, dp_shard=shard, ep=ep)
            refusal = compressed_experts_refusal(self.target, ep=ep, kind=pinned.kind)
            blocker = compression_blocker(pinned, dims, tied=tied) or (
                refusal.describe() if refusal is not None else None
            )
            if blocker is None:
                yield encode(pinned)
            elif self.compression_blocked is None:  # the first: ZeRO-0 (DDP hooks) comes first
                self.compression_blocked = blocker
            return
        for key in self.lossy.keys(
            self.cluster, self.training.dtype, dp=dp, tp=tp, pp=pp, cp=cp, zero=zero,
            dp_shard=shard, ddp_over_tp=not tied, ep=ep,
        ):  # fmt: skip
            kind = CompressionKind(key[0])
            if compressed_experts_refusal(self.target, ep=ep, kind=kind) is None:
                yield key

    def _state_bytes_per_param(self, zero: int, shard: int) -> float:
        """Weights, gradients and optimizer bytes per parameter under ZeRO ``zero`` (the
        gradients at their least: as a half-precision reduction would keep them)."""
        least = gradient_element_bytes(self.training, self.model.options, CompressionKind.BF16)
        return model_state_bytes(
            1.0, zero=zero, shard=shard, training=self.training, gradient_bytes=least,
            weight_bytes=weight_element_bytes(self.training, self.model.options),
        ).total  # fmt: skip

    def _in_flight(self, schedule: str, pp: int, microbatches: int, virtual: int) -> float:
        """Micro-batches the first pipeline rank keeps (the memory bound's multiplier), in
        the step's largest pipeline schedule."""
        per_round = self.model.options.pipeline_round_microbatches
        largest = max(schedule_rounds(pp, microbatches, per_round))
        return in_flight_microbatches(
            Schedule(schedule), pp=pp, rank=0, num_microbatches=largest, virtual_stages=virtual,
        )  # fmt: skip


def _fill_drain(schedule: str, pp: int, virtual: int) -> float:
    """Least pipeline fill and drain, in micro-batches of the average rank's time.

    With rank times ``t`` (average ``a``, slowest ``M``) GPipe and 1F1B take
    ``m M + sum(t) - M >= (m + pp - 1) a``; interleaving divides the fill by ``v``;
    zero-bubble's depends on the forward share, bounded below by 0.
    """
    if schedule == Schedule.ZERO_BUBBLE.value:
        return 0.0
    return (pp - 1) / virtual


def in_search_space(
    model: CostModel, limits: ModelLimits, strategy: Strategy, target: Target | None = None
) -> bool:
    """Whether the search (for ``target``, default this runtime) enumerates ``strategy``
    (memory aside) for ``model``'s set-up: its fields pinned, and the micro-batch count
    the one the search derives from the global batch (:meth:`ParallelDims.batch_blocker`)."""
    batch = ParallelDims.of(strategy).batch_blocker(
        model.training.global_batch_size, strategy.micro_batch_size, strategy.num_microbatches
    )
    if batch is not None:
        return False
    lossy = LossyCompression.allowing(strategy.compression)
    space = _Space(model, limits, Pins.of(strategy), lossy, target=target or PLANNER)
    return any(True for _ in space.groups()) or space.over_memory > 0


Progress = Callable[[int, int], None]  # (candidates done, candidates), for a progress bar


def search(
    model: CostModel,
    limits: ModelLimits,
    *,
    pins: Pins | None = None,
    top_k: int = 5,
    pareto: bool = False,
    lossy: LossyCompression | None = None,
    progress: Progress | None = None,
    target: Target | None = None,
    memory_headroom_gib: float = 0.0,
) -> SearchResult:
    """The ``top_k`` fastest fitting strategies for ``model``'s set-up, fastest first.

    With ``pareto`` the search also prices every candidate that could be on the Pareto
    front of step time against peak memory: it skips a candidate only when a priced,
    fitting one is both faster than its time bound and leaner than its memory bound.
    ``lossy`` lists the lossy gradient compression the search may choose (none by default).
    ``target`` keeps to what that framework release runs
    (:func:`planner.frameworks.strategy_refusal`); ``memory_headroom_gib`` (GiB per GPU)
    is left free: a candidate fits only with that much memory to spare.

    Raises :class:`InfeasibleError` when nothing fits, naming the memory the closest
    candidate needs and what would make it fit.
    """
    started = time.perf_counter()
    pins = pins or Pins()
    lossy = lossy or LossyCompression()
    _check_pinned_compression(pins, lossy)
    space = _Space(model, limits, pins, lossy, memory_headroom_gib, target or PLANNER)
    groups = sorted(space.groups(), key=_GROUP_ORDER)
    if not groups and not space.over_memory:
        raise _no_candidates(model, limits, pins, space)
    restriction = _Restriction(target, model)
    best: list[tuple[float, int, Scored]] = []  # heap of the top_k, slowest on top
    costed: list[Scored] = []
    front = _FrontFloor()
    closest: Scored | None = None
    for index, group in enumerate(groups):
        if progress is not None and index % 64 == 0:
            progress(index, len(groups))
        points = list(group.points())
        full = len(best) >= top_k
        past_bound = full and group.bound_s > -best[0][0]
        if past_bound and not pareto:
            break  # groups come in bound order: no later one can enter the top_k
        beaten = past_bound or (full and _floor(model, points[0][0]) > -best[0][0])
        if beaten and not pareto:
            continue
        if beaten:  # only the Pareto front can still gain from this group
            points = [(p, f) for p, f in points if not front.dominates(group.bound_s, f)]
        for point, _ in points:
            strategy = point.strategy(model.training.global_batch_size)
            if not restriction.allows(strategy):
                continue
            scored = _cost(model, strategy)
            if scored is None:
                continue
            costed.append(scored)
            if not space.fits(scored.prediction):
                closest = _less_memory(closest, scored)
                continue
            front.add(scored.prediction)
            entry = (-scored.prediction.step_time_s, -len(costed), scored)
            if len(best) < top_k:
                heapq.heappush(best, entry)
            elif entry > best[0]:
                heapq.heapreplace(best, entry)
    if progress is not None:
        progress(len(groups), len(groups))
    if not best:
        if restriction.refused and not costed and space.leanest is None:
            raise restriction.nothing_runs()  # else the target runs some: memory is the cause
        raise _nothing_fits(model, space, closest)
    ranked = tuple(entry[2] for entry in sorted(best, key=lambda e: (-e[0], -e[1])))
    stats = SolverStats(
        candidates_enumerated=space.enumerated + space.over_memory,
        candidates_costed=len(costed),
        pruned_by_memory=space.over_memory,
        search_time_s=time.perf_counter() - started,
        notes=tuple(note for note in (restriction.note(), space.headroom_note()) if note),
    )
    log.info(
        "search: %d candidates, %d costed in %.2f s",
        space.enumerated, len(costed), stats.search_time_s,
    )  # fmt: skip
    return SearchResult(ranked, stats, tuple(costed))


class _Restriction:
    """The target framework the search keeps to, and what it refused on the way: per
    refused field, how many candidates and the first refusal (its words and fix)."""

    def __init__(self, target: Target | None, model: CostModel) -> None:
        self.target = target or PLANNER
        self.training = model.training
        self.refused: Counter[str] = Counter()
        self.example: dict[str, Refusal] = {}
        # ((parallel dimensions, model-parallel ranks), refusal): pure data parallelism
        # first, where a pinned setting the target refuses shows itself
        self.simplest: tuple[tuple[int, int], Refusal] | None = None

    def allows(self, strategy: Strategy) -> bool:
        refusal = strategy_refusal(self.target, strategy, self.training)
        if refusal is not None:
            self.refused[refusal.field] += 1
            self.example.setdefault(refusal.field, refusal)
            simplicity = (strategy.parallel_dimensions, strategy.tp * strategy.pp * strategy.cp)
            if self.simplest is None or simplicity < self.simplest[0]:
                self.simplest = (simplicity, refusal)
        return refusal is None

    def _reasons(self) -> str:
        common = self.refused.most_common(3)
        return "; ".join(
            f"{self.example[field].describe()} ({count:,} candidates)" for field, count in common
        )

    def note(self) -> str:
        if self.target.is_planner and not self.refused:
            return ""
        if not self.refused:
            return f"kept to {self.target}: it runs every candidate priced"
        total = sum(self.refused.values())
        return (
            f"kept to {self.target}: skipped {total:,} candidates it cannot run ({self._reasons()})"
        )

    def nothing_runs(self) -> SpecError:
        """No candidate runs: the refusal of the one with the fewest parallel dimensions
        first (what the pins or the batch cause), then the most frequent."""
        assert self.simplest is not None  # something was refused
        simplest = self.simplest[1]
        where = "this runtime" if self.target.is_planner else f"--for {self.target}"
        return SpecError(
            f"{where}: no candidate runs there; the simplest is refused: "
            f"{simplest.describe()}; {simplest.fix}. Refusals by count: {self._reasons()}; "
            "otherwise change the pins or the global batch (pure data parallelism needs one "
            "that divides over all the GPUs), or target another framework"
        )


class _FrontFloor:
    """Priced, fitting candidates as (step time, peak memory): answers whether one of them
    beats a candidate's time bound and memory floor both (then it cannot be on the front)."""

    def __init__(self) -> None:
        self._points: list[tuple[float, float]] = []  # (seconds, bytes), sorted by seconds

    def add(self, prediction: Prediction) -> None:
        point = (prediction.step_time_s, prediction.peak_memory_gib * _GIB)
        self._points.insert(bisect.bisect(self._points, point), point)

    def dominates(self, bound_s: float, floor_bytes: float) -> bool:
        faster = self._points[: bisect.bisect(self._points, (bound_s, math.inf))]
        return any(memory <= floor_bytes for _, memory in faster)


def _check_pinned_compression(pins: Pins, lossy: LossyCompression) -> None:
    pinned = pins.compression
    if pinned is not None and not lossy.allows(pinned):
        name = option_name(pinned)
        raise SpecError(
            f"compression {pinned.describe()} is lossy and not allowed: allow it with "
            f"--allow-lossy-compression {name} (Python: lossy=LossyCompression.parse({name!r}))"
        )


def _too_many_chunks(pins: Pins, limits: ModelLimits, space: _Space) -> str:
    """Why pinned ``pp x virtual_stages`` chunks exceed what the model gives the target."""
    virtual = f" * virtual_stages({pins.virtual_stages})" if pins.virtual_stages else ""
    reason = f"pp({pins.pp}){virtual} chunks > the model's {space.max_chunks} at most"
    refusal = blockless_chunk_refusal(space.target)
    if refusal is not None and space.model.most_chunks > space.max_chunks:
        reason += f" (one block each: {refusal.why}; {refusal.fix})"
    return reason


def _no_candidates(model: CostModel, limits: ModelLimits, pins: Pins, space: _Space) -> SpecError:
    """Why the pins leave nothing to search, naming the factors."""
    gpus, batch = model.cluster.num_gpus, model.training.global_batch_size
    degrees = {name: getattr(pins, name) for name in ("dp", "tp", "pp", "cp")}
    pinned = {name: value for name, value in degrees.items() if value is not None}
    product = math.prod(pinned.values())
    reasons = []
    if gpus % product or (len(pinned) == 4 and product != gpus):
        factors = " * ".join(f"{name}({value})" for name, value in pinned.items())
        reasons.append(f"{factors} = {product} does not divide num_gpus({gpus})")
    shape_blocker = limits.tp_blocker(pins.tp) if pins.tp is not None else None
    split_over_tp = (
        limits.sequence_blocker(pins.tp, pins.cp or 1, sp=True)
        if pins.sequence_parallel and pins.tp is not None and pins.tp > 1
        else None
    )
    if shape_blocker is not None:
        reasons.append(shape_blocker)
    elif split_over_tp is not None:
        reasons.append(split_over_tp)
    elif pins.tp is not None and pins.tp > 1 and space.target.is_planner:
        options = [sp for sp in (False, True) if pins.allows("sequence_parallel", sp)]
        blockers = {sp: limits.layout_blocker(pins.tp, sp) for sp in options}
        if options and all(blockers.values()):
            what = "sequence parallelism" if options == [True] else "tensor parallelism"
            why = blockers[options[-1]]
            if len(options) == 2 and blockers[False] != blockers[True]:
                why = f"without sequence parallelism, {blockers[False]}; with it, {why}"
            reasons.append(f"{what} at tp({pins.tp}): {why}")
    elif pins.sequence_parallel and pins.tp is None and space.target.is_planner:
        tps = [tp for tp in _divisors(gpus) if tp > 1 and limits.allows_tp(tp)]
        problems = [limits.layout_blocker(tp, True) for tp in tps]
        if tps and all(problems):
            shown = ", ".join(map(str, tps))
            reasons.append(f"sequence parallelism at tp {shown}: {problems[0]}")
    if pins.pp is not None and pins.pp > 1 and limits.pipeline_problem:
        reasons.append(f"pp({pins.pp}): {limits.pipeline_problem}")
    elif pins.pp is not None and pins.pp * (pins.virtual_stages or 1) > space.max_chunks:
        reasons.append(_too_many_chunks(pins, limits, space))
    if pins.dp_shard is not None:
        needs = "a zero >= 1 and " if pins.zero == 0 else ""
        reasons.append(
            f"dp_shard({pins.dp_shard}) needs {needs}a data-parallel degree it divides, and no "
            "mesh here gives one"
        )
    chunks = virtual_stages_problem(pins.schedule, pins.virtual_stages or 1)
    if chunks is not None:
        reasons.append(chunks)
    pipelined = (pins.virtual_stages or 1) > 1 or pins.schedule not in (None, Schedule.ONE_F_ONE_B)
    if pipelined and (pins.pp == 1 or limits.pipeline_problem):
        why = "pp is pinned to 1" if pins.pp == 1 else limits.pipeline_problem
        reasons.append(
            f"schedule {pins.schedule or Schedule.INTERLEAVED_1F1B} with virtual_stages "
            f"{pins.virtual_stages or 1} needs a pipeline (pp > 1), but {why}"
        )
    if pins.recompute == RecomputeMode.SELECTIVE and limits.selective_problem:
        reasons.append(f"recompute selective: {limits.selective_problem}")
    if pins.schedule is not None and pins.recompute is RecomputeMode.SELECTIVE:
        blocker = ParallelDims(pp=2).schedule_blocker(pins.schedule, 2, selective=True)
        if blocker is not None:  # the schedule itself, whatever the pipeline's depth
            reasons.append(blocker)
    if pins.cp is not None and pins.cp > 1 and limits.context_parallel_problem:
        reasons.append(f"cp({pins.cp}): {limits.context_parallel_problem}")
    if pins.cp is not None and pins.cp > 1:
        split = limits.sequence_blocker(pins.tp or 1, pins.cp, sp=False)
        if split is not None:
            reasons.append(split)
    if pins.dp is not None and batch % pins.dp:
        reasons.append(f"dp({pins.dp}) does not divide global_batch_size({batch})")
    if pins.zero == 0:
        dims = ParallelDims(
            dp=pins.dp or max(1, gpus // product), cp=pins.cp or 1, tp=pins.tp or 1,
            pp=pins.pp or 1,
        )  # fmt: skip
        blocker = ddp_blocker(space.target, dims, tied=not limits.ddp_over_tp)
        if blocker is not None:
            reasons.append(f"zero(0): {blocker}; ZeRO >= 1 replicates the same gradients")
    if pins.ep is not None and pins.ep > 1 and limits.expert_problem:
        reasons.append(f"ep({pins.ep}): {limits.expert_problem}")
    if pins.ep is not None and pins.ep > 1:
        widest = ParallelDims(dp=gpus // (pins.pp or 1), ep=pins.ep)  # every rank of a stage
        blocker = widest.expert_blocker(limits.num_experts)
        if blocker is not None:
            reasons.append(blocker)
        refusal = experts_beside_sequence_parallel_refusal(
            space.target, ep=pins.ep, sequence_parallel=pins.sequence_parallel is True,
            traced=limits.traced,
        ) or expert_tensor_parallel_refusal(
            space.target, ep=pins.ep, etp=pins.etp or 1, tp=pins.tp or pins.etp or 1
        )  # fmt: skip
        if refusal is not None:
            reasons.append(f"{refusal.describe()} ({refusal.fix})")
    if pins.etp is not None and pins.etp > 1 and (pins.ep == 1 or not limits.num_experts):
        blocker = ParallelDims(etp=pins.etp).expert_blocker(limits.num_experts)
        reasons.append(f"{blocker}{'' if limits.num_experts else ' (this model has no experts)'}")
    if space.compression_blocked is not None:
        reasons.append(space.compression_blocked)
    if not reasons:
        reasons.extend(_micro_batch_reason(model.training, pins, space))
    detail = "; ".join(dict.fromkeys(reasons)) or (
        "no dp x tp x pp x cp of the GPUs divides the heads, the blocks and the global batch "
        "with the other pins"
    )
    return SpecError(
        f"no strategy for {gpus} GPUs with pins ({pins.describe()}): {detail}; change the pins"
    )


def _micro_batch_reason(training: Training, pins: Pins, space: _Space) -> list[str]:
    """Why a given micro-batch size leaves no mesh: it divides no data-parallel rank's
    share of the global batch (``[]`` when none is given, or it is not the reason)."""
    micro = training.micro_batch_size or pins.micro_batch_size
    if None not in (training.micro_batch_size, pins.micro_batch_size) and (
        training.micro_batch_size != pins.micro_batch_size
    ):
        return [
            f"micro_batch_size is {training.micro_batch_size} in the training settings and "
            f"{pins.micro_batch_size} in the pins; give it in one place"
        ]
    dps = sorted({dp for dp, *_ in space.meshes()})
    if micro is None or not dps or any(space.micro_batches(dp) for dp in dps):
        return []
    shares = sorted({training.global_batch_size // dp for dp in dps})
    fits = sorted({m for share in shares for m in range(1, share + 1) if share % m == 0})
    return [
        f"micro_batch_size({micro}) divides no data-parallel rank's share of "
        f"global_batch_size({training.global_batch_size}) (samples per rank: "
        f"{', '.join(map(str, shares))}); use a micro-batch size of {', '.join(map(str, fits))}"
    ]


def _floor(model: CostModel, point: _Point) -> float:
    """The pipelined compute of ``point``'s group (ZeRO aside): a tighter time bound."""
    try:
        return model.pipeline_floor_s(point.strategy(model.training.global_batch_size))
    except SpecError:
        return 0.0  # let the estimate say why it cannot be priced


def _cost(model: CostModel, strategy: Strategy) -> Scored | None:
    try:
        return Scored(strategy, model.estimate(strategy))
    except SpecError as exc:  # a combination the cost model cannot price (too few blocks...)
        log.debug("skipped %s: %s", strategy.describe(), exc)
        return None


def _less_memory(current: Scored | None, new: Scored) -> Scored:
    if current is None or new.prediction.peak_memory_gib < current.prediction.peak_memory_gib:
        return new
    return current


def _nothing_fits(model: CostModel, space: _Space, closest: Scored | None) -> InfeasibleError:
    """How much memory the least hungry candidate needs, and what would make it fit."""
    if space.leanest is not None:
        lean = _cost(model, space.leanest.strategy(model.training.global_batch_size))
        if lean is not None:
            closest = _less_memory(closest, lean)
    limit = model.profile.memory_capacity_gib - space.headroom_gib
    has = f"has {model.profile.memory_capacity_gib:.0f} GiB" + (
        f", {limit:.0f} with {space.headroom_gib:.3g} GiB kept free (--memory-headroom)"
        if space.headroom_gib
        else ""
    )
    if closest is None:
        return InfeasibleError(
            f"no strategy fits {model.cluster.num_gpus} x {model.cluster.gpu}, which {has}; "
            "use more GPUs or a GPU with more memory"
        )
    prediction = closest.prediction
    parts = sorted(prediction.memory_gib.items(), key=lambda item: -item[1])
    dominant = ", ".join(f"{name} {gib:.1f}" for name, gib in parts[:3])
    wider = _gpus_to_fit(model, closest.strategy, limit)
    kept = ""
    if wider.gpus is None:
        kept = (
            f" (on {wider.factor}x the GPUs, its data parallelism as much wider, it would "
            f"still need {wider.need_gib:.1f} GiB: more of them do not shrink what stays on each)"
        )
    advice = _fit_advice(model, closest, space.target, wider.gpus)
    return InfeasibleError(
        f"no strategy fits: the closest, {closest.strategy.describe()}, needs "
        f"{prediction.peak_memory_gib:.1f} GiB per GPU (largest terms, GiB: {dominant}) but a "
        f"{model.cluster.gpu} {has}{kept}. To fit: " + ", or ".join(advice)
    )


_WIDEST = 64  # the widest data parallelism the advice tries, in multiples of the GPUs


class _Widening(NamedTuple):
    """Where a strategy fits with its data parallelism widened: ``gpus`` (``None``: not
    up to ``factor`` times them, where it needs ``need_gib`` per GPU)."""

    gpus: int | None
    factor: int
    need_gib: float


def _gpus_to_fit(model: CostModel, strategy: Strategy, limit: float) -> _Widening:
    """The fewest GPUs, a multiple of ``strategy``'s that the cluster's nodes hold (up to
    :data:`_WIDEST` times), at which it fits in ``limit`` GiB per GPU with its data
    parallelism widened as far, each rank keeping its batch: ZeRO shards the states
    wider, a gathered layer or a bucket stays."""
    gpus = model.cluster.num_gpus

    @functools.cache  # each factor is a cost model of its own: price it once
    def need(factor: int) -> float:
        shard = None if strategy.dp_shard is None else strategy.dp_shard * factor
        wider = strategy.model_copy(update={"dp": strategy.dp * factor, "dp_shard": shard})
        return model.widened(factor).estimate(wider).peak_memory_gib

    factors = [k for k in range(2, _WIDEST + 1) if _holds(model.cluster, gpus * k)]
    widest = need(factors[-1])  # some multiple up to 64 spans whole nodes
    if widest > limit:
        return _Widening(None, factors[-1], widest)
    low, high = -1, len(factors) - 1  # the need falls as the factor grows
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if need(factors[middle]) > limit else (low, middle)
    return _Widening(gpus * factors[high], factors[high], need(factors[high]))


def _holds(cluster: Cluster, gpus: int) -> bool:
    try:
        cluster.with_gpus(gpus)
    except ValidationError:
        return False
    return True


def _fit_advice(model: CostModel, closest: Scored, target: Target, wider: int | None) -> list[str]:
    """What would make ``closest`` fit, each a change it lacks and ``target`` runs: the
    GPUs at which its data parallelism widened fits (``wider``, :func:`_gpus_to_fit`;
    ``None``: none up to its widest), recompute, a smaller micro-batch, ZeRO-3, model
    parallelism, a shorter sequence."""
    strategy, gpus = closest.strategy, model.cluster.num_gpus

    def runs(**change: object) -> bool:
        changed = strategy.model_copy(update=change)
        return strategy_refusal(target, changed, model.training) is None

    advice = []
    if wider is not None:
        factor = wider // gpus
        batch = model.training.global_batch_size * factor
        advice.append(
            f"about {wider} GPUs instead of {gpus} (dp {factor}x as wide, each replica "
            f"keeping its sequences: global batch {batch})"
        )
    if strategy.recompute is not RecomputeMode.FULL:
        full = runs(recompute=RecomputeMode.FULL)
        advice.append("full recompute" if full else f"full recompute (which {target} refuses)")
    if strategy.micro_batch_size > 1:
        advice.append("micro-batch 1")
    if strategy.zero < 3 and runs(zero=3):
        advice.append("ZeRO-3")
    if wider is None and runs(tp=2 * strategy.tp, sequence_parallel=True):
        advice.append("more GPUs for tensor or pipeline parallelism")
    return [*advice, "a shorter sequence"]
