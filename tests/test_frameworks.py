"""Plans for a target framework: what each release runs is one set of rules
(planner.frameworks) that the search keeps to and the exporters refuse by, so a plan
searched ``--for X`` always exports to X; near-tie preference and memory headroom."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.cli import main
from planner.errors import ExportError, InfeasibleError, SpecError
from planner.export import export_plan
from planner.frameworks import (
    Framework,
    model_refusal,
    parse_target,
    strategy_refusal,
    torchtitan_model,
)
from planner.models import get_preset, handle_for_module, resolve_model
from planner.modules import check_model_against_plan
from planner.planning import make_plan, preferred
from planner.solve.search import Headroom, Pins, Scored
from planner.spec import (
    Cluster,
    Compression,
    CompressionKind,
    DType,
    Optimizer,
    Plan,
    Prediction,
    RecomputeMode,
    Schedule,
    Strategy,
    Training,
    load_document,
)
from planner.validate import check_plan
from tests.test_export import TINY_MIXTRAL, TINY_MLA, moe_plan, plan_for
from tests.user_models import gpt

# ---- targets ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("torchtitan", "torchtitan==0.3"),
        ("torchtitan==0.2", "torchtitan==0.2"),
        ("torchtitan==0.2.2", "torchtitan==0.2.2"),
        ("deepspeed==0.19", "deepspeed==0.19.8"),
        ("deepspeed==0.19.7", "deepspeed==0.19.7"),
        ("Megatron", "megatron==0.16"),
        ("planner", "planner"),
    ],
)
def test_targets_parse_to_a_release(text, shown):
    assert str(parse_target(text)) == shown


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("colossal", "--for = 'colossal': unknown framework 'colossal'; use one of planner"),
        ("torchtitan==0.1", "outside the releases the planner writes settings for (0.2, 0.3)"),
        ("deepspeed==x", "version 'x' is not dotted numbers"),
        ("megatron==1.0", "megatron 1.0 is outside the releases"),
    ],
)
def test_unknown_targets_name_the_known_ones(text, message):
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_target(text)


def test_deepspeed_hybrid_sharding_depends_on_the_release():
    strategy = Strategy(dp=16, zero=3, dp_shard=8)
    training = Training(global_batch_size=16)
    assert strategy_refusal(parse_target("deepspeed==0.19.6"), strategy, training) is None
    refusal = strategy_refusal(parse_target("deepspeed==0.19.7"), strategy, training)
    assert refusal is not None and refusal.field == "strategy.dp_shard"
    assert "MiCS" in refusal.why and "deepspeed==0.19.6" in refusal.fix


def test_frameworks_that_build_their_own_transformer_need_a_model_description():
    refusal = model_refusal(parse_target("torchtitan"), None)
    assert refusal is not None and "builds its own transformer" in refusal.why
    assert model_refusal(parse_target("deepspeed"), None) is None
    assert model_refusal(parse_target("planner"), None) is None


# ---- the search's restriction is the exporter's verdict -----------------------------

_TARGETS = ("torchtitan==0.2", "torchtitan==0.3", "megatron", "deepspeed==0.19.6", "deepspeed")


@st.composite
def searchable_strategies(draw) -> tuple[Strategy, Training]:
    """Strategies the search can emit for tiny-llama (uniform recompute, no
    recompute_blocks), with training settings, valid by check_plan."""
    tp = draw(st.sampled_from([1, 2]))
    pp = draw(st.sampled_from([1, 2]))
    cp = draw(st.sampled_from([1, 2]))
    dp = draw(st.sampled_from([1, 2, 4]))
    zero = draw(st.sampled_from([0, 1, 2, 3]))
    replicas = dp * cp
    if replicas == 1:
        zero = 0
    shard = draw(st.sampled_from([d for d in (1, 2, dp) if dp % d == 0])) if zero else None
    schedule = draw(st.sampled_from(list(Schedule))) if pp > 1 else Schedule.ONE_F_ONE_B
    virtual = 2 if schedule is Schedule.INTERLEAVED_1F1B else 1
    kind = draw(st.sampled_from(list(CompressionKind)))
    compression = Compression(
        kind=kind,
        rank=4 if kind is CompressionKind.POWERSGD else None,
        period=4 if kind is CompressionKind.LOCAL_SGD else None,
        local_group=1 if kind is CompressionKind.LOCAL_SGD else None,
    )
    strategy = Strategy(
        dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, dp_shard=shard if shard and shard > 1 else None,
        sequence_parallel=tp > 1 and draw(st.booleans()),
        recompute=draw(st.sampled_from(list(RecomputeMode))),
        micro_batch_size=1, num_microbatches=2 * pp, schedule=schedule, virtual_stages=virtual,
        compression=compression,
    )  # fmt: skip
    training = {
        "dtype": draw(st.sampled_from([DType.BF16, DType.FP16, DType.FP8, DType.FP32])),
        "optimizer": draw(st.sampled_from(list(Optimizer))),
    }
    return strategy, training


@pytest.mark.slow  # 150 plans assembled, about 12 s
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=searchable_strategies(), text=st.sampled_from(_TARGETS))
def test_a_strategy_the_rules_allow_always_exports(case, text):
    strategy, training = case
    try:
        plan = plan_for(
            training=training, **strategy.model_dump(exclude={"schema_version", "dp_shard"}),
            dp_shard=strategy.dp_shard,
        )  # fmt: skip
        check_plan(plan)
    except SpecError:
        return  # not a plan at all (the search never emits it)
    target = parse_target(text)
    refusal = strategy_refusal(target, plan.strategy, plan.training)
    if refusal is None:
        assert export_plan(plan, target)
    else:
        with pytest.raises(ExportError, match=f"{refusal.field} = "):
            export_plan(plan, target)


_MOE_MODELS = {"mixtral-like": TINY_MIXTRAL, "deepseek-like": TINY_MLA, "shared-gqa": "tiny-moe"}


@pytest.mark.parametrize("text", _TARGETS)
@pytest.mark.parametrize(
    ("ep", "zero", "dp_shard"),
    [(1, 0, None), (8, 0, None), (4, 1, None), (2, 3, 4), (8, 3, 4), (8, 1, None)],
)
@pytest.mark.parametrize("model", _MOE_MODELS)
def test_moe_plans_the_rules_allow_export_and_the_others_are_refused(
    model, ep, zero, dp_shard, text
):
    """The same invariant for experts: model_refusal and strategy_refusal are the
    exporter's verdict (an ep the mesh cannot split is no plan at all)."""
    plan = moe_plan(_MOE_MODELS[model], dp=8, ep=ep, zero=zero, dp_shard=dp_shard)
    try:
        check_plan(plan)
    except SpecError as error:
        assert "strategy.ep(" in str(error)  # ep does not divide the expert block
        return
    target = parse_target(text)
    refusal = model_refusal(target, plan.model)
    refusal = refusal or strategy_refusal(target, plan.strategy, plan.training)
    if refusal is None:
        assert export_plan(plan, target)
    else:
        with pytest.raises(ExportError, match=re.escape(f"{refusal.field} = ")):
            export_plan(plan, target)


