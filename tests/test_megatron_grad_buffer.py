"""Megatron-Core keeps gradients in its main_grad buffer in the reduction's dtype.

Under ``--grad-reduce-in-bf16`` (Megatron-Bridge's perf recipes: ``grad_reduce_in_fp32 =
False``) the buffer is bf16, for dense and expert parameters alike, and nothing is cast
before the reduction. PyTorch DDP and FSDP2 keep each ``.grad`` in the fp32 parameters'
dtype whatever the reduction's. Expert gradients under EP are reduced uncompressed by
this planner's runtime (torchtitan reduces in fp32 only).
"""

import pytest

from planner.cost import CostModel, CostOptions
from planner.cost.build import spec_graph
from planner.cost.memory import gradient_element_bytes
from planner.errors import ExportError
from planner.export import export_plan
from planner.frameworks import KERNELS, Framework, parse_target, strategy_refusal
from planner.importers import import_config
from planner.presets import get_preset
from planner.spec import Cluster, Compression, CompressionKind, DType, Strategy, Training
from tests.test_importers import moe_plan

MEGATRON = CostOptions(**KERNELS[Framework.MEGATRON])
BF16 = Compression(kind=CompressionKind.BF16)
TRAINING = Training(global_batch_size=8)


def _prediction(options: CostOptions, **strategy):
    spec = get_preset("tiny-moe")
    model = CostModel(
        spec_graph(spec, TRAINING, options), Cluster(gpu="h100-sxm-80gb", num_gpus=8), TRAINING,
        options=options,
    )  # fmt: skip
    return model.estimate(Strategy(micro_batch_size=1, **strategy))


@pytest.mark.parametrize(
    ("options", "kind", "bytes_"),
    [
        (CostOptions(), CompressionKind.NONE, 4),
        (CostOptions(), CompressionKind.BF16, 4),  # DDP hook / FSDP2 reduce dtype: .grad fp32
        (MEGATRON, CompressionKind.NONE, 4),  # grad_reduce_in_fp32: an fp32 main_grad
        (MEGATRON, CompressionKind.BF16, 2),
        (MEGATRON, CompressionKind.FP16, 2),
    ],
)
def test_gradient_bytes_follow_the_buffer_the_framework_keeps(options, kind, bytes_):
    assert gradient_element_bytes(TRAINING, options, kind) == bytes_


def test_pure_bf16_keeps_two_byte_gradients_whatever_the_reduction():
    pure = Training(global_batch_size=16, param_dtype=DType.BF16)
    assert gradient_element_bytes(pure, CostOptions(), CompressionKind.NONE) == 2


@pytest.mark.parametrize("strategy", [{"dp": 8, "zero": 1}, {"dp": 4, "pp": 2, "zero": 1,
                                      "num_microbatches": 2}])  # fmt: skip
def test_megatron_bf16_reduction_halves_the_gradient_memory(strategy):
    fp32 = _prediction(MEGATRON, **strategy)
    bf16 = _prediction(MEGATRON, compression=BF16, **strategy)
    eager = _prediction(CostOptions(**{**KERNELS[Framework.MEGATRON],
                                       "grads_in_reduce_dtype": False}),
                        compression=BF16, **strategy)  # fmt: skip
    assert bf16.memory_gib["gradients"] == pytest.approx(fp32.memory_gib["gradients"] / 2)
    assert eager.memory_gib["gradients"] == pytest.approx(fp32.memory_gib["gradients"])
    # the buffer is already bf16: no cast before the reduction
    assert bf16.breakdown_s.get("compression", 0.0) == 0.0 < eager.breakdown_s["compression"]


def test_megatron_reduces_expert_gradients_in_bf16_and_prices_them():
    ep = _prediction(MEGATRON, dp=8, ep=4, zero=1, compression=BF16)
    plain = _prediction(MEGATRON, dp=8, ep=4, zero=1)
    assert ep.memory_gib["gradients"] == pytest.approx(plain.memory_gib["gradients"] / 2)
    strategy = Strategy(dp=8, ep=4, zero=1, compression=BF16)
    assert strategy_refusal(parse_target("megatron"), strategy, TRAINING) is None


def test_this_runtime_refuses_compressed_expert_gradients_naming_the_field():
    strategy = Strategy(dp=8, ep=4, zero=1, compression=BF16)
    refusal = strategy_refusal(parse_target("planner"), strategy, TRAINING)
    assert refusal is not None and refusal.field == "strategy.compression.kind"
    assert "target megatron" in refusal.fix


def test_an_ep_plan_reduced_in_bf16_comes_back_from_megatron():
    from tests.test_importers import TINY_MIXTRAL

    plan = moe_plan(TINY_MIXTRAL, dp=8, ep=8, zero=1, compression=BF16)
    text = export_plan(plan, "megatron")
    assert "--grad-reduce-in-bf16" in text
    run = import_config(text, model=None, cluster=plan.cluster).run
    assert run.strategy.compression.kind is CompressionKind.BF16 and run.strategy.ep == 8
    assert run.options.grads_in_reduce_dtype


def test_torchtitan_export_refuses_the_bf16_reduction():
    from tests.test_importers import TINY_MIXTRAL

    plan = moe_plan(TINY_MIXTRAL, dp=8, ep=8, zero=2, compression=BF16)
    with pytest.raises(ExportError, match=r"strategy\.compression\.kind"):
        export_plan(plan, "torchtitan")


@pytest.mark.parametrize(("target", "compressed"), [("planner", False), ("megatron", True)])
def test_the_search_offers_bf16_expert_reductions_only_where_they_run(target, compressed):
    from planner.solve.lossy import LossyCompression
    from planner.solve.search import ModelLimits, Pins, search

    spec = get_preset("tiny-moe")
    options = MEGATRON if target == "megatron" else CostOptions()
    model = CostModel(
        spec_graph(spec, TRAINING, options), Cluster(gpu="h100-sxm-80gb", num_gpus=8), TRAINING,
        options=options,
    )  # fmt: skip
    limits = ModelLimits(
        num_blocks=spec.num_layers, seq_len=spec.seq_len, num_heads=spec.num_heads,
        num_kv_heads=spec.kv_heads, vocab_size=spec.vocab_size,
        num_experts=model.graph.num_experts,
    )  # fmt: skip
    result = search(
        model, limits, pins=Pins(ep=4, tp=1, pp=1), top_k=50,
        lossy=LossyCompression.parse("bf16"), target=parse_target(target),
    )  # fmt: skip
    kinds = {c.strategy.compression.kind for c in result.ranked}
    assert (CompressionKind.BF16 in kinds) is compressed
