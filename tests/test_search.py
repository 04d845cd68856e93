"""The strategy search: optimality against brute force, pins, errors, plan assembly."""

import json
from dataclasses import fields

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from planner.cli import main
from planner.cost import CostModel, estimate_run, graph_from_spec
from planner.errors import InfeasibleError, PlannerError, SpecError
from planner.graph import OpKind
from planner.models import PRESETS, get_preset, handle_for_module, resolve_model
from planner.planning import make_plan, search_plan
from planner.solve.lossy import LossyCompression
from planner.solve.search import (
    _GROUP_ORDER,
    ModelLimits,
    Pins,
    _divisors,
    _Group,
    _Point,
    _Space,
    in_search_space,
    search,
)
from planner.spec import (
    Cluster,
    ModelSpec,
    Plan,
    RecomputeMode,
    Schedule,
    Strategy,
    Training,
    load_document,
)
from planner.tracing import trace
from tests.devices import write_tp_pays


def _setup(preset="gpt3-1.3b", gpus=16, batch=64, gpu="a100-sxm-80gb", seq=None):
    spec = get_preset(preset)
    if seq is not None:
        spec = spec.with_seq_len(seq)
    graph = graph_from_spec(spec)
    cluster = Cluster(gpu=gpu, num_gpus=gpus, gpus_per_node=min(8, gpus))
    model = CostModel(graph, cluster, Training(global_batch_size=batch))
    limits = ModelLimits(spec.num_layers, spec.seq_len, spec.num_heads, spec.kv_heads)
    return model, limits


def test_branch_and_bound_finds_the_brute_force_optimum():
    model, limits = _setup(gpus=8, batch=32)
    result = search(model, limits, top_k=3)
    space = _Space(model, limits, Pins(), LossyCompression())
    every = [model.estimate(p.strategy(32)) for g in space.groups() for p, _ in g.points()]
    fastest = min(p.step_time_s for p in every if p.fits)
    assert result.best.prediction.step_time_s == pytest.approx(fastest, rel=1e-12)
    times = [s.prediction.step_time_s for s in result.ranked]
    assert times == sorted(times) and len(times) == 3
    assert result.stats.candidates_costed < len(every)  # the bound pruned something


def test_groups_sort_on_their_fields_in_declaration_order():
    """The search sorts by :data:`_GROUP_ORDER`, the comparison ``order=True`` defines:
    the time bound first, then the mesh and settings; points order as they always did."""
    model, limits = _setup(gpus=8, batch=32)
    groups = list(_Space(model, limits, Pins(), LossyCompression()).groups())
    assert sorted(groups, key=_GROUP_ORDER) == sorted(groups)
    compared = [f.name for f in fields(_Group) if f.compare]
    assert compared == ["bound_s", "dp", "tp", "pp", "cp", "ep", "etp", "sp", "mbs",
                        "recompute_rank", "schedule", "virtual", "shardings"]  # fmt: skip
    assert [f.name for f in fields(_Point)] == [
        "bound_s", "dp", "tp", "pp", "cp", "ep", "etp", "zero", "shard", "sp", "mbs",
        "recompute_rank", "schedule", "virtual", "compression",
    ]  # fmt: skip
    group = groups[0]
    for (point, floor), sharding in zip(group.points(), group.shardings, strict=True):
        assert point.bound_s == group.bound_s and point.compression == sharding.compression
        assert (point.zero, point.shard) == (sharding.zero, sharding.shard)
        assert floor <= model.profile.memory_capacity_gib * 2**30


def test_sequence_parallelism_only_where_the_tokens_split_over_tp():
    """24 tokens: cp 4 leaves 6 per rank, which tp 4 cannot split (ParallelDims)."""
    model, limits = _setup(gpus=16, batch=16, seq=24)
    groups = list(_Space(model, limits, Pins(cp=4), LossyCompression()).groups())
    meshes = {(g.tp, g.sp) for g in groups}
    assert (4, False) in meshes and (2, True) in meshes and (4, True) not in meshes
    placeholder = ModelLimits(limits.num_blocks, 1, limits.num_heads, limits.num_kv_heads)
    traced = _Space(model, placeholder, Pins(tp=2), LossyCompression()).groups()
    assert any(g.sp for g in traced)  # seq_len 1: a trace's placeholder, checked later