def test_expert_rules_name_the_field_value_and_fix():
    training = Training(global_batch_size=8)
    ddp = Strategy(dp=8, ep=8)
    refusal = strategy_refusal(parse_target("torchtitan"), ddp, training)
    assert refusal is not None and (refusal.field, refusal.value) == ("strategy.zero", 0)
    refusal = strategy_refusal(parse_target("deepspeed"), ddp.model_copy(update={"zero": 1}),
                               training)  # fmt: skip
    assert refusal is not None and (refusal.field, refusal.value) == ("strategy.ep", 8)
    assert "--ep 1" in refusal.fix
    assert strategy_refusal(parse_target("megatron"), ddp, training) is None
    shared = resolve_model("tiny-moe").spec
    refusal = model_refusal(parse_target("torchtitan"), shared)
    assert refusal is not None and refusal.field == "plan.model.num_shared_experts"
    assert torchtitan_model(TINY_MLA) == "deepseek_v3" and torchtitan_model(TINY_MIXTRAL) == "qwen3"
    top1 = TINY_MIXTRAL.model_copy(update={"top_k": 1})
    refusal = model_refusal(parse_target("megatron"), top1)
    assert refusal is not None and (refusal.field, refusal.value) == ("plan.model.top_k", 1)
    tp_beside_experts = Strategy(dp=2, tp=2, ep=2, zero=2)  # 0.2 wants SP, which EP refuses
    refusal = strategy_refusal(parse_target("torchtitan==0.2"), tp_beside_experts, training)
    assert refusal is not None and refusal.field == "strategy.sequence_parallel"
    assert "--sequence-parallel" not in refusal.fix and "tp 1" in refusal.fix


