"""Invariants of the cost model over random configurations (hypothesis).

Each property draws a few hundred runs (model, GPU, dtype, sequence, mesh, ZeRO,
recompute, micro-batching, schedule, implementation options) that the cost model can
price, built as the search and ``plan estimate`` build it
(:func:`~planner.cost.build.build_cost_model`), and checks what must hold whatever the
calibration: more sharding or recompute never costs memory, recompute never saves
time, faster links never slow a step, more micro-batches never grow the bubble's share,
the breakdown adds up, the same input gives the same output, and MFU stays at or below
the training dtype's peak. Draws are derandomized, so CI sees the same cases each run.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from functools import lru_cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.cost import CostModel, CostOptions
from planner.cost.build import build_cost_model, spec_graph
from planner.hardware import load_profile
from planner.parallel_dims import ParallelDims
from planner.presets import get_preset
from planner.spec import (
    Cluster,
    Compression,
    CompressionKind,
    DType,
    Prediction,
    RecomputeMode,
    Schedule,
    Strategy,
    Training,
)

PRESETS = (
    "gpt2", "gpt2-medium", "gpt3-1.3b", "llama2-7b", "llama3-8b", "llama3-70b", "bert-large",
    "tiny-llama",
)  # fmt: skip
GPUS = ("h100-sxm-80gb", "h200-sxm-141gb", "a100-sxm-80gb", "b200", "mi300x", "h100-96gb")
SEQS = (512, 2048, 8192, 32768)
RECOMPUTE = (RecomputeMode.NONE, RecomputeMode.SELECTIVE, RecomputeMode.FULL)
SETTINGS = settings(
    max_examples=200, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip
REL = 1e-9  # float noise allowed where a sum is taken in another order


@dataclass(frozen=True)
class Run:
    """One priced run: what the cost model is built from and the strategy it prices."""

    preset: str
    gpu: str
    dtype: DType
    seq: int
    options: CostOptions
    strategy: Strategy
    gpus_per_node: int = 8
    intra_GBps: float | None = None
    inter_GBps: float | None = None

    @property
    def global_batch(self) -> int:
        s = self.strategy
        return s.dp * s.micro_batch_size * s.num_microbatches

    def model(self) -> CostModel:
        return _model(
            self.preset, self.gpu, self.dtype, self.seq, self.options, self.strategy.world_size,
            self.gpus_per_node, self.global_batch, self.intra_GBps, self.inter_GBps,
        )  # fmt: skip

    def estimate(self) -> Prediction:
        return self.model().estimate(self.strategy)

    def with_strategy(self, **fields: object) -> Run:
        data = self.strategy.model_dump()
        data.update(fields)
        return replace(self, strategy=Strategy.model_validate(data))


@lru_cache(maxsize=512)
def _model(
    preset: str, gpu: str, dtype: DType, seq: int, options: CostOptions, gpus: int,
    gpus_per_node: int, global_batch: int, intra: float | None, inter: float | None,
) -> CostModel:  # fmt: skip
    spec = get_preset(preset).with_seq_len(seq)
    training = Training(global_batch_size=global_batch, dtype=dtype)
    cluster = Cluster(
        gpu=gpu, num_gpus=gpus, gpus_per_node=min(gpus_per_node, gpus),
        intra_node_GBps=intra, inter_node_GBps=inter,
    )  # fmt: skip
    graph = spec_graph(spec, training, options)
    return build_cost_model(graph, cluster, training, causal=spec.causal, options=options)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def runs(draw: st.DrawFn, *, pipelined: bool | None = None, sharded: bool = False) -> Run:
    """A run the cost model prices: a valid mesh, batch, schedule and ZeRO sharding.

    ``pipelined``: force pp > 1 (True) or pp = 1 (False); ``sharded``: at least two
    data-parallel replicas (dp x cp > 1), so every ZeRO stage applies."""
    preset = draw(st.sampled_from(PRESETS))
    spec = get_preset(preset)
    gpu = draw(st.sampled_from(GPUS))
    dtypes = [d for d in (DType.BF16, DType.FP16, DType.FP8) if d in load_profile(gpu).peak_tflops]
    dtype = draw(st.sampled_from(dtypes))
    seq = draw(st.sampled_from([s for s in SEQS if s <= 4 * spec.seq_len] or [spec.seq_len]))
    gpus = draw(st.sampled_from((1, 2, 4, 8, 16, 32)))
    heads = math.gcd(spec.num_heads, spec.kv_heads)
    tp = draw(st.sampled_from([d for d in _divisors(gpus) if heads % d == 0 and d <= 8]))
    cp = draw(st.sampled_from([d for d in _divisors(gpus // tp) if seq % (2 * d) == 0 and d <= 4]))
    pps = [d for d in _divisors(gpus // (tp * cp)) if d <= spec.num_layers]
    if pipelined is True:
        pps = [d for d in pps if d > 1]
    elif pipelined is False:
        pps = [1]
    pp = draw(st.sampled_from(pps or [1]))
    dp = gpus // (tp * cp * pp)
    if sharded and dp * cp == 1:
        dp, gpus = 2, gpus * 2
    zero = draw(st.sampled_from((0, 1, 2, 3) if dp * cp > 1 else (0,)))
    shards = [d for d in _divisors(dp) if d > 1 or dp == 1]
    dp_shard = draw(st.sampled_from(shards)) if zero else None
    schedule, virtual = Schedule.ONE_F_ONE_B, 1
    if pp > 1:
        schedule = draw(st.sampled_from(list(Schedule)))
        if schedule is Schedule.INTERLEAVED_1F1B:
            most = spec.num_layers // pp
            virtual = draw(st.sampled_from([v for v in (2, 3, 4) if v <= most] or [1]))
            if virtual == 1:
                schedule = Schedule.ONE_F_ONE_B
    mbs = draw(st.sampled_from((1, 2, 4, 8)))
    least = pp if schedule in (Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED_1F1B) else 1
    microbatches = draw(st.sampled_from([m for m in (1, 2, 4, 8, 16, 32) if m >= least]))
    if schedule is Schedule.INTERLEAVED_1F1B:
        microbatches = pp * max(1, microbatches // pp)
    options = CostOptions(
        fused_pointwise=draw(st.booleans()),
        tp_comm_overlap=draw(st.booleans()),
        selective=draw(st.sampled_from(("attention", "op"))),
        attention=draw(st.sampled_from(("flash", "flash", "unfused"))),
        sp_regather_input=draw(st.booleans()),
    )
    strategy = Strategy(
        dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, dp_shard=dp_shard,
        sequence_parallel=tp > 1 and draw(st.booleans()) and (seq // cp) % tp == 0,
        recompute=draw(st.sampled_from(RECOMPUTE)), micro_batch_size=mbs,
        num_microbatches=microbatches, schedule=schedule, virtual_stages=virtual,
        compression=draw(_compressions(ParallelDims(dp, tp, pp, cp, zero, dp_shard or 1))),
    )  # fmt: skip
    inter = draw(st.sampled_from((None, None, 3.0, 12.5)))  # slow networks expose comm
    return Run(preset, gpu, dtype, seq, options, strategy, draw(st.sampled_from((4, 8))),
               inter_GBps=inter)  # fmt: skip


def _compressions(dims: ParallelDims) -> st.SearchStrategy[Compression]:
    """Gradient compression that runs on ``dims`` (mostly none)."""
    local = max((d for d in _divisors(dims.dp) if d < dims.dp), default=1)
    options = [
        Compression(kind=CompressionKind.BF16),
        Compression(kind=CompressionKind.INT8),
        Compression(kind=CompressionKind.POWERSGD, rank=4),
        Compression(kind=CompressionKind.LOCAL_SGD, period=4, local_group=local),
    ]
    runnable = [c for c in options if dims.compression_blocker(c.kind) is None]
    if dims.local_sgd_blocker(local) is not None:
        runnable = [c for c in runnable if c.kind is not CompressionKind.LOCAL_SGD]
    return st.sampled_from([Compression()] * 3 + runnable)


def _zero_refused(run: Run, zero: int) -> bool:
    """Whether the search leaves ``zero`` out on this mesh (plain DP where DDP cannot run)."""
    dims = ParallelDims.of(run.strategy)
    tied = get_preset(run.preset).tied_embeddings
    return zero == 0 and dims.ddp_blocker(tied=tied) is not None


@SETTINGS
@given(runs(sharded=True))
def test_memory_never_grows_with_the_zero_stage(run):
    shard = run.strategy.dp_shard or run.strategy.dp
    peaks = {}
    for zero in (0, 1, 2, 3):
        if _zero_refused(run, zero):
            continue
        stage = run.with_strategy(
            zero=zero, dp_shard=shard if zero else None, compression=Compression()
        )
        peaks[zero] = stage.estimate().peak_memory_gib
    stages = sorted(peaks)
    for lower, higher in itertools.pairwise(stages):
        assert peaks[higher] <= peaks[lower] * (1 + REL), (lower, higher, peaks)


@SETTINGS
@given(runs())
def test_more_recompute_never_costs_memory_nor_saves_time(run):
    predictions = [run.with_strategy(recompute=mode).estimate() for mode in RECOMPUTE]
    for less, more in itertools.pairwise(predictions):
        assert more.peak_memory_gib <= less.peak_memory_gib * (1 + REL)
        assert more.step_time_s >= less.step_time_s * (1 - REL)


@SETTINGS
@given(runs(), st.sampled_from((1.5, 2.0, 4.0)), st.sampled_from(("intra", "inter", "both")))
def test_faster_links_never_slow_a_step(run, factor, which):
    links = load_profile(run.gpu).links
    intra = links.intra_node.bandwidth_GBps
    inter = run.inter_GBps or links.inter_node.bandwidth_GBps
    base = replace(run, intra_GBps=intra, inter_GBps=inter)
    faster = replace(
        base,
        intra_GBps=intra * (factor if which != "inter" else 1.0),
        inter_GBps=inter * (factor if which != "intra" else 1.0),
    )
    assert faster.estimate().step_time_s <= base.estimate().step_time_s * (1 + REL)


def _bubble_share(prediction: Prediction) -> float:
    return prediction.breakdown_s["bubble"] / prediction.step_time_s


@SETTINGS
@given(runs(pipelined=True))
def test_the_bubble_share_shrinks_with_more_microbatches(run):
    """Per schedule: doubling the micro-batches, at the same micro-batch size (a larger
    global batch) or at the same global batch (half the micro-batch), never grows the
    bubble's share of the step."""
    s = run.strategy
    more = run.with_strategy(num_microbatches=2 * s.num_microbatches)
    assert _bubble_share(more.estimate()) <= _bubble_share(run.estimate()) * (1 + REL)
    if s.micro_batch_size > 1:
        halves = run.with_strategy(
            num_microbatches=2 * s.num_microbatches, micro_batch_size=s.micro_batch_size // 2
        )
        assert _bubble_share(halves.estimate()) <= _bubble_share(run.estimate()) * (1 + REL)