def test_in_search_space_needs_the_derived_microbatch_count():
    model, limits = _setup(gpus=8, batch=32)
    strategy = Strategy(dp=8, zero=2, micro_batch_size=2, num_microbatches=2)
    assert in_search_space(model, limits, strategy)
    assert not in_search_space(model, limits, strategy.model_copy(update={"num_microbatches": 3}))


def _front(predictions):
    """(step time, peak memory) points no other point beats in both."""
    points = {(p.step_time_s, p.peak_memory_gib) for p in predictions if p.fits}
    return {
        (t, m) for t, m in points
        if not any(t2 <= t and m2 <= m and (t2, m2) != (t, m) for t2, m2 in points)
    }  # fmt: skip


def test_pareto_mode_prices_the_whole_front_and_keeps_the_optimum():
    model, limits = _setup(gpus=8, batch=32)
    space = _Space(model, limits, Pins(), LossyCompression())
    every = [model.estimate(p.strategy(32)) for g in space.groups() for p, _ in g.points()]
    plain = search(model, limits, top_k=3)
    result = search(model, limits, top_k=3, pareto=True)
    assert [s.strategy for s in result.ranked] == [s.strategy for s in plain.ranked]
    assert _front(s.prediction for s in result.costed) == _front(every)
    assert len(plain.costed) < len(result.costed) < len(every)


def test_results_are_deterministic():
    model, limits = _setup()
    first = search(model, limits, top_k=4)
    second = search(model, limits, top_k=4)
    assert [s.strategy for s in first.ranked] == [s.strategy for s in second.ranked]


def test_pins_are_respected_and_degrees_multiply():
    model, limits = _setup(gpus=32, batch=64)
    pins = Pins(tp=4, pp=2, recompute=RecomputeMode.FULL, zero=1)
    for scored in search(model, limits, pins=pins, top_k=3).ranked:
        s = scored.strategy
        assert (s.tp, s.pp, s.recompute, s.zero) == (4, 2, RecomputeMode.FULL, 1)
        assert s.dp * s.tp * s.pp * s.cp == 32
        assert s.dp * s.micro_batch_size * s.num_microbatches == 64
        assert scored.prediction.fits


def test_tp_must_divide_heads():
    model, limits = _setup(preset="llama3-8b", gpus=16, batch=32, gpu="h100-sxm-80gb", seq=2048)
    for scored in search(model, limits, top_k=5).ranked:
        assert 8 % scored.strategy.tp == 0  # 8 kv heads


def test_pins_that_cannot_hold_name_the_factors():
    model, limits = _setup(gpus=16)
    with pytest.raises(SpecError, match=r"tp\(3\) = 3 does not divide num_gpus\(16\)"):
        search(model, limits, pins=Pins(tp=3))
    with pytest.raises(SpecError, match=r"tp\(4\) \* pp\(8\) = 32 does not divide num_gpus"):
        search(model, limits, pins=Pins(tp=4, pp=8))
    with pytest.raises(SpecError, match=r"zero\(0\): pp\(2\) > 1: DDP cannot run under a pipeline"):
        search(model, limits, pins=Pins(zero=0, pp=2, dp=8))
    uneven, limits = _setup(gpus=4, batch=8, seq=2046)  # 2046 tokens: not 2 cp chunks of 4
    with pytest.raises(SpecError, match=r"seq_len 2046 is not divisible by 2 \* cp\(2\) = 4"):
        search(uneven, limits, pins=Pins(cp=2, dp=2))
    odd, limits = _setup(gpus=4, batch=8, seq=2047)  # 2047 tokens: not split over tp 2
    with pytest.raises(SpecError, match=r"2047 tokens per rank is not divisible by tp\(2\)"):
        search(odd, limits, pins=Pins(tp=2, sequence_parallel=True))


@pytest.mark.parametrize(
    ("pins", "reason"),
    [
        (Pins(schedule=Schedule.ONE_F_ONE_B, virtual_stages=2), r"virtual_stages \(2\) > 1 needs "
         r"schedule 'interleaved-1f1b'"),
        (Pins(etp=2), r"etp\(2\) > 1 needs ep > 1 \(this model has no experts\)"),
        (Pins(zero=0, dp_shard=2), r"dp_shard\(2\) needs a zero >= 1 and a data-parallel"),
        (Pins(dp=16, zero=3, dp_shard=3), r"dp_shard\(3\) needs a data-parallel degree it divides"),
    ],
)  # fmt: skip
def test_pins_that_contradict_each_other_name_the_rule(pins, reason):
    """Not the generic 'no mesh divides...': the rule the pins break together."""
    model, limits = _setup(gpus=16)
    with pytest.raises(SpecError, match=reason):
        search(model, limits, pins=pins)


