"""Memory: model states under ZeRO 0-3, Korthikanti activations, in-flight micro-batches."""

import pytest

from planner.cost import CostModel, CostOptions, graph_from_spec
from planner.cost.memory import (
    in_flight_microbatches,
    model_state_bytes,
    pending_weight_gradients,
)
from planner.graph import OpKind
from planner.spec import (
    Cluster,
    DType,
    Family,
    ModelSpec,
    Optimizer,
    RecomputeMode,
    Schedule,
    Strategy,
    Training,
)  # fmt: skip

S, H, A = 32, 64, 4  # sequence, hidden, heads: 5 a s / h = 10
GPT = ModelSpec(
    family=Family.GPT, num_layers=2, hidden_size=H, num_heads=A, vocab_size=128, seq_len=S
)


@pytest.mark.parametrize(
    ("zero", "per_param"),
    [(0, (2, 4, 12)), (1, (2, 4, 12 / 8)), (2, (2, 4 / 8, 12 / 8)), (3, (4 / 8, 4 / 8, 8 / 8))],
)
def test_model_states_per_zero_stage(zero, per_param):
    training = Training(global_batch_size=1, optimizer=Optimizer.ADAMW, dtype=DType.BF16)
    states = model_state_bytes(
        1e9, zero=zero, shard=8, training=training, gradient_bytes=training.state_bytes
    )
    assert (states.weights, states.gradients, states.optimizer) == pytest.approx(
        tuple(1e9 * b for b in per_param)
    )


def test_megatron_18_bytes_and_fp32_has_no_master():
    adam = Training(global_batch_size=1, optimizer=Optimizer.ADAM, dtype=DType.BF16)
    assert model_state_bytes(1.0, zero=0, shard=1, training=adam, gradient_bytes=4).total == 18
    # Megatron's main_grad buffer in bf16 (--grad-reduce-in-bf16): 16 bytes
    assert model_state_bytes(1.0, zero=0, shard=1, training=adam, gradient_bytes=2).total == 16
    sgd = Training(global_batch_size=1, optimizer=Optimizer.SGD, dtype=DType.FP32)
    fp32 = model_state_bytes(1.0, zero=0, shard=1, training=sgd, gradient_bytes=4)
    assert (fp32.weights, fp32.gradients, fp32.optimizer) == (4, 4, 4)


@pytest.mark.parametrize(
    ("zero", "per_param"), [(0, (2, 2, 4)), (2, (2, 2 / 8, 6 / 8)), (3, (2 / 8, 2 / 8, 4 / 8))]
)
def test_pure_bf16_keeps_every_state_in_two_bytes_and_no_master(zero, per_param):
    """torchtitan's training.dtype = "bfloat16": 8 bytes per parameter with Adam; under
    ZeRO-2 the shard the optimizer updates sits beside the gathered weights (FSDP2's
    sharded parameters, with the moments)."""
    pure = Training(global_batch_size=1, dtype=DType.BF16, param_dtype=DType.BF16)
    states = model_state_bytes(1.0, zero=zero, shard=8, training=pure, gradient_bytes=2)
    assert (states.weights, states.gradients, states.optimizer) == pytest.approx(per_param)


def _block_activation(tp: int, sp: bool, mode: RecomputeMode, mbs: int = 2) -> float:
    graph = graph_from_spec(GPT, dropout=True)
    options = CostOptions(attention="unfused", dropout=True)
    cluster = Cluster(gpu="a100-sxm-80gb", num_gpus=tp)
    model = CostModel(graph, cluster, Training(global_batch_size=mbs), options=options)
    strategy = Strategy(tp=tp, sequence_parallel=sp, recompute=mode, micro_batch_size=mbs)
    costs = model.segment_costs(strategy)
    return next(c for c in costs if c.kind == "block").activation_bytes


@pytest.mark.parametrize("mbs", [1, 2])
def test_korthikanti_no_parallelism(mbs):
    sbh = S * mbs * H
    assert _block_activation(1, False, RecomputeMode.NONE, mbs) == pytest.approx(sbh * (34 + 10))


@pytest.mark.parametrize("tp", [2, 4])
def test_korthikanti_tensor_parallel(tp):
    sbh = S * 2 * H
    expected = sbh * (10 + 24 / tp + 10 / tp)
    assert _block_activation(tp, False, RecomputeMode.NONE) == pytest.approx(expected)


def test_korthikanti_sequence_parallel_and_selective():
    sbh, t = S * 2 * H, 4
    assert _block_activation(t, True, RecomputeMode.NONE) == pytest.approx(sbh / t * (34 + 10))
    assert _block_activation(t, True, RecomputeMode.SELECTIVE) == pytest.approx(sbh / t * 34)
    assert _block_activation(t, False, RecomputeMode.SELECTIVE) == pytest.approx(
        sbh * (10 + 24 / t)
    )