@SETTINGS
@given(runs())
def test_breakdowns_add_up_to_the_step_and_the_peak(run):
    p = run.estimate()
    assert all(seconds >= 0 for seconds in p.breakdown_s.values()), p.breakdown_s
    assert sum(p.breakdown_s.values()) == pytest.approx(p.step_time_s, rel=REL)
    assert all(gib >= 0 for gib in p.memory_gib.values()), p.memory_gib
    assert sum(p.memory_gib.values()) == pytest.approx(p.peak_memory_gib, rel=REL)


@SETTINGS
@given(runs())
def test_the_same_run_gives_the_same_prediction(run):
    """Whatever the model priced before (its caches), and on a fresh model."""
    model = run.model()
    first = model.estimate(run.strategy)
    for mode in RECOMPUTE:  # warm the caches with other strategies of the same set-up
        model.estimate(run.with_strategy(recompute=mode).strategy)
    again = model.estimate(run.strategy)
    fresh = _model.__wrapped__(
        run.preset, run.gpu, run.dtype, run.seq, run.options, run.strategy.world_size,
        run.gpus_per_node, run.global_batch, run.intra_GBps, run.inter_GBps,
    ).estimate(run.strategy)  # fmt: skip
    assert first == again == fresh


@SETTINGS
@given(runs(), st.sampled_from((1, 4, 16, 64)))
def test_mfu_is_at_most_one_against_the_dtypes_peak(run, longer):
    """Also at sequences up to 64x longer, where attention (counted whole when causal)
    dominates the step."""
    assert 0 < run.estimate().mfu <= 1
    stretched = replace(run, seq=min(run.seq * longer, 262144))
    assert 0 < stretched.estimate().mfu <= 1