# ---- plan --for ---------------------------------------------------------------------


def _plan(model: str, gpus: int, batch: int, seq: int | None = None, **options):
    handle = resolve_model(model)
    cluster = Cluster(gpu="h100-sxm-80gb", num_gpus=gpus)
    return make_plan(handle, cluster, Training(global_batch_size=batch, seq_len=seq), **options)


@pytest.mark.parametrize("text", ["torchtitan==0.2", "torchtitan", "megatron", "deepspeed"])
def test_a_plan_for_a_framework_exports_to_it(text):
    """At 4096 tokens: DeepSpeed's plans recompute nothing and split no layer, and
    Llama-3 8B at 8192 tokens a sequence holds more than an H100 then."""
    plan = _plan("llama3-8b", 64, 256, 4096, target=text)
    target = parse_target(text)
    assert plan.target == str(target)
    assert strategy_refusal(target, plan.strategy, plan.training) is None
    assert export_plan(plan, target.framework.value)  # the plan's own release


def test_a_pin_the_target_refuses_names_the_refusal_and_its_fix():
    """torchtitan has no ZeRO-1 (its "never" reshard is ZeRO-2): the search says so and
    what to pin instead."""
    with pytest.raises(SpecError, match=r"the simplest is refused: strategy\.zero = 1: "
                       r"torchtitan has no ZeRO-1.*; re-plan with --zero 2"):  # fmt: skip
        _plan("llama3-8b", 16, 64, pins=Pins(zero=1), target="torchtitan")


def test_the_refusal_the_pins_cause_leads_however_many_others_there_are():
    """DeepSpeed refuses tp, pp and cp in hundreds of candidates, but what leaves nothing
    is the pinned MiCS shard group 0.19.8 no longer has: that refusal comes first."""
    pins = Pins(zero=3, dp_shard=8)
    with pytest.raises(
        SpecError,
        match=r"the simplest is refused: strategy\.dp_shard = 8: .*"
        r"MiCS.*target deepspeed==0\.19\.6\. Refusals by count: strategy\.tp",
    ):
        _plan("llama3-8b", 64, 256, 2048, pins=pins, target="deepspeed==0.19.8")
    # a pinned recompute DeepSpeed cannot switch on: pure data parallelism's refusal leads,
    # not a pipeline's of as many parallel dimensions (from a tester)
    with pytest.raises(
        SpecError,
        match=r"the simplest is refused: strategy\.recompute = 'full': .*--recompute none",
    ):
        _plan("tiny-llama", 4, 8, pins=Pins(recompute=RecomputeMode.FULL), target="deepspeed")


def test_a_target_whose_candidates_do_not_fit_is_told_so_with_fixes_it_runs():
    """DeepSpeed runs only data parallelism here: the search names the closest candidate
    it runs (not a cp one), memory as the cause (not its refusals), and no fix it refuses."""
    with pytest.raises(InfeasibleError) as info:
        _plan("llama3-8b", 2, 4, target="deepspeed")
    message = str(info.value)
    assert "the closest, dp2(zero3)" in message and "no candidate runs there" not in message
    assert (
        "To fit: about" in message and "full recompute (which deepspeed==0.19.8 refuses)" in message
    )


def test_the_gpus_a_no_fit_advises_are_enough():
    """'About N GPUs' is where the closest candidate, its data parallelism widened, fits:
    ZeRO-3 shards the states wider, but a gathered layer and the gradient buckets stay
    (the advice once assumed every state shrank, and each count it gave failed again)."""
    with pytest.raises(InfeasibleError) as info:
        _plan("llama3-8b", 2, 4, target="deepspeed")
    found = re.search(r"about (\d+) GPUs instead of 2 \(dp (\d+)x as wide, ", str(info.value))
    assert found is not None, str(info.value)
    gpus, wider = (int(group) for group in found.groups())
    assert gpus == 2 * wider and wider > 4
    assert _plan("llama3-8b", gpus, 4 * wider, target="deepspeed").prediction.fits


