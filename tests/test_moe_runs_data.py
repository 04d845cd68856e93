"""benchmarks/data/moe_runs.csv and dense_runs.csv (the same columns) are well-formed, and
the accuracy benchmark reads them."""

import csv
from pathlib import Path

import pytest

from planner.parallel_dims import ParallelDims
from planner.presets import PRESETS
from planner.spec import ModelSpec, Strategy
from tests.benchmark_modules import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
CSV = ROOT / "benchmarks" / "data" / "moe_runs.csv"
DENSE_CSV = ROOT / "benchmarks" / "data" / "dense_runs.csv"
SHARED_COLUMNS = (ROOT.parent / "shared" / "data" / "published_runs.csv").resolve()
MOE_COLUMNS = (
    "preset", "active_params_b", "num_experts", "top_k", "etp", "param_dtype", "grad_reduce",
    "virtual_stages", "pp_accounts", "local_batch",
    "gpus_per_node", "framework", "routing", "flop_convention", "source_url", "source_commit",
)  # fmt: skip
INTEGERS = ("layers", "hidden", "heads", "seq", "vocab", "gbs", "mbs", "n_gpus", "tp", "pp", "dp",
            "cp", "ep", "zero", "num_experts", "top_k", "etp", "virtual_stages", "local_batch",
            "gpus_per_node")  # fmt: skip
FLOATS = ("params_b", "active_params_b", "measured_tflops_per_gpu", "measured_mfu",
          "measured_tokens_per_s_per_gpu", "measured_step_time_s", "measured_hfu",
          "measured_peak_mem_gib", "derived_tokens_per_s_per_gpu")  # fmt: skip
MEASURED = ("measured_step_time_s", "measured_tokens_per_s_per_gpu", "measured_tflops_per_gpu")


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


MOE_ROWS = _rows(CSV)
DENSE_ROWS = _rows(DENSE_CSV)
ROWS = MOE_ROWS + DENSE_ROWS
IDS = [f"{i}:{r['model']}x{r['n_gpus']}" for i, r in enumerate(ROWS)]


def _bench():
    return load_benchmark("bench_accuracy")


@pytest.mark.parametrize("path", [CSV, DENSE_CSV], ids=lambda p: p.name)
def test_columns_are_the_shared_ones_then_the_moe_ones(path):
    header = next(csv.reader(path.open()))
    if SHARED_COLUMNS.is_file():
        shared = next(csv.reader(SHARED_COLUMNS.open()))
        assert header[: len(shared)] == shared
    assert tuple(header[-len(MOE_COLUMNS) :]) == MOE_COLUMNS
    assert len(_rows(path)) >= 6


def test_dense_rows_are_dense_and_moe_rows_have_experts():
    assert all(not r["num_experts"] and not r["top_k"] and r["ep"] == "1" for r in DENSE_ROWS)
    assert all(int(r["num_experts"]) > 1 for r in MOE_ROWS)


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_row_is_sourced_and_numbers_parse(row):
    assert row["source"] and row["source_url"].startswith("https://") and row["notes"]
    assert len(row["source_commit"]) == 40 and int(row["source_commit"], 16) >= 0
    for column in INTEGERS:
        assert row[column] == "" or int(row[column]) > 0 or column == "zero", column
    for column in FLOATS:
        assert row[column] == "" or float(row[column]) > 0, column
    assert any(row[c] for c in MEASURED), "a row needs a measured step time, tokens/s or TFLOP/s"
    assert row["precision"] in ("bf16", "fp8")
    assert row["grad_reduce"] in ("fp32", "bf16")
    assert set(filter(None, row["pp_accounts"].split(","))) <= {"embedding", "loss"}
    assert row["row_quality"] in ("A", "A-", "B")
    assert row["dp_is_derived"] in ("yes", "no")
    if not row["measured_step_time_s"] and not row["measured_tokens_per_s_per_gpu"]:
        assert row["flop_convention"].startswith("megatron-"), "TFLOP/s alone needs a convention"


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_degrees_multiply_to_the_gpus_and_experts_split(row):
    degrees = {k: int(row[k]) for k in ("dp", "tp", "pp", "cp", "ep", "zero")}
    strategy = Strategy(**degrees)
    dims = ParallelDims.of(strategy)
    assert dims.world_size == int(row["n_gpus"])
    assert int(row["gbs"]) % (strategy.dp * int(row["mbs"])) == 0
    if row["num_experts"]:
        assert dims.expert_blocker(int(row["num_experts"])) is None
        assert int(row["top_k"]) <= int(row["num_experts"])
    if row["local_batch"]:  # gradient-accumulation steps of local_batch sequences a rank
        local = int(row["local_batch"])
        assert local % int(row["mbs"]) == 0 and int(row["gbs"]) % (strategy.dp * local) == 0


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_a_preset_that_exists_matches_the_row(row):
    spec = PRESETS.get(row["preset"])
    if spec is None:
        pytest.skip(f"preset {row['preset']!r} not in planner.presets yet")
    shape = (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_experts, spec.top_k)
    assert shape == tuple(
        int(row[k] or default)
        for k, default in (("layers", 0), ("hidden", 0), ("heads", 0), ("num_experts", 0),
                           ("top_k", 0))
    )  # fmt: skip


