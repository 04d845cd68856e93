"""ParallelDims: each mesh rule, its message, and the search's filter agreeing with
validation because both ask it."""

from __future__ import annotations

import math
from functools import cache

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from planner.cost import CostModel, graph_from_spec
from planner.errors import PlannerError
from planner.frameworks import parse_target
from planner.graph import OpGraph
from planner.models import get_preset, resolve_model
from planner.parallel_dims import ParallelDims
from planner.solve.search import ModelLimits, in_search_space
from planner.spec import (
    Cluster,
    Compression,
    CompressionKind,
    ModelSpec,
    Plan,
    RecomputeMode,
    Schedule,
    Strategy,
    Training,
)
from planner.validate import validate_plan_for_world

# ---- members ------------------------------------------------------------------------


def test_degrees_replicas_and_zero_shards():
    dims = ParallelDims(dp=4, tp=2, pp=3, cp=2, zero=2, dp_shard=2)
    assert dims.world_size == 48
    assert dims.replicas == 8  # dp x cp hold the same weights
    assert dims.zero_shard_ranks == 4 and dims.shards_parameters  # dp_shard x cp
    ddp = ParallelDims(dp=4, cp=2)
    assert ddp.zero_shard_ranks == 1 and not ddp.shards_parameters
    assert not ParallelDims(zero=3).shards_parameters  # one rank: nothing to shard


def test_of_reads_the_strategy():
    strategy = Strategy(dp=4, dp_shard=2, zero=1, tp=2, cp=2, pp=2, sequence_parallel=True)
    assert ParallelDims.of(strategy) == ParallelDims(
        dp=4, tp=2, pp=2, cp=2, zero=1, dp_shard=2, sp=True
    )
    assert ParallelDims.of(Strategy(dp=8, zero=3)).dp_shard == 8  # all of dp by default
    assert ParallelDims.of(Strategy(dp=8)).dp_shard == 1


def test_sequence_needs_two_cp_chunks():
    assert ParallelDims(cp=4).sequence_blocker(64) is None
    message = ParallelDims(cp=4).sequence_blocker(36)
    assert message is not None
    assert "seq_len 36" in message and "2 * cp(4) = 8" in message
    assert "choose seq_len divisible by 8" in message
    assert ParallelDims(tp=3).sequence_blocker(32) is None  # without sp tp splits no tokens


def test_sequence_parallelism_needs_tokens_per_cp_rank_divisible_by_tp():
    assert ParallelDims(tp=4, cp=2, sp=True).sequence_blocker(64) is None  # 32 per rank
    message = ParallelDims(tp=3, cp=2, sp=True).sequence_blocker(64)
    assert message is not None
    assert "seq_len 64 / cp(2) = 32 tokens per rank" in message and "tp(3)" in message
    assert "divisible by cp * tp or turn sequence parallelism off" in message
    assert ParallelDims(tp=3, sp=False).sequence_blocker(64) is None


def test_batch_arithmetic():
    assert ParallelDims(dp=4).batch_blocker(32, 2, 4) is None
    message = ParallelDims(dp=4).batch_blocker(32, 2, 3)
    assert message is not None
    assert "training.global_batch_size = 32" in message
    assert "dp(4) * micro_batch_size(2) * num_microbatches(3) = 24" in message
    assert "make them agree" in message


def test_ddp_replicas_need_no_pipeline_and_untied_tp():
    assert ParallelDims(dp=1).ddp_blocker(tied=True) is None  # nothing to replicate
    assert ParallelDims(dp=4, tp=2).ddp_blocker(tied=False) is None
    pipeline = ParallelDims(dp=4, pp=2).ddp_blocker(tied=False)
    assert pipeline == "pp(2) > 1: DDP cannot run under a pipeline schedule"
    tied = ParallelDims(dp=1, cp=2, tp=2).ddp_blocker(tied=True)  # cp ranks replicate too
    assert tied is not None and "tp(2) > 1 with tied weights" in tied


