"""What autograd keeps for backward in a zoo block is what the formula graph prices.

Counted on the CPU in the three ways the runtime trains (``benchmarks/
bench_saved_activations.py``): fp32; bf16 weights under autocast (FSDP2); fp32 weights
under autocast (no sharding), where the zoo model keeps its hidden state in bf16 and its
norms hand the projections one bf16 output, so that autocast's per-projection casts of
an fp32 input are not kept for backward.
"""

import pytest
from benchmark_modules import load_benchmark

from planner.models import build

bench = load_benchmark("bench_saved_activations")


@pytest.mark.parametrize("preset", ["llama3.2-1b", "gpt3-1.3b"])
@pytest.mark.parametrize("mode", list(bench.MODES))
def test_a_zoo_block_keeps_what_the_formula_graph_prices(preset, mode):
    spec = bench.small_spec(preset)
    measured, block_input = bench.saved_by_block(build(spec, device="cpu", seed=0), mode)
    # what the formula leaves out: norm statistics and the attention's log-sum-exp
    assert measured == pytest.approx(bench.zoo_priced(spec, mode), rel=0.01)
    assert block_input.itemsize == bench.training_dtype(mode).activation_bytes


def test_a_hugging_face_block_under_autocast_keeps_more_than_its_trace_prices():
    """Known and documented (README, "Measured on one H200"): beside fp32 weights, Hugging
    Face's RMSNorm returns fp32 and each projection keeps its own bf16 cast of it."""
    pytest.importorskip("transformers")
    fp32_weights, bf16_weights = (
        bench.saved_by_block(bench.hf_llama(), mode, "model.layers.1")[0]
        for mode in ("fp32 weights, autocast", "bf16 weights, autocast")
    )  # fmt: skip
    assert fp32_weights > 1.1 * bf16_weights


@pytest.mark.parametrize("mode", ["fp32", "bf16 weights, autocast"])
def test_a_fused_projection_split_three_ways_is_priced_whole(mode):
    """nanoGPT's ``c_attn`` output, split into q, k and v views that attention saves,
    stays alive whole: the trace charges its base, not one view."""
    model = bench.nanogpt()
    measured, _ = bench.saved_by_block(model, mode, "transformer.h.1")
    assert measured == pytest.approx(bench.traced_priced(model, mode), rel=0.01)
