"""Which lossy gradient compression the search may choose, and where each starts to pay.

Every option changes the gradients the optimizer sees, so none is chosen unless the
user allows it (``plan --allow-lossy-compression``). The search then prices each
allowed option on every mesh the runtime can run it on and keeps it only where the
step gets faster:

- ``bf16``/``fp16``: DDP hook (ZeRO 0, no pipeline), or the
  FSDP2 reduce dtype with ZeRO >= 1 on any mesh;
- ``int8``: FSDP2's reduce-scatter as int8 blocks with fp32 scales, ZeRO >= 1;
- ``powersgd:R``: DDP hook (ZeRO 0, no pipeline or context parallelism; over
  tensor-parallel shards when ``tp > 1``);
- ``local_sgd:H``: the same meshes, when the data-parallel group spans several nodes or
  sites; the local group is the data-parallel ranks of one such domain.

The rank of PowerSGD and the period of local SGD are the user's: a lower rank or a
longer period always moves fewer bytes, and what they cost in convergence is not
something a step-time model can see.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from planner.cost import CostModel
from planner.errors import SpecError
from planner.parallel_dims import ParallelDims
from planner.spec import Cluster, Compression, CompressionKind, DType, Strategy

__all__ = [
    "LOSSY_WARMUP_STEPS",
    "CompressionKey",
    "LossyCompression",
    "compression_blocker",
    "crossover_bandwidth",
    "decode",
    "encode",
    "option_name",
    "tradeoff",
]

# Uncompressed (PowerSGD) or globally averaged (local SGD) steps before the option
# starts: torch's PowerSGDState default, which its docs recommend for accuracy.
LOSSY_WARMUP_STEPS = 1000
_DEFAULT_POWERSGD_RANK = 4
_DEFAULT_LOCAL_SGD_PERIOD = 8
CompressionKey = tuple[str, int, int, int]  # (kind, rank, period, local group): sortable
_NONE: CompressionKey = ("none", 0, 0, 0)


def encode(compression: Compression) -> CompressionKey:
    """A plain, sortable tuple for ``compression`` (the search keeps candidates as tuples)."""
    return (
        compression.kind.value,
        compression.rank or 0,
        compression.period or 0,
        compression.local_group or 0,
    )


def decode(key: CompressionKey) -> Compression:
    """The :class:`Compression` a key stands for, with the planner's warm-up steps."""
    kind, rank, period, local = key
    if kind == CompressionKind.NONE.value:
        return Compression()
    lossy_warmup = kind in (CompressionKind.POWERSGD.value, CompressionKind.LOCAL_SGD.value)
    return Compression(
        kind=CompressionKind(kind),
        rank=rank or None,
        period=period or None,
        local_group=local or None,
        warmup_steps=LOSSY_WARMUP_STEPS if lossy_warmup else 0,
    )