def test_this_runtime_never_plans_zero_bubble_over_resharded_stages():
    """Zero-bubble over ZeRO-3 stages trained wrong here (2.5e-2 off one process in loss
    on tiny-llama at pp 2 x dp 2; ZeRO-2 matched): refused, and the search plans around it."""
    zero3 = Strategy(dp=2, pp=2, zero=3, schedule=Schedule.ZERO_BUBBLE, num_microbatches=4)
    refusal = strategy_refusal(parse_target("planner"), zero3, Training(global_batch_size=8))
    assert refusal is not None and refusal.field == "strategy.zero" and "--zero 2" in refusal.fix
    pins = Pins(pp=2, dp=2, zero=3)
    plan = _plan("tiny-llama", 4, 8, 16, pins=pins)
    assert plan.strategy.schedule is not Schedule.ZERO_BUBBLE
    with pytest.raises(SpecError, match=r"this runtime: no candidate runs there.*--zero 2"):
        _plan("tiny-llama", 4, 8, 16, pins=replace(pins, schedule=Schedule.ZERO_BUBBLE))


@pytest.mark.parametrize(
    ("dtype", "why", "elsewhere", "model"),
    [("fp16", "no loss scaling", "deepspeed, or megatron", "llama3-8b"),
     ("fp8", "no fp8 GEMMs", "torchtitan==0.2 or megatron", "llama3-8b")],
)  # fmt: skip
def test_this_runtime_refuses_the_precisions_it_would_train_wrong(dtype, why, elsewhere, model):
    """fp16 without loss scaling underflows its gradients; fp8 would run as fp32 here. This
    runtime's plans (and plan files given to parallelize) are refused; a framework's not."""
    training = Training(global_batch_size=256, seq_len=4096, dtype=dtype)
    refusal = strategy_refusal(parse_target("planner"), Strategy(dp=2), training)
    assert refusal is not None and refusal.field == "training.dtype" and why in refusal.why
    handle, cluster = resolve_model(model), Cluster(gpu="h100-sxm-80gb", num_gpus=64)
    with pytest.raises(SpecError, match=rf"training.dtype = '{dtype}'.*--for {elsewhere}"):
        make_plan(handle, cluster, training)
    framework = elsewhere.split(" or ")[0].rstrip(",")
    assert make_plan(handle, cluster, training, target=framework).training.dtype.value == dtype


def test_megatron_target_skips_zero_bubble_and_says_what_it_cost():
    pins = Pins(pp=4, tp=2, cp=1)
    free = _plan("llama3-8b", 64, 256, pins=pins)
    kept = _plan("llama3-8b", 64, 256, pins=pins, target="megatron")
    assert kept.strategy.schedule in (Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED_1F1B)
    if free.strategy.schedule in (Schedule.ZERO_BUBBLE, Schedule.GPIPE):
        ruled_out = kept.without_target
        assert ruled_out is not None
        assert "megatron==0.16 cannot run it: strategy.schedule" in ruled_out.lost_because
        assert ruled_out.prediction.step_time_s < kept.prediction.step_time_s
    assert any("kept to megatron==0.16" in note for note in kept.solver.notes)


def test_experts_beside_sequence_parallelism_are_planned_for_megatron_only():
    """Megatron-Core routes each tp rank's sequence shard; this runtime and torchtitan
    lay MoE layers out otherwise, so their searches never offer it."""
    pins = Pins(tp=2, sequence_parallel=True, ep=4)
    plan = _plan("mixtral-8x7b", 32, 64, pins=pins, target="megatron")
    assert (plan.strategy.tp, plan.strategy.sequence_parallel, plan.strategy.ep) == (2, True, 4)
    exported = export_plan(plan, "megatron")
    assert "--sequence-parallel" in exported and "--expert-model-parallel-size 4" in exported
    runtime = r"strategy\.sequence_parallel = True: beside ep\(4\) > 1: this runtime's experts"
    with pytest.raises(SpecError, match=runtime):
        _plan("mixtral-8x7b", 32, 64, pins=pins)
    with pytest.raises(SpecError, match="torchtitan gathers the MoE layer's input over tp"):
        _plan("mixtral-8x7b", 32, 64, pins=pins, target="torchtitan==0.3")
    free = _plan("mixtral-8x7b", 32, 64, pins=Pins(tp=2, ep=4))
    assert not free.strategy.sequence_parallel


