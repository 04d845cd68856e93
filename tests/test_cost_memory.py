"""Memory: model states under ZeRO 0-3, Korthikanti activations, in-flight micro-batches."""

import pytest

from planner.cost import CostModel, CostOptions, graph_from_spec
from planner.cost.memory import in_flight_microbatches, model_state_bytes
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
    states = model_state_bytes(1e9, zero=zero, shard=8, optimizer=Optimizer.ADAMW, dtype=DType.BF16)
    assert (states.weights, states.gradients, states.optimizer) == pytest.approx(
        tuple(1e9 * b for b in per_param)
    )


def test_megatron_18_bytes_and_fp32_has_no_master():
    mixed = model_state_bytes(1.0, zero=0, shard=1, optimizer=Optimizer.ADAM, dtype=DType.BF16)
    assert mixed.total == 18
    fp32 = model_state_bytes(1.0, zero=0, shard=1, optimizer=Optimizer.SGD, dtype=DType.FP32)
    assert (fp32.weights, fp32.gradients, fp32.optimizer) == (4, 4, 4)


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
    assert in_flight_microbatches(Schedule.ZERO_BUBBLE, rank=1, **kw) == 3
    interleaved = in_flight_microbatches(Schedule.INTERLEAVED_1F1B, rank=0, virtual_stages=2, **kw)
    assert interleaved == pytest.approx(4 * (1 + 3 / (4 * 2)))  # p (1 + (p-1)/(p v))
    few = in_flight_microbatches(Schedule.ONE_F_ONE_B, pp=4, rank=0, num_microbatches=2)
    assert few == 2