@pytest.mark.parametrize(
    ("dims", "kind", "names", "fix"),
    [
        (ParallelDims(), CompressionKind.BF16, "compression.kind = 'bf16' needs dp(1) * cp(1) > 1", ""),
        (ParallelDims(dp=4), CompressionKind.INT8, "'int8' with zero = 0", "use zero >= 1"),
        (
            ParallelDims(dp=4, zero=2, dp_shard=4), CompressionKind.POWERSGD,
            "'powersgd' with zero = 2", "use zero = 0",
        ),
        (ParallelDims(dp=4, cp=2), CompressionKind.LOCAL_SGD, "'local_sgd' with cp(2)", "use cp = 1"),
        (ParallelDims(dp=4, pp=2), CompressionKind.FP16, "'fp16': pp(2) > 1", "DDP cannot run"),
    ],
)  # fmt: skip
def test_compression_refusals_name_the_field_value_and_fix(dims, kind, names, fix):
    message = dims.compression_blocker(kind)
    assert message is not None and names in message and fix in message


def test_compression_where_it_runs():
    fsdp = ParallelDims(dp=4, zero=3, dp_shard=4)
    for kind in (CompressionKind.NONE, CompressionKind.BF16, CompressionKind.INT8):
        assert fsdp.compression_blocker(kind) is None
    ddp = ParallelDims(dp=4, tp=2)
    for kind in (CompressionKind.FP16, CompressionKind.POWERSGD, CompressionKind.LOCAL_SGD):
        assert ddp.compression_blocker(kind) is None
    assert ddp.compression_blocker(CompressionKind.POWERSGD, tied=True) is not None
    cp_only = ParallelDims(cp=2, zero=1)  # ZeRO shards over the cp ranks
    assert cp_only.compression_blocker(CompressionKind.INT8) is None


def test_zero_bubble_runs_no_selective_recompute():
    """Zero-bubble's two backward passes per micro-batch (input, then weight gradients)
    meet torch's selective checkpoint, which allows one: refused with the fix."""
    dims = ParallelDims(pp=2)
    message = dims.schedule_blocker(Schedule.ZERO_BUBBLE, 4, selective=True)
    assert message is not None
    assert "recompute 'selective'" in message and "use recompute 'full' or 'none'" in message
    assert dims.schedule_blocker(Schedule.ZERO_BUBBLE, 4) is None
    assert dims.schedule_blocker(Schedule.ONE_F_ONE_B, 4, selective=True) is None
    assert ParallelDims().schedule_blocker(Schedule.ZERO_BUBBLE, 4, selective=True) is None


def test_the_search_says_why_zero_bubble_and_selective_recompute_are_not_planned():
    from planner.planning import make_plan
    from planner.solve.search import Pins

    training = Training(global_batch_size=8, seq_len=16, dtype="fp32")
    cluster = Cluster(gpu="h100-sxm-80gb", num_gpus=2)
    pins = Pins(pp=2, schedule=Schedule.ZERO_BUBBLE, recompute=RecomputeMode.SELECTIVE)
    with pytest.raises(PlannerError, match="selective activation checkpointing allows one"):
        make_plan(resolve_model("tiny-llama"), cluster, training, pins=pins)


def test_local_sgd_group_divides_dp_and_is_smaller():
    dims = ParallelDims(dp=8)
    assert dims.local_sgd_blocker(4) is None and dims.local_sgd_blocker(1) is None
    for bad in (8, 3, None):
        message = dims.local_sgd_blocker(bad)
        assert message is not None
        assert f"local_group = {bad} with dp(8)" in message and "local_group = 4" in message


# ---- the search's filter is validation's verdict ------------------------------------

PRESETS = ("tiny-llama", "gpt3-1.3b")
_TOKENS = (24, 32, 48, 64, 96, 2048)


@cache
def _spec(preset: str, seq: int) -> ModelSpec:
    return get_preset(preset).with_seq_len(seq)


@cache
def _graph(preset: str, seq: int) -> OpGraph:
    return graph_from_spec(_spec(preset, seq))