def test_megatron_2024_flops_are_megatrons_formula():
    """Megatron-Core v0.8's num_floating_point_operations for Mixtral 8x7B, literally."""
    bench = _bench()
    row = next(r for r in MOE_ROWS if r["flop_convention"] == "megatron-2024")
    b, s, layers, h, heads, groups, ffn, k, vocab = 256, 4096, 32, 4096, 32, 8, 14336, 2, 32000
    expected = (12 * b * s * layers * h * h) * (
        (1 + groups / heads + s / h) + ffn / h * k * 1.5 + vocab / (2 * layers * h)
    )
    mixtral = ModelSpec(
        name="mixtral", family="llama", num_layers=layers, hidden_size=h, num_heads=heads,
        num_kv_heads=groups, ffn_hidden_size=ffn, vocab_size=vocab, seq_len=s, num_experts=8, top_k=k,
    )  # fmt: skip
    assert bench.megatron_moe_flops(mixtral, row) == pytest.approx(expected)
    causal = {**row, "flop_convention": "megatron-causal"}
    saved = 6 * b * s * layers * heads * (h // heads) * s  # half the score-matrix FLOPs
    assert bench.megatron_moe_flops(mixtral, causal) == pytest.approx(expected - saved)


def test_rows_the_planner_cannot_price_are_skipped_with_the_reason():
    bench = _bench()
    gb300 = {**MOE_ROWS[0], "gpu": "GB300"}
    assert "no hardware profile for GB300" in (bench.moe_case(gb300).skipped or "")
    unknown = {**MOE_ROWS[0], "preset": "no-such-moe"}
    assert "'no-such-moe' is not in planner.presets.PRESETS" in (
        bench.moe_case(unknown).skipped or ""
    )
    if MOE_ROWS[0]["preset"] not in PRESETS:
        pytest.skip(f"preset {MOE_ROWS[0]['preset']!r} not in planner.presets yet")
    priced = bench.moe_case(MOE_ROWS[0])
    assert priced.skipped is None and priced.config["strategy"]["ep"] == int(MOE_ROWS[0]["ep"])
    assert priced.measured_step_s == pytest.approx(3.102, abs=0.001)  # 438 TFLOP/s on 64 GPUs


def test_a_gb200_run_across_racks_uses_64_gpus_of_each_nvlink_domain():
    """MLPerf's multi-rack GB200 runs use 16 of a rack's 18 trays (256 GPUs on 4 NVL72s);
    a run within one rack, or in whole racks, uses all 72."""
    bench = _bench()
    assert [bench.nvl72_domain(n) for n in (8, 72, 144, 256, 2496)] == [72, 72, 72, 64, 64]
    gb200 = next(r for r in MOE_ROWS if r["gpu"] == "GB200" and int(r["n_gpus"]) > 72)
    config = bench.moe_case(gb200).config
    assert config is not None and config["cluster"]["gpus_per_node"] == 64


def test_megatrons_block_recompute_of_n_layers_is_full_recompute_of_n_blocks_a_stage():
    bench = _bench()
    row = next(r for r in DENSE_ROWS if r["recompute"].startswith("full("))
    config = bench.moe_case(row).config
    assert config is not None
    strategy = config["strategy"]
    assert (strategy["recompute"], strategy["recompute_blocks"]) == ("full", 5)
    none = bench.moe_case({**row, "recompute": "none"}).config
    assert none is not None and none["strategy"]["recompute_blocks"] is None