def test_full_recompute_keeps_the_block_input():
    sbh = S * 2 * H
    assert _block_activation(1, False, RecomputeMode.FULL) == pytest.approx(2 * sbh)
    assert _block_activation(4, True, RecomputeMode.FULL) == pytest.approx(2 * sbh / 4)


def test_in_flight_microbatches_per_schedule():
    kw = {"pp": 4, "num_microbatches": 8}
    assert in_flight_microbatches(Schedule.GPIPE, rank=0, **kw) == 8
    assert in_flight_microbatches(Schedule.ONE_F_ONE_B, rank=0, **kw) == 4
    assert in_flight_microbatches(Schedule.ONE_F_ONE_B, rank=3, **kw) == 1
    assert in_flight_microbatches(Schedule.ZERO_BUBBLE, rank=1, **kw) == 4  # torch's ZB1P
    interleaved = in_flight_microbatches(Schedule.INTERLEAVED_1F1B, rank=0, virtual_stages=2, **kw)
    assert interleaved == pytest.approx(4 * (1 + 3 / (4 * 2)))  # p (1 + (p-1)/(p v))
    few = in_flight_microbatches(Schedule.ONE_F_ONE_B, pp=4, rank=0, num_microbatches=2)
    assert few == 2


@pytest.mark.parametrize(
    ("pp", "virtual", "microbatches"),
    [(2, 1, 1), (2, 1, 2), (2, 1, 4), (4, 1, 4), (4, 1, 8), (4, 1, 16), (2, 2, 4), (4, 2, 8)],
)
def test_zero_bubble_holds_what_torchs_order_holds(pp, virtual, microbatches):
    """torch's zero-bubble order (``ScheduleInterleavedZeroBubble``): on each rank the
    most chunk-micro-batches whose weight gradient is still to come (activations kept)
    and whose input gradient ran before it (output gradients kept) are what the memory
    model charges."""
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

    schedule = ScheduleInterleavedZeroBubble.__new__(ScheduleInterleavedZeroBubble)
    schedule.pp_group_size, schedule.n_local_stages = pp, virtual
    schedule._n_microbatches = microbatches
    schedule.number_of_rounds = max(1, microbatches // pp)
    schedule.microbatches_per_round = microbatches // schedule.number_of_rounds
    schedule.stage_index_to_group_rank = {i: i % pp for i in range(pp * virtual)}
    for rank in range(pp):
        held, pending, most_held, most_pending = set(), set(), 0, 0
        for action in filter(None, schedule._calculate_single_rank_operations(rank)):
            key = (action.stage_index, action.microbatch_index)
            kind = action.computation_type.name
            if kind == "FORWARD":
                held.add(key)
            elif kind == "BACKWARD_INPUT":
                pending.add(key)
            elif kind == "BACKWARD_WEIGHT":
                held.discard(key)
                pending.discard(key)
            most_held, most_pending = max(most_held, len(held)), max(most_pending, len(pending))
        kw = {"pp": pp, "rank": rank, "num_microbatches": microbatches, "virtual_stages": virtual}
        assert in_flight_microbatches(Schedule.ZERO_BUBBLE, **kw) == most_held / virtual
        assert pending_weight_gradients(Schedule.ZERO_BUBBLE, **kw) == most_pending / virtual
        assert pending_weight_gradients(Schedule.ONE_F_ONE_B, **kw) == 0


# ----- invariants (issue #16): more sharding or recompute never holds more -------------


def _preset_model(name: str, gpus: int, batch: int, seq: int, **options) -> CostModel:
    from planner.cost.build import build_cost_model, spec_graph
    from planner.presets import get_preset

    spec = get_preset(name).with_seq_len(seq)
    training = Training(global_batch_size=batch)
    graph = spec_graph(spec, training)
    cluster = Cluster(gpu="h100-sxm-80gb", num_gpus=gpus)
    return build_cost_model(
        graph, cluster, training, causal=spec.causal, options=CostOptions(**options)
    )


def test_zero3_under_a_pipeline_holds_what_zero2_holds():
    """llama3-8b at 2k tokens, dp8 x pp2 on 16 H100s: ZeRO-3 was priced at 62.1 GiB
    against ZeRO-2's 45.7. Under a pipeline FSDP2 keeps each stage's weights gathered and
    its gradients unsharded until the last micro-batch, whatever the stage: 1, 2 and 3
    hold the same, and the prediction says why."""
    model = _preset_model("llama3-8b", 16, 32, 2048)
    base = {"dp": 8, "pp": 2, "micro_batch_size": 2, "num_microbatches": 2}
    peaks = {z: model.estimate(Strategy(zero=z, **base)) for z in (0, 1, 2, 3)}
    assert peaks[1].peak_memory_gib == peaks[2].peak_memory_gib == peaks[3].peak_memory_gib
    assert peaks[1].peak_memory_gib < peaks[0].peak_memory_gib
    assert peaks[2].step_time_s == peaks[3].step_time_s
    assert "gathered" in peaks[3].reason and peaks[3].fits
    gradients = peaks[3].memory_gib["gradients"] / 1.1  # fp32, unsharded, per stage
    assert gradients > 4 * 8.0e9 / 2 / 2**30 * 0.9
    flat = model.estimate(Strategy(dp=16, zero=3, micro_batch_size=2, num_microbatches=1))
    assert "gathered" not in flat.reason


def test_full_recompute_never_holds_more_than_none():
    """llama2-7b at 2k tokens over 32 pipeline stages (one block each), one micro-batch:
    full recompute counted the block's input twice (kept, and again in the recomputed
    activations) and came out above no recompute (7.85 GiB against 7.83)."""
    model = _preset_model("llama2-7b", 32, 1, 2048)
    base = {"pp": 32, "schedule": "gpipe"}
    none, selective, full = (
        model.estimate(Strategy(recompute=mode, **base)).peak_memory_gib
        for mode in (RecomputeMode.NONE, RecomputeMode.SELECTIVE, RecomputeMode.FULL)
    )
    assert full <= selective <= none


def test_selective_recompute_holds_the_recomputed_scores_again_in_backward():
    """Unfused attention: selective recompute drops the scores from what a block keeps,
    but re-creates them for its backward: one block's scores are back at the peak."""
    graph = graph_from_spec(GPT)
    options = CostOptions(attention="unfused")
    model = CostModel(graph, Cluster(gpu="a100-sxm-80gb", num_gpus=1), Training(global_batch_size=1),
                      options=options)  # fmt: skip
    none, selective = (
        next(c for c in model.segment_costs(Strategy(recompute=mode)) if c.kind == "block")
        for mode in (RecomputeMode.NONE, RecomputeMode.SELECTIVE)
    )
    assert selective.activation_bytes < none.activation_bytes
    assert selective.recompute_peak_bytes == pytest.approx(
        none.activation_bytes - selective.activation_bytes
    )


@pytest.mark.parametrize(("layers", "hidden"), [(2, 64), (8, 2048)], ids=["small", "1.3b-wide"])
def test_gradient_buckets_hold_at_most_the_gradients(layers, hidden):
    """DeepSpeed's separate buckets: two in flight, but a model whose gradients fit in
    less holds less. PyTorch DDP reduces the gradients in place (they are its buckets)."""
    spec = GPT.model_copy(update={"num_layers": layers, "hidden_size": hidden, "num_heads": 16})
    cluster = Cluster(gpu="a100-sxm-80gb", num_gpus=2)
    training = Training(global_batch_size=2, dtype=DType.FP32)
    memories = {}
    for separate in (True, False):
        options = CostOptions(
            workspace_gib=0.0, allocator_margin=0.0, separate_grad_buckets=separate
        )
        model = CostModel(graph_from_spec(spec), cluster, training, options=options)
        memories[separate] = model.estimate(Strategy(dp=2, micro_batch_size=1)).memory_gib
    memory = memories[True]
    two_buckets = 2 * CostOptions().dp_bucket_bytes / 2**30
    assert memory["buffers"] == pytest.approx(min(two_buckets, memory["gradients"]))
    assert (memory["buffers"] < two_buckets) == (layers == 2)
    assert memories[False]["buffers"] == 0.0
    assert memories[False]["gradients"] == memory["gradients"]  # DDP's buckets: kept


def test_a_step_of_one_micro_batch_starts_its_backward_without_gradients():
    """PyTorch's optimizers free every .grad at zero_grad: one micro-batch's backward
    starts holding only those of the modules being computed (measured on this runtime's
    TP plans: the peak is at the loss's backward, before any gradient); frameworks that
    keep them in buffers (Megatron-Core, DeepSpeed) and DDP (its buckets) hold them all,
    as does every micro-batch after the first."""
    cluster = Cluster(gpu="a100-sxm-80gb", num_gpus=2)
    training = Training(global_batch_size=8, dtype=DType.FP32)
    deep = GPT.model_copy(update={"num_layers": 12})

    def gradients(strategy: Strategy, **options: bool) -> float:
        costs = CostOptions(workspace_gib=0.0, allocator_margin=0.0, **options)
        model = CostModel(graph_from_spec(deep), cluster, training, options=costs)
        return model.estimate(strategy).memory_gib["gradients"]

    tp = Strategy(tp=2, micro_batch_size=8)
    accumulated = Strategy(tp=2, micro_batch_size=2, num_microbatches=4)
    whole = gradients(tp, grads_persist=True)
    assert gradients(tp) < whole / 2
    assert gradients(accumulated) == pytest.approx(whole)
    ddp = Strategy(dp=2, micro_batch_size=4)
    assert gradients(ddp) == pytest.approx(gradients(ddp, grads_persist=True))


def test_this_runtimes_selective_recompute_keeps_its_input_and_every_matmul_output():
    """strategies.checkpointing saves what matrix products return and recomputes the
    rest, attention included: the H200 run of benchmarks/data/h200 held 58 GiB for
    Llama-3.2 1B at 4x4096 tokens, against 78 GiB without recompute (the attention-core
    policy priced 69 GiB, the memory of no recompute under flash attention)."""
    graph = graph_from_spec(GPT)
    cluster, training = Cluster(gpu="a100-sxm-80gb", num_gpus=1), Training(global_batch_size=1)
    model = CostModel(graph, cluster, training, options=CostOptions(selective="matmuls"))
    none, selective = (
        next(c for c in model.segment_costs(Strategy(recompute=mode)) if c.kind == "block")
        for mode in (RecomputeMode.NONE, RecomputeMode.SELECTIVE)
    )
    nodes = next(graph.segment_type(s) for s in graph.segments if s.type_id == "block").nodes
    matmuls = [n for n in nodes if n.kind is OpKind.MATMUL]
    assert selective.activation_bytes == pytest.approx(
        nodes[0].input_bytes + sum(n.bytes_written for n in matmuls)
    )
    attention = next(n for n in nodes if n.kind is OpKind.ATTENTION)
    assert selective.recompute_s > model.compute.node_time(attention, 1.0).forward_s
    assert none.recompute_s == 0


@pytest.mark.parametrize(("fused", "per_logit"), [(False, 4 + 4 + 4), (True, 4 + 2 + 4)])
def test_the_loss_holds_its_fp32_gradients_beside_the_kept_log_probabilities(fused, per_logit):
    """bf16 logits. Eager ``F.cross_entropy(logits.float())`` starts its backward holding
    the kept fp32 log-probabilities and two fp32 gradients (nll_loss's, log_softmax's):
    12 bytes a logit (the H200 runs of benchmarks/data/h200 grew 14.2 GiB a sequence, 2.3
    more than 10 bytes priced). A compiled loss (torchtitan's runs): the logits and one."""
    options = CostOptions(
        fused_pointwise=fused, workspace_gib=0.0, allocator_margin=0.0, grads_persist=True,
        optimizer_impl="fused",  # no step temporaries to outgrow the backward's start
    )  # fmt: skip
    cluster, training = Cluster(gpu="a100-sxm-80gb", num_gpus=1), Training(global_batch_size=1)
    model = CostModel(graph_from_spec(GPT), cluster, training, options=options)
    logits = model.estimate(Strategy(micro_batch_size=1)).memory_gib["logits"]
    assert logits * 2**30 == pytest.approx(S * GPT.vocab_size * per_logit)


def test_the_optimizer_step_holds_its_implementations_temporaries():
    """llama3-8b on 64 H100s, ZeRO-1 with full recompute: the peak is the optimizer
    step's (every gradient, no activation). foreach AdamW adds an fp32 denominator for
    each element it updates, the for-loop one for the largest tensor, twice; fused none."""
    base = Strategy(dp=64, zero=1, recompute="full", micro_batch_size=1)
    peaks = {
        impl: _preset_model(
            "llama3-8b", 64, 64, 1024, optimizer_impl=impl, allocator_margin=0.0
        ).estimate(base).memory_gib
        for impl in ("fused", "foreach", "for-loop")
    }  # fmt: skip
    assert all(peak["activations"] == 0.0 for peak in peaks.values())
    fused = peaks["fused"]["optimizer"]
    updated = 8.03e9 / 64  # every parameter, in its optimizer shard
    assert peaks["foreach"]["optimizer"] - fused == pytest.approx(4 * updated / 2**30, rel=0.01)
    embedding = 128256 * 4096 / 64  # the largest weight, in its optimizer shard
    assert peaks["for-loop"]["optimizer"] - fused == pytest.approx(2 * 4 * embedding / 2**30)