def _limits(spec: ModelSpec) -> ModelLimits:
    """A zoo transformer's limits, as :func:`planner.planning.model_limits` gives them."""
    return ModelLimits(
        num_blocks=spec.num_layers, seq_len=spec.seq_len, num_heads=spec.num_heads,
        num_kv_heads=spec.kv_heads, vocab_size=spec.vocab_size,
    )  # fmt: skip


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def _compressions(draw: st.DrawFn, dp: int) -> Compression:
    kind = draw(st.sampled_from([CompressionKind.NONE] * 6 + list(CompressionKind)))
    if kind is CompressionKind.POWERSGD:
        return Compression(kind=kind, rank=draw(st.sampled_from([1, 2, 4])), warmup_steps=1000)
    if kind is CompressionKind.LOCAL_SGD:
        group = draw(st.sampled_from(sorted({1, 2, 3, 4, *_divisors(dp)})))
        period = draw(st.sampled_from([2, 8]))
        return Compression(kind=kind, period=period, local_group=group, warmup_steps=1000)
    return Compression(kind=kind)


@st.composite
def _cases(draw: st.DrawFn) -> tuple[str, int, Cluster, Training, Strategy]:
    preset = draw(st.sampled_from(PRESETS))
    seq = draw(st.sampled_from(_TOKENS))
    dp = draw(st.sampled_from([1, 2, 3, 4, 8]))
    tp = draw(st.sampled_from([1, 1, 2, 2, 3, 4, 8]))
    pp = draw(st.sampled_from([1, 1, 2, 2, 3, 4]))
    cp = draw(st.sampled_from([1, 1, 1, 2, 2, 3, 4, 8]))
    zero = draw(st.integers(0, 3))
    shard = draw(st.sampled_from([None, None, *_divisors(dp)])) if zero else None
    mbs = draw(st.sampled_from([1, 2, 2, 3, 4, 8, 16, 32]))
    count = draw(st.integers(1, 8))
    batch = dp * mbs * count + draw(st.sampled_from([0] * 12 + [1, dp]))  # mostly consistent
    usual = [Schedule.ONE_F_ONE_B] * (4 if pp == 1 else 0)  # pp = 1: the schedule is moot
    schedule = draw(st.sampled_from(usual + list(Schedule)))
    virtual = draw(st.integers(1, 6)) if schedule is Schedule.INTERLEAVED_1F1B else 1
    strategy = Strategy(
        dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, dp_shard=shard,
        sequence_parallel=tp > 1 and draw(st.booleans()),
        recompute=draw(st.sampled_from(list(RecomputeMode))), micro_batch_size=mbs,
        num_microbatches=count, schedule=schedule, virtual_stages=virtual,
        compression=draw(_compressions(dp)),
    )  # fmt: skip
    world = strategy.world_size
    per_node = draw(st.sampled_from([g for g in (1, 2, 4, 8, 16) if world <= g or world % g == 0]))
    cluster = Cluster(gpu="h100-sxm-80gb", num_gpus=world, gpus_per_node=per_node)
    return preset, seq, cluster, Training(global_batch_size=batch), strategy


def _plan(spec: ModelSpec, cluster: Cluster, training: Training, strategy: Strategy) -> Plan:
    """A plan for ``strategy`` with one named chunk per pipeline stage (validation counts
    them; it reads no module)."""
    stages = [(f"chunk{i}",) for i in range(strategy.num_stages)] if strategy.pp > 1 else []
    return Plan(
        planner_version="test", model_name=spec.name, model_fingerprint="", model=spec,
        cluster=cluster, training=training, strategy=strategy, mesh=strategy.mesh_axes(),
        stages=tuple(stages),
    )  # fmt: skip


def _validation_accepts(plan: Plan) -> str | None:
    try:
        validate_plan_for_world(plan, plan.cluster.num_gpus)
    except PlannerError as exc:
        return str(exc)
    return None