def test_a_pinned_shard_group_inside_one_node_is_searched():
    """Hybrid sharding with a pinned shard group smaller than a node's data-parallel ranks
    (ZeRO-3 over 2, replicated over 4 on 8 GPUs of one node): searched and priced."""
    model, limits = _setup(gpus=8, batch=32)
    best = search(model, limits, pins=Pins(dp=8, zero=3, dp_shard=2)).best.strategy
    assert (best.dp, best.shard_degree, best.replicate_degree) == (8, 2, 4)


def test_pins_that_do_not_apply_are_errors_not_ignored():
    """Virtual stages (or a pipeline schedule) pinned: only pipelined candidates remain,
    and with pp pinned to 1 the error names the conflict."""
    model, limits = _setup(gpus=16)
    chosen = search(model, limits, pins=Pins(virtual_stages=2), top_k=3).ranked
    assert all(s.strategy.pp > 1 and s.strategy.virtual_stages == 2 for s in chosen)
    with pytest.raises(SpecError, match=r"virtual_stages 2 needs a pipeline .* pp is pinned to 1"):
        search(model, limits, pins=Pins(virtual_stages=2, pp=1))


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        ("gpt2", r"pp\(2\): it has tied weights"),
        ("tests.user_models:gpt_tied", r"pp\(2\): it has tied weights"),
        ("mlp", r"pp\(2\): the model has no repeated blocks"),
    ],
)
def test_a_pipeline_refusal_names_the_rule(model, reason):
    handle = resolve_model(model)
    training = Training(global_batch_size=8, dtype="fp32")
    with pytest.raises(SpecError, match=reason):
        make_plan(handle, Cluster(gpu="h100-sxm-80gb", num_gpus=2), training, pins=Pins(pp=2))


@given(st.integers(min_value=1, max_value=10**6))
@settings(max_examples=200, deadline=None)
def test_divisors_are_every_divisor_in_order(n):
    expected = [d for d in range(1, min(n, 2000) + 1) if n % d == 0]
    assert _divisors(n)[: len(expected)] == expected
    assert all(n % d == 0 for d in _divisors(n)) and _divisors(n)[-1] == n


def test_a_huge_global_batch_is_searched_without_enumerating_its_divisors():
    model, limits = _setup(preset="tiny-gpt", gpus=8, batch=10**8)
    assert search(model, limits, top_k=1).best.prediction.fits


def test_no_fit_says_how_much_memory_and_what_to_change():
    model, limits = _setup(preset="gpt3-175b", gpus=8, batch=8)
    with pytest.raises(InfeasibleError) as info:
        search(model, limits)
    message = str(info.value)
    assert "GiB per GPU" in message and "To fit" in message and "GPUs" in message


def test_published_style_configs_are_inside_the_space():
    model, limits = _setup(preset="gpt3-175b", gpus=64, batch=64)
    strategy = load_document(
        type(search(*_setup(gpus=8, batch=32)).best.strategy),
        {"dp": 1, "tp": 8, "pp": 8, "recompute": "full", "num_microbatches": 64,
         "schedule": "interleaved-1f1b", "virtual_stages": 3},
    )  # fmt: skip
    assert in_search_space(model, limits, strategy)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layers=st.integers(1, 12),
    heads=st.sampled_from([1, 2, 4, 8, 12]),
    head_dim=st.sampled_from([32, 64, 128]),
    gpus=st.sampled_from([1, 2, 4, 8, 16, 24, 32, 64]),
    batch=st.integers(1, 64),
    seq=st.sampled_from([128, 512, 2048]),
    gpu=st.sampled_from(["a100-sxm-40gb", "h100-sxm-80gb"]),
)
def test_random_setups_give_a_valid_plan_or_a_clear_error(
    layers, heads, head_dim, gpus, batch, seq, gpu
):
    spec = ModelSpec(
        family="gpt", num_layers=layers, hidden_size=heads * head_dim, num_heads=heads,
        vocab_size=32000, seq_len=seq,
    )  # fmt: skip
    cluster = Cluster(gpu=gpu, num_gpus=gpus, gpus_per_node=min(8, gpus))
    model = CostModel(graph_from_spec(spec), cluster, Training(global_batch_size=batch))
    limits = ModelLimits(layers, seq, heads, heads)
    try:
        best = search(model, limits, top_k=2).best
    except PlannerError as exc:
        assert str(exc)
        return
    s = best.strategy
    assert s.dp * s.tp * s.pp * s.cp == gpus
    assert batch % s.dp == 0 and s.dp * s.micro_batch_size * s.num_microbatches == batch
    assert heads % s.tp == 0 and s.pp <= layers
    assert (
        best.prediction.fits and best.prediction.peak_memory_gib <= best.prediction.memory_limit_gib
    )