def test_torchtitan_02_builds_moe_models_as_qwen3_which_it_cannot_pipeline():
    """torchtitan 0.2's qwen3 has no pipelining_fn (train.py stops at pp > 1), 0.3's
    has one: the 0.2 search keeps pp at 1 for a model exported as qwen3, and its export
    of a pipelined plan is refused; llama3 pipelines in both."""
    pinned = Pins(pp=2, ep=8)
    with pytest.raises(SpecError, match=r"pp\(2\): torchtitan==0.2 builds this model as"):
        _plan("mixtral-8x7b", 64, 256, pins=pinned, target="torchtitan==0.2")
    kept = _plan("mixtral-8x7b", 64, 256, pins=Pins(ep=8), target="torchtitan==0.2")
    assert kept.strategy.pp == 1
    pipelined = moe_plan(TINY_MIXTRAL, dp=2, zero=2, ep=2, pp=2, num_microbatches=2)
    assert "--parallelism.pipeline_parallel_degree" in export_plan(pipelined, "torchtitan==0.3")
    with pytest.raises(ExportError, match=r"strategy\.pp = 2: torchtitan==0\.2 builds"):
        export_plan(pipelined, "torchtitan==0.2")
    dense = plan_for(dp=2, zero=2, pp=2, num_microbatches=2)
    assert "pipeline_parallel_degree = 2" in export_plan(dense, "torchtitan==0.2")


def test_traced_models_cannot_target_frameworks_with_their_own_transformer():
    handle = handle_for_module(gpt())  # a user module: no model description
    cluster = Cluster(gpu="h100-sxm-80gb", num_gpus=2)
    with pytest.raises(
        SpecError, match=re.escape("--for megatron==0.16: model = 'a traced module'")
    ):
        make_plan(handle, cluster, Training(global_batch_size=4), target="megatron")


