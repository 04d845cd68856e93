"""Expert tensor parallelism (Megatron-Core's ``--expert-tensor-parallel-size``): each
expert's width split over ``etp`` consecutive ranks, EP groups ``etp`` apart.

Priced, searched and exported for Megatron-LM; every other target, this runtime
included, refuses it with the field and the fix.
"""

from __future__ import annotations

import pytest

from planner.cost.communication import Collective, collective_time, link_for_axis
from planner.cost.experts import ep_comm, expert_tradeoff, routed_elements
from planner.cost.tp import ShardKey
from planner.errors import ExportError, SpecError
from planner.export import export_plan
from planner.frameworks import PLANNER, parse_target, strategy_refusal
from planner.graph import OpKind, OpRole
from planner.importers import import_config
from planner.models import resolve_model
from planner.parallel_dims import ParallelDims
from planner.presets import get_preset
from planner.solve.search import Pins, in_search_space, search
from planner.spec import RecomputeMode, Strategy
from tests.test_cost_experts import _limits, _model
from tests.test_export import TINY_MIXTRAL, moe_plan

MIXTRAL = get_preset("mixtral-8x22b")


def _moe_type(model):
    return next(t for t in model.graph.types.values() if t.num_experts)


def test_the_mesh_carves_experts_etp_innermost_then_ep() -> None:
    dims = ParallelDims(dp=4, tp=2, zero=1, dp_shard=4, ep=4, etp=2)
    assert dims.expert_group == 8
    assert dims.expert_replicas == 1 and dims.expert_shard_ranks == 1
    wider = ParallelDims(dp=8, tp=2, zero=1, dp_shard=8, ep=4, etp=2)
    assert wider.expert_replicas == 2 and wider.expert_shard_ranks == 2
    blocked = ParallelDims(dp=2, tp=2, zero=1, dp_shard=2, ep=4, etp=2).expert_blocker(8)
    assert (
        blocked is not None and "ep(4) * etp(2) does not divide dp_shard * cp * tp = 4" in blocked
    )
    with pytest.raises(ValueError, match=r"etp \(2\) > 1 needs ep > 1"):
        Strategy(tp=2, etp=2)


def test_etp_splits_expert_weights_and_adds_the_gather_and_scatter() -> None:
    """Per MoE layer and pass: the all-to-alls as at etp 1 (EP ranks 2 apart, still in
    the node) plus an all-gather and a reduce-scatter of the pair the ETP group received."""
    model = _model(MIXTRAL, 64, 64)
    moe = _moe_type(model)
    plain = ShardKey(2, 1, True, 1, 4, 1)
    split = ShardKey(2, 1, True, 1, 4, 2)
    for mode in (RecomputeMode.NONE, RecomputeMode.FULL):
        one = model._pricer.price(moe, plain, mode)
        two = model._pricer.price(moe, split, mode)
        assert two.expert_param_count == pytest.approx(one.expert_param_count / 2)
        assert two.param_count == one.param_count  # the dense weights are the tp layout's
    pairs = routed_elements(moe, split) * 2  # bf16 bytes a rank sends per all-to-all
    link = link_for_axis(2, 1, model.cluster, model.profile)
    etp_s = collective_time(Collective.ALL_GATHER, 2 * pairs, 2, link) + collective_time(
        Collective.REDUCE_SCATTER, 2 * pairs, 2, link
    )
    a, b = (ep_comm(moe, key, 2, model._pricer.links, 1.0) for key in (plain, split))
    assert b.forward_s - a.forward_s == pytest.approx(etp_s)
    assert b.backward_s - a.backward_s == pytest.approx(etp_s)


def test_the_first_expert_gemm_keeps_the_gathered_rows() -> None:
    model = _model(MIXTRAL, 64, 64)
    moe = _moe_type(model)
    one = model._pricer.price(moe, ShardKey(2, 1, True, 1, 4, 1), RecomputeMode.NONE)
    two = model._pricer.price(moe, ShardKey(2, 1, True, 1, 4, 2), RecomputeMode.NONE)
    gemm = next(n for n in moe.nodes if n.role is OpRole.EXPERTS and n.kind is OpKind.MATMUL)
    extra = gemm.saved_bytes / 2  # its input at etp 1 is 1/tp of the traced rows
    assert two.activation_bytes - one.activation_bytes == pytest.approx(extra)