def test_make_plan_assembles_a_runnable_plan():
    handle = resolve_model("llama2-7b", seq_len=1024)
    cluster = Cluster(gpu="a100-sxm-80gb", num_gpus=8)
    plan = make_plan(handle, cluster, Training(global_batch_size=16), pins=Pins(tp=2, pp=2))
    assert plan.strategy.tp == 2 and plan.strategy.pp == 2
    modules = [fqn for stage in plan.stages for fqn in stage]
    assert modules[0] == "tok_embeddings" and modules[-1] == "output"
    assert len(plan.stages) == plan.strategy.num_stages
    assert plan.tp_layout["layers.*.attention.wq"].style == "colwise"
    assert plan.tp_layout["layers.*.feed_forward.w2"].style == "rowwise"
    assert plan.solver.ilp_status == "optimal"
    assert Plan.from_json(plan.to_json()) == plan
    for runner_up in plan.runners_up:
        assert "slower" in runner_up.lost_because


def test_plan_command_writes_and_explains(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["--model", "tiny-gpt", "--cluster", "h100-sxm-80gb", "--gpus", "4",
            "--global-batch", "8", "-o", str(out)]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "Plan for tiny-gpt on 4 x h100-sxm-80gb" in printed and "Runners-up" in printed
    plan = load_document(Plan, out)
    assert plan.strategy.world_size == 4
    assert main(["explain", str(out)]) == 0
    assert "Predicted" in capsys.readouterr().out
    assert main([*args[:-2], "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["strategy"]["dp"] >= 1


def test_plan_command_reports_user_errors(capsys):
    assert main(["--model", "tiny-gpt", "--cluster", "h100-sxm-80gb", "--global-batch", "8"]) == 2
    assert "give --gpus N" in capsys.readouterr().err
    args = ["--model", "gpt3-175b", "--cluster", "a100-sxm-40gb", "--gpus", "8",
            "--global-batch", "8"]  # fmt: skip
    assert main(args) == 2
    assert "To fit" in capsys.readouterr().err


def test_the_plan_predicts_what_plan_estimate_predicts():
    handle = resolve_model("gpt3-1.3b")
    cluster = Cluster(gpu="a100-sxm-80gb", num_gpus=16)
    training = Training(global_batch_size=64)
    plan = make_plan(handle, cluster, training, top_k=1)
    config = {
        "model": {"preset": "gpt3-1.3b"},
        "cluster": cluster.model_dump(),
        "training": training.model_dump(),
        "strategy": plan.strategy.model_dump(),
    }
    assert estimate_run(config).step_time_s == pytest.approx(plan.prediction.step_time_s)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_formula_graph_matches_the_trace_of_every_preset(preset):
    handle = resolve_model(preset, seq_len=128)
    traced, formula = trace(handle, seq_len=128), graph_from_spec(handle.spec)
    assert [s.modules for s in formula.segments] == [s.modules for s in traced.segments]
    assert formula.param_count == traced.param_count
    assert _tensor_core_flops(formula) == pytest.approx(_tensor_core_flops(traced), rel=1e-3)


def _tensor_core_flops(graph):
    """Matmul, convolution and attention FLOPs: what MFU counts (the formula graph also
    prices element-wise FLOPs, which the trace leaves at zero)."""
    kinds = (OpKind.MATMUL, OpKind.ATTENTION, OpKind.CONV)
    return sum(
        node.flops_fwd
        for segment in graph.segments
        for node in graph.segment_type(segment).nodes
        if node.kind in kinds
    )


@pytest.mark.parametrize(
    ("model", "pins"), [("mlp", Pins()), ("cnn", Pins(tp=2)), ("mlp-mixer", Pins(tp=2))]
)
def test_models_without_transformer_blocks_get_runnable_plans(model, pins, tmp_path):
    gpu = str(write_tp_pays(tmp_path)) if pins.tp else "a100-sxm-80gb"  # where TP pays
    plan = make_plan(
        resolve_model(model), Cluster(gpu=gpu, num_gpus=4), Training(global_batch_size=64),
        pins=pins,
    )  # fmt: skip
    assert plan.strategy.world_size == 4 and plan.strategy.pp == 1 and plan.strategy.cp == 1
    if plan.strategy.sequence_parallel:
        assert "sequence_parallel" in {m.style.value for m in plan.tp_layout.values()}


@pytest.mark.slow  # solves and rehearses a full-size layout
def test_tied_gpt2_large_at_tp2_plans_with_the_vocabulary_parallel_tie():
    """Once refused with a request to change layouts no option allows (issue #16)."""
    handle = resolve_model("gpt2-large")
    plan = make_plan(
        handle, Cluster(gpu="h100-sxm-80gb", num_gpus=2), Training(global_batch_size=1),
        pins=Pins(tp=2),
    )  # fmt: skip
    assert plan.strategy.tp == 2
    assert plan.tp_layout["tok_embeddings"].params == {"weight": "Shard(0)"}


def test_a_micro_batch_that_divides_no_ranks_share_is_named_with_the_sizes_that_do():
    training = Training(global_batch_size=8, seq_len=16, micro_batch_size=3)
    cluster = Cluster(gpu="h100-sxm-80gb", num_gpus=2)
    with pytest.raises(SpecError) as refused:
        make_plan(resolve_model("tiny-llama"), cluster, training)
    assert (
        "micro_batch_size(3) divides no data-parallel rank's share of global_batch_size(8) "
        "(samples per rank: 4, 8); use a micro-batch size of 1, 2, 4, 8" in str(refused.value)
    )


def test_a_micro_batch_given_twice_differently_says_so():
    """The training settings say 8 per micro-batch, the pins 4: not "8 divides no share"."""
    training = Training(global_batch_size=8, seq_len=16, micro_batch_size=8)
    cluster = Cluster(gpu="h100-sxm-80gb", num_gpus=2)
    with pytest.raises(SpecError, match=r"micro_batch_size is 8 in the training settings and 4 in"):
        make_plan(resolve_model("tiny-llama"), cluster, training, pins=Pins(micro_batch_size=4))


class _ClampedMLP(nn.Module):
    """An MLP that clips its input projection in place (as OLMo's ``clip_qkv`` does)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.c_fc(x)
        hidden.clamp_(min=-0.5, max=0.5)
        return self.c_proj(torch.relu(hidden))


def test_selective_recompute_is_not_offered_where_a_kept_matmul_output_is_modified_in_place():
    """Selective recompute keeps every matmul output for backward: one the model then
    clamps in place would give wrong gradients, so only none or full recompute is searched."""
    from tests.user_models import GPT

    model = GPT()
    for block in model.transformer.h:
        block.mlp = _ClampedMLP(64)
    handle, cluster = handle_for_module(model), Cluster(gpu="h100-sxm-80gb", num_gpus=2)
    training = Training(global_batch_size=8, seq_len=16, dtype="fp32")
    with pytest.raises(SpecError, match=r"recompute selective: 'transformer.h.0.mlp' writes "
                                          r"into the output of 'mlp.c_fc' in place"):  # fmt: skip
        make_plan(handle, cluster, training, pins=Pins(recompute=RecomputeMode.SELECTIVE))
    costed = search_plan(handle, cluster, training).costed
    assert costed and all(s.strategy.recompute is not RecomputeMode.SELECTIVE for s in costed)


def test_pinned_sequence_parallelism_that_would_shard_nothing_says_so(tmp_path):
    """An MLP has no blocks and no sequence: its sequence-parallel layout is its tensor
    parallel one, so a pinned ``sequence_parallel`` would only rename the plan (and its
    price assume split activations that are not); the search says so, and tp runs."""
    from planner.models import ModelHandle
    from planner.models.small import MLPStack
    from tests.devices import write_tp_pays

    model = MLPStack((64, 256, 64))
    handle = ModelHandle("mlp", "test", model, lambda b, s: (torch.randn(b, 64),))
    cluster = Cluster(gpu=str(write_tp_pays(tmp_path)), num_gpus=2)
    training = Training(global_batch_size=8, dtype="fp32")
    with pytest.raises(
        SpecError, match=r"sequence parallelism at tp\(2\): it would shard nothing, .*--no-seq"
    ):
        make_plan(handle, cluster, training, pins=Pins(tp=2, sequence_parallel=True))
    plan = make_plan(handle, cluster, training, pins=Pins(tp=2))
    assert plan.strategy.tp == 2 and not plan.strategy.sequence_parallel