@dataclass(frozen=True)
class LossyCompression:
    """The lossy options the user allows; the empty default allows none."""

    half: bool = False  # fp16/bf16 reduction, in the training dtype's half type
    int8: bool = False  # int8 reduce-scatter under FSDP
    powersgd_ranks: tuple[int, ...] = ()
    local_sgd_periods: tuple[int, ...] = ()

    @classmethod
    def parse(cls, text: str) -> LossyCompression:
        """``'bf16,int8,powersgd:4,local_sgd:8'``; ``''`` or ``'default'`` means bf16, int8
        and PowerSGD rank 4 (local SGD is only chosen when named)."""
        items = [item.strip() for item in text.split(",") if item.strip()]
        if not items or items == ["default"]:
            return cls(half=True, int8=True, powersgd_ranks=(_DEFAULT_POWERSGD_RANK,))
        half, int8, ranks, periods = False, False, [], []
        for item in items:
            name, _, value = item.partition(":")
            if name in ("fp16", "bf16", "half"):
                half = True
            elif name == "int8":
                int8 = True
            elif name == "powersgd":
                ranks.append(_positive(item, value or str(_DEFAULT_POWERSGD_RANK), minimum=1))
            elif name == "local_sgd":
                periods.append(_positive(item, value or str(_DEFAULT_LOCAL_SGD_PERIOD), minimum=2))
            else:
                raise SpecError(
                    f"--allow-lossy-compression item {item!r} is unknown; use bf16, fp16, int8, "
                    "powersgd[:RANK] or local_sgd[:PERIOD], comma-separated"
                )
        return cls(half, int8, tuple(sorted(set(ranks))), tuple(sorted(set(periods))))

    @classmethod
    def allowing(cls, compression: Compression) -> LossyCompression:
        """Just what it takes to allow ``compression``."""
        return cls.parse(option_name(compression)) if compression.kind.lossy else cls()

    def allows(self, compression: Compression) -> bool:
        kind = compression.kind
        if kind.half:
            return self.half
        if kind is CompressionKind.INT8:
            return self.int8
        if kind is CompressionKind.POWERSGD:
            return compression.rank in self.powersgd_ranks
        if kind is CompressionKind.LOCAL_SGD:
            return compression.period in self.local_sgd_periods
        return True

    @property
    def allows_any(self) -> bool:
        return self.half or self.int8 or bool(self.powersgd_ranks) or bool(self.local_sgd_periods)

    def describe(self) -> str:
        parts = ["half"] if self.half else []
        parts += ["int8"] if self.int8 else []
        parts += [f"powersgd:{r}" for r in self.powersgd_ranks]
        parts += [f"local_sgd:{h}" for h in self.local_sgd_periods]
        return ",".join(parts) or "none"

    def keys(
        self,
        cluster: Cluster,
        dtype: DType,
        *,
        dp: int,
        tp: int,
        pp: int,
        cp: int,
        zero: int,
        dp_shard: int | None = None,
        ddp_over_tp: bool = True,
        ep: int = 1,
    ) -> Iterator[CompressionKey]:
        """The options (``none`` first) the runtime can run on this mesh and ZeRO stage
        (:meth:`ParallelDims.compression_blocker`); ``dp_shard`` defaults to dp under
        ZeRO; ``ddp_over_tp`` is false for models whose tied weights keep DDP off TP shards."""
        yield _NONE
        shard = dp_shard if dp_shard is not None else (dp if zero else 1)
        dims = ParallelDims(dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, dp_shard=shard, ep=ep)

        def runs(kind: CompressionKind) -> bool:
            return dims.compression_blocker(kind, tied=not ddp_over_tp) is None

        if self.half and runs(_half_kind(dtype)):
            yield (_half_kind(dtype).value, 0, 0, 0)
        if self.int8 and runs(CompressionKind.INT8):
            yield (CompressionKind.INT8.value, 0, 0, 0)
        if self.powersgd_ranks and runs(CompressionKind.POWERSGD):
            for rank in self.powersgd_ranks:
                yield (CompressionKind.POWERSGD.value, rank, 0, 0)
        if self.local_sgd_periods and runs(CompressionKind.LOCAL_SGD):
            for local in _local_groups(cluster, dp, tp):
                for period in self.local_sgd_periods:
                    yield (CompressionKind.LOCAL_SGD.value, 0, period, local)


def compression_blocker(
    compression: Compression, dims: ParallelDims, *, tied: bool = False
) -> str | None:
    """Why ``compression`` cannot run on the mesh ``dims``, or ``None``: what validation
    asks :class:`ParallelDims` (:meth:`~ParallelDims.compression_blocker`, and
    :meth:`~ParallelDims.local_sgd_blocker` for local SGD's group)."""
    blocker = dims.compression_blocker(compression.kind, tied=tied)
    if blocker is None and compression.kind is CompressionKind.LOCAL_SGD:
        blocker = dims.local_sgd_blocker(compression.local_group)
    return blocker


def option_name(compression: Compression) -> str:
    """The ``--allow-lossy-compression`` item that allows ``compression``."""
    if compression.kind is CompressionKind.POWERSGD:
        return f"powersgd:{compression.rank}"
    if compression.kind is CompressionKind.LOCAL_SGD:
        return f"local_sgd:{compression.period}"
    return compression.kind.value


def _positive(item: str, value: str, *, minimum: int) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < minimum:
        raise SpecError(
            f"--allow-lossy-compression item {item!r}: {value!r} must be an integer >= {minimum}"
        )
    return number