def test_cli_for_and_export_round(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["--model", "llama3-8b", "--gpus", "64", "--global-batch", "256"]
    assert main([*args, "--for", "torchtitan==0.2", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "runs on: torchtitan==0.2" in printed
    assert main(["export", str(out), "--to", "torchtitan"]) == 0
    assert "torchtitan" in capsys.readouterr().out
    plan = load_document(Plan, out)  # 0.2 takes a TOML file
    assert "parallelism" in tomllib.loads(export_plan(plan, "torchtitan==0.2"))
    assert main(["explain", str(out)]) == 0
    assert "runs on: torchtitan==0.2" in capsys.readouterr().out
    assert main([*args, "--for", "colossal"]) == 2
    assert "--for = 'colossal': unknown framework" in capsys.readouterr().err


def test_torchtitan_builds_llama_style_decoders_and_picks_the_one_like_the_model() -> None:
    """torchtitan's models are llama3, qwen3 and deepseek_v3: an encoder or a GPT (LayerNorm,
    GELU, learned positions, biases) is refused up front with the targets that build it;
    per-head q/k norms, a head dim other than hidden / heads or a tied head make it qwen3,
    whose flavor has them, not llama3, whose has none."""
    for preset, family in (("bert-base", "encoder"), ("tiny-gpt", "gpt")):
        refusal = model_refusal(parse_target("torchtitan"), get_preset(preset))
        assert refusal is not None and (refusal.field, refusal.value) == (
            "plan.model.family",
            family,
        )
        assert "target megatron (decoders), deepspeed or planner" in refusal.fix
    llama = get_preset("tiny-llama")
    assert torchtitan_model(llama) == "llama3"
    for change in ({"qk_norm": True}, {"head_dim": 32}, {"tied_embeddings": True}):
        assert torchtitan_model(llama.model_copy(update=change)) == "qwen3", change
    assert (
        model_refusal(parse_target("torchtitan"), llama.model_copy(update={"qk_norm": True}))
        is None
    )


@pytest.mark.slow  # the two flagship searches, about 6 s each
@pytest.mark.parametrize(
    ("model", "gpu", "gpus", "batch", "text"),
    [
        ("gpt3-175b", "a100-sxm-80gb", 1024, 1536, "megatron"),
        ("llama3-70b", "a100-sxm-80gb", 1024, 1536, "torchtitan"),
        ("llama3.1-405b", "h100-sxm-80gb", 16384, 2048, "torchtitan"),
        ("llama3.1-405b", "h100-sxm-80gb", 16384, 2048, "megatron"),
    ],
)
def test_flagship_plans_for_a_framework_export(model, gpu, gpus, batch, text):
    cluster = Cluster(gpu=gpu, num_gpus=gpus)
    plan = make_plan(resolve_model(model), cluster, Training(global_batch_size=batch), target=text)
    exported = export_plan(plan, text)
    if text == "megatron":
        assert "--tensor-model-parallel-size" in shlex.split(exported, comments=True)
    else:  # torchtitan 0.3: command-line overrides (0.2's TOML: test_cli_for_and_export_round)
        assert "--parallelism.tensor_parallel_degree" in exported


# ---- near ties and headroom ---------------------------------------------------------


def _scored(step_s: float, peak_gib: float, **fields) -> Scored:
    prediction = Prediction(
        step_time_s=step_s, tokens_per_s_per_gpu=1.0, model_tflops_per_gpu=1.0, mfu=0.5,
        hfu=0.5, flop_convention="", peak_memory_gib=peak_gib, memory_limit_gib=80.0, fits=True,
    )  # fmt: skip
    return Scored(Strategy(**fields), prediction)


def test_near_ties_prefer_fewer_dimensions_then_free_memory():
    fastest = _scored(10.0, 78.0, dp=4, tp=2, pp=2)
    fewer_dims = _scored(10.05, 70.0, dp=8, tp=2)
    roomier = _scored(10.08, 40.0, dp=8, tp=2)
    far = _scored(10.5, 10.0, dp=16)
    ranked = [fastest, fewer_dims, roomier, far]
    assert fastest.strategy.parallel_dimensions == 3
    assert preferred(ranked, 0.01) is roomier  # 2 dims, most free memory within 1%
    assert preferred(ranked, 0.0) is fastest
    assert preferred(ranked, 0.06) is far  # one dimension
    with pytest.raises(SpecError, match=re.escape("tolerance = 1.5")):
        preferred(ranked, 1.5)


def test_headroom_parses_gib_and_shares():
    assert Headroom.parse("8").gib_of(80) == 8
    assert Headroom.parse("8GiB").gib_of(80) == 8
    assert Headroom.parse("10%").gib_of(80) == pytest.approx(8)
    with pytest.raises(SpecError, match="--memory-headroom = 'lots'"):
        Headroom.parse("lots")
    with pytest.raises(SpecError, match="below 100%"):
        Headroom.parse("100%")


def test_a_plan_keeps_its_headroom_free():
    base = _plan("llama3-8b", 8, 64)
    reserve = base.prediction.memory_limit_gib - base.prediction.peak_memory_gib + 10
    roomy = _plan("llama3-8b", 8, 64, headroom=Headroom(gib=reserve))
    free = roomy.prediction.memory_limit_gib - roomy.prediction.peak_memory_gib
    assert free >= reserve
    assert any("memory headroom" in note for note in roomy.solver.notes)


def test_a_headroom_that_leaves_no_fit_is_named_in_the_advice():
    """The headroom is what the plan may not use: a headroom as large as the GPU is
    refused naming the option, and a no-fit counts only what it leaves (the advice's GPU
    count too, which was priced against the whole GPU and never fit)."""
    with pytest.raises(SpecError, match=r"headroom = 200 GiB per GPU leaves nothing of a h100"):
        _plan("llama3-8b", 8, 64, headroom=Headroom(gib=200))
    with pytest.raises(InfeasibleError) as refused:
        _plan("llama3-70b", 8, 64, headroom=Headroom(gib=20))
    message = str(refused.value)
    assert "has 79 GiB, 59 with 20 GiB kept free (--memory-headroom)" in message
    gpus = int(re.search(r"about (\d+) GPUs instead of 8", message).group(1))  # type: ignore[union-attr]
    wider = _plan("llama3-70b", gpus, 64, headroom=Headroom(gib=20))
    assert wider.prediction.peak_memory_gib <= wider.prediction.memory_limit_gib - 20


def test_every_framework_has_rules_and_releases():
    for framework in Framework:
        assert str(parse_target(framework.value)).startswith(framework.value)
    assert json.dumps([str(parse_target(f.value)) for f in Framework])


# ---- plan --from: the job of a config the user has ----------------------------------


def test_plan_from_a_megatron_config_prices_it_and_says_what_differs(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    args = tmp_path / "megatron.args"
    pins = ["--tp", "2", "--pp", "2", "--schedule", "1f1b", "--recompute", "full"]
    assert main(["--model", "llama3-8b", "--gpus", "64", "--global-batch", "256", *pins,
                 "-o", str(plan)]) == 0  # fmt: skip
    assert main(["export", str(plan), "--to", "megatron", "-o", str(args)]) == 0
    capsys.readouterr()
    assert main(["--from", str(args), "--gpus", "64", "-o", str(tmp_path / "new.json")]) == 0
    captured = capsys.readouterr()
    assert "read " in captured.err and "as megatron" in captured.err
    out = " ".join(captured.out.split())
    assert "your config (" in out and "dp16(zero2) tp2 sp pp2 1f1b mb1x16 recompute=full" in out
    assert "planned (for megatron==0.16)" in out and "x faster" in out
    assert "what differs: " in out
    new = json.loads((tmp_path / "new.json").read_text())
    assert new["target"] == "megatron==0.16"
    assert new["training"]["global_batch_size"] == 256


def test_plan_from_refuses_training_options_and_needs_a_batch_otherwise(tmp_path, capsys):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 1,
                                  "zero_optimization": {"stage": 3}}))  # fmt: skip
    assert main(["--from", str(config), "--model", "llama3-8b", "--dtype", "fp8"]) == 2
    assert "--dtype with --from: the config sets the model and training" in capsys.readouterr().err
    # a DeepSpeed config states no sequence length: --seq gives it (from a tester)
    out = tmp_path / "seq.json"
    argv = [
        "--from",
        str(config),
        "--model",
        "tiny-llama",
        "--gpus",
        "8",
        "--seq",
        "64",
        "-o",
        str(out),
    ]
    assert main(argv) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert json.loads(out.read_text())["training"]["seq_len"] == 64
    # the config's own run is priced at that length too, as plan estimate --from prices it
    estimate = ["estimate", "--from", str(config), "--model", "tiny-llama", "--gpus", "8"]
    assert main([*estimate, "--seq", "64", "--json"]) == 0
    step = json.loads(capsys.readouterr().out)["step_time_s"]
    assert f"recompute=none: {step:.3f} s/step" in printed
    assert main(["--model", "llama3-8b", "--gpus", "8"]) == 2
    assert "--global-batch is required" in capsys.readouterr().err
    assert main(["--model", "llama3-8b", "--gpus", "8", "--global-batch", "8",
                 "--format", "megatron"]) == 2  # fmt: skip
    assert "--format only applies with --from" in capsys.readouterr().err


def test_embedding_and_head_get_chunks_of_their_own_only_where_the_target_runs_them():
    """tiny-llama's 4 blocks in pp 2 x vp 3 = 6 chunks: the embedding and the head alone,
    as Megatron-LM's accounted split and torchtitan's own default make them. This
    runtime starts and ends each stage at a block: its search never offers them, and it
    refuses such a plan before it cuts the model."""
    from tests.test_importers import round_trip

    pins = Pins(pp=2, virtual_stages=3)
    for target in ("megatron", "torchtitan"):
        plan = _plan("tiny-llama", 8, 16, pins=pins, target=target)
        assert plan.stages[0] == ("tok_embeddings",) and plan.stages[-1] == ("norm", "output")
        assert [len(chunk) for chunk in plan.stages[1:-1]] == [1, 1, 1, 1]
        assert plan.prediction.step_time_s > 0
        assert round_trip(plan, target).run.stages == plan.stages
    exported = export_plan(_plan("tiny-llama", 8, 16, pins=pins, target="megatron"), "megatron")
    assert "--pipeline-model-parallel-layout E|t|t|t|t|L" in exported
    runtime = "this runtime starts and ends each pipeline stage at a transformer block"
    with pytest.raises(SpecError, match=r"pp\(2\) \* virtual_stages\(3\) chunks > the model's 4"):
        _plan("tiny-llama", 8, 16, pins=pins)
    bare = r"plan.stages\[0\] = \['tok_embeddings'\] holds none of .* 4 blocks: " + runtime
    with pytest.raises(SpecError, match=bare):
        check_model_against_plan(plan, resolve_model("tiny-llama").module)