def test_every_ep_prices_as_if_priced_directly_under_etp() -> None:
    model = _model(MIXTRAL, 64, 64)
    moe = _moe_type(model)
    key = ShardKey(2, 1, True, 1, 8, 2)
    derived, direct = (
        model._type_cost(moe, key, RecomputeMode.NONE),
        model._pricer.price(moe, key, RecomputeMode.NONE),
    )
    for name in ("forward_s", "backward_s", "comm_ep_s", "expert_param_count", "activation_bytes"):
        assert getattr(derived, name) == pytest.approx(getattr(direct, name)), name


def test_only_megatron_runs_it_and_the_search_finds_it_there() -> None:
    model = _model(MIXTRAL, 64, 64)
    limits = _limits(MIXTRAL, model)
    strategy = Strategy(
        dp=8, tp=4, pp=2, ep=8, etp=4, zero=1, sequence_parallel=True,
        micro_batch_size=1, num_microbatches=8,
    )  # fmt: skip
    megatron = parse_target("megatron")
    assert in_search_space(model, limits, strategy, megatron)
    assert not in_search_space(model, limits, strategy)  # this runtime
    without_sp = strategy.model_copy(update={"sequence_parallel": False})
    refusal = strategy_refusal(PLANNER, without_sp, model.training)
    assert refusal is not None and refusal.field == "strategy.etp" and "--etp 1" in refusal.fix
    torchtitan = strategy_refusal(parse_target("torchtitan==0.2"), strategy, model.training)
    assert torchtitan is not None
    pinned = search(model, limits, pins=Pins(ep=8, etp=4), top_k=1, target=megatron)
    assert pinned.best.strategy.etp == 4
    apart = search(model, limits, pins=Pins(tp=1, ep=4, etp=2), top_k=1, target=megatron)
    assert (apart.best.strategy.tp, apart.best.strategy.etp) == (1, 2)  # any etp Megatron runs
    text = expert_tradeoff(model, pinned.best.strategy)
    assert "each split over 4 consecutive ranks" in text and "8 ranks 4 apart" in text


def test_a_pinned_etp_the_target_cannot_run_is_refused_with_the_field() -> None:
    model = _model(get_preset("tiny-moe"), 8, 16)
    limits = _limits(get_preset("tiny-moe"), model)
    with pytest.raises(SpecError, match=r"strategy\.etp = 2: beside ep\(2\).*target megatron"):
        search(model, limits, pins=Pins(tp=2, ep=2, etp=2), top_k=1)
    megatron = parse_target("megatron")
    with pytest.raises(SpecError, match=r"etp\(2\) > 1 needs ep > 1"):
        search(model, limits, pins=Pins(ep=1, etp=2), top_k=1, target=megatron)
    assert search(model, limits, pins=Pins(etp=2), top_k=1, target=megatron).best.strategy.ep > 1


def test_megatron_export_and_import_carry_etp() -> None:
    plan = moe_plan(TINY_MIXTRAL, dp=2, tp=2, ep=2, etp=2, zero=1, sequence_parallel=True)
    text = export_plan(plan, "megatron")
    assert "--expert-tensor-parallel-size 2" in text
    assert "--expert-model-parallel-size 2" in text
    read = import_config(text, cluster=plan.cluster).run
    assert (read.strategy.ep, read.strategy.etp) == (2, 2)
    with pytest.raises(ExportError, match=r"strategy\.etp = 2"):
        export_plan(plan.model_copy(update={
            "strategy": plan.strategy.model_copy(update={"sequence_parallel": False, "zero": 2})
        }), "torchtitan==0.3")  # fmt: skip


def test_this_runtime_refuses_to_apply_it() -> None:
    from strategies.apply import parallelize

    plan = moe_plan(TINY_MIXTRAL, dp=2, tp=2, ep=2, etp=2, zero=1)
    model = resolve_model(TINY_MIXTRAL).module
    with pytest.raises(SpecError, match=r"plan\.strategy\.etp = 2: beside ep\(2\).*--etp 1"):
        parallelize(model, plan)