def _half_kind(dtype: DType) -> CompressionKind:
    """fp16 reduction for fp16 training (same range), bf16 otherwise."""
    return CompressionKind.FP16 if dtype is DType.FP16 else CompressionKind.BF16


def _local_groups(cluster: Cluster, dp: int, tp: int) -> list[int]:
    """Data-parallel ranks of one node or one slower-tier domain, when ``dp`` spans several
    of them (data-parallel ranks are ``tp`` GPUs apart)."""
    domains = {min(cluster.gpus_per_node, cluster.num_gpus)}
    domains |= {tier.domain_size for tier in cluster.extra_tiers}
    groups = {d // tp for d in domains if d % tp == 0}
    return sorted(g for g in groups if 1 < g < dp and dp % g == 0)


def crossover_bandwidth(
    chooses_option: Callable[[float], bool],
    low_GBps: float,
    high_GBps: float,
    *,
    points: int = 16,
    steps: int = 6,
) -> float | None:
    """The highest bandwidth in ``[low, high]`` (GB/s, or any unit) at which
    ``chooses_option`` holds, ``None`` if it holds nowhere.

    Scans ``points`` bandwidths spaced evenly on a log scale from ``high`` down (the
    choice need not be monotone: discrete layouts can flip back and forth), then
    bisects ``steps`` times between the highest one that holds and the point above it.
    """
    ratio = (high_GBps / low_GBps) ** (1 / (points - 1))
    grid = [high_GBps / ratio**i for i in range(points)]
    holds = next((i for i, bandwidth in enumerate(grid) if chooses_option(bandwidth)), None)
    if holds is None:
        return None
    if holds == 0:
        return high_GBps
    low, high = math.log(grid[holds]), math.log(grid[holds - 1])
    for _ in range(steps):
        middle = (low + high) / 2
        if chooses_option(math.exp(middle)):
            low = middle
        else:
            high = middle
    return math.exp(low)


def tradeoff(model: CostModel, strategy: Strategy) -> str:
    """What ``strategy``'s compression trades, in one sentence with the model's figures:
    bytes on the data-parallel links against compute, memory and the gradients' fidelity."""
    compression = strategy.compression
    if compression.kind is CompressionKind.NONE:
        return ""
    exact = strategy.model_copy(update={"compression": Compression()})
    before, after = model.dp_payload_bytes(exact), model.dp_payload_bytes(strategy)
    prediction = model.estimate(strategy)
    compute = prediction.breakdown_s.get("compression", 0.0)
    memory = prediction.memory_gib.get("compression", 0.0)
    saved = (
        f"{before / max(after, 1.0):.1f}x fewer bytes over the data-parallel group "
        f"({_bytes(before)} -> {_bytes(after)} per rank per step)"
    )
    costs = f"+{compute * 1e3:.0f} ms compute per step" if compute else ""
    if memory:
        costs += f", +{memory:.2f} GiB memory"
    return f"{compression.describe()}: {saved}{'; ' + costs if costs else ''}; {_fidelity(compression)}"


def _fidelity(compression: Compression) -> str:
    kind = compression.kind
    if kind.half:
        mantissa = 10 if kind is CompressionKind.FP16 else 7
        return (
            f"gradients are summed in {kind.value} ({mantissa}-bit mantissa): small "
            "contributions can round away"
        )
    if kind is CompressionKind.INT8:
        return (
            "gradients are sent as int8 in blocks of 256 with an fp32 scale each and summed "
            "in fp32: each rank's contribution is off by at most max|block| / 254 per element"
        )
    if kind is CompressionKind.POWERSGD:
        return (
            f"gradient matrices are sent as rank-{compression.rank} approximations with error "
            f"feedback after {compression.warmup_steps} exact steps; loss per step can lag the "
            "exact run (Vogels et al., 2019): check convergence"
        )
    return (
        f"gradients are averaged within groups of {compression.local_group} ranks and the "
        f"parameters over all of them every {compression.period} steps (after "
        f"{compression.warmup_steps} global steps); replicas drift in between, which changes "
        "the optimisation (Lin et al., 2020): check convergence"
    )


def _bytes(size: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size:.0f} B"