def _outside_the_searched_space(spec: ModelSpec, cluster: Cluster, s: Strategy) -> str | None:
    """Which of the search's documented restrictions (model shapes and heuristics, none of
    them a validation rule) leaves ``s`` out, or ``None``; ``s`` is pinned in full, so the
    restrictions on unpinned fields (tokens per cp rank, ZeRO-1, lossy options) do not apply."""
    blocks = spec.num_layers
    interleaved = s.schedule is Schedule.INTERLEAVED_1F1B
    hybrid = math.gcd(s.dp, max(1, cluster.gpus_per_node // (s.tp * s.cp)))
    restrictions = {
        "tp divides the heads and vocabulary": _limits(spec).allows_tp(s.tp),
        "a block for every pipeline chunk": s.num_stages <= blocks,
        "micro-batches of at most 16": s.micro_batch_size <= 16,
        "pp = 1 runs as 1f1b": s.pp > 1 or s.schedule is Schedule.ONE_F_ONE_B,
        "interleaving: micro-batches a multiple of pp": not interleaved
        or s.num_microbatches % s.pp == 0,
        "interleaving: 2+ virtual stages, > 4 only when even": not interleaved
        or (s.virtual_stages >= 2 and (s.virtual_stages <= 4 or blocks % s.num_stages == 0)),
        "ZeRO only with replicas": s.zero == 0 or s.dp * s.cp > 1,
        "ZeRO over all of dp or one node's share": s.zero == 0
        or s.dp == 1
        or s.shard_degree in {s.dp, hybrid} - {1},
    }
    return next((name for name, holds in restrictions.items() if not holds), None)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_cases())
def test_the_search_enumerates_exactly_what_validation_accepts(case):
    preset, seq, cluster, training, strategy = case
    spec = _spec(preset, seq)
    model = CostModel(_graph(preset, seq), cluster, training)
    searched = in_search_space(model, _limits(spec), strategy)
    refusal = _validation_accepts(_plan(spec, cluster, training, strategy))
    if searched:
        event("searched and valid")
        assert refusal is None, f"searched but refused: {strategy.describe()}: {refusal}"
        return
    if refusal is not None:
        event("refused by both")
        return
    restriction = _outside_the_searched_space(spec, cluster, strategy)
    event(f"valid, outside the search: {restriction}")
    assert restriction is not None, f"valid but not searched: {strategy.describe()}"


def test_sequence_parallelism_is_searched_where_validation_accepts_it():
    """The property on a fixed pair: 24 tokens over cp 4 leave 6 per rank, which tp 4
    cannot split under sequence parallelism; without it both accept the mesh."""
    spec = _spec("gpt3-1.3b", 24)
    cluster = Cluster(gpu="h100-sxm-80gb", num_gpus=16)
    training = Training(global_batch_size=16)
    model = CostModel(_graph("gpt3-1.3b", 24), cluster, training)
    plain = Strategy(tp=4, cp=4, zero=2, micro_batch_size=8, num_microbatches=2)
    assert in_search_space(model, _limits(spec), plain)
    assert _validation_accepts(_plan(spec, cluster, training, plain)) is None
    sp = plain.model_copy(update={"sequence_parallel": True})
    assert not in_search_space(model, _limits(spec), sp)
    refusal = _validation_accepts(_plan(spec, cluster, training, sp))
    assert refusal is not None and "6 tokens per rank is not divisible by tp(4)" in refusal


def test_plain_data_parallelism_under_a_pipeline_is_searched_for_the_frameworks():
    """DDP cannot run under this runtime's pipeline schedules (ZeRO >= 1 does), but
    Megatron-LM's pipelines all-reduce plain data-parallel gradients (Narayanan's runs)."""
    spec = _spec("gpt3-1.3b", 2048)
    cluster = Cluster(gpu="a100-sxm-80gb", num_gpus=16)
    model = CostModel(_graph("gpt3-1.3b", 2048), cluster, Training(global_batch_size=64))
    ddp = Strategy(dp=8, pp=2, micro_batch_size=2, num_microbatches=4)
    assert not in_search_space(model, _limits(spec), ddp)
    assert in_search_space(model, _limits(spec), ddp, parse_target("megatron"))
