"""Planning speed and plan quality of the search.

Speed (each whole search in a fresh process, tracing included):

- GPT-3 175B on 1024 A100-80GB, global batch 1536 (target < 5 s);
- Llama-3.1-405B on 16,384 H100s, seq 8192, global batch 2048 (target < 10 s);
- mixture of experts, expert parallelism searched with every other dimension:
  DeepSeek-V3 (671B, 256 experts) on 2048 H100s, seq 4096, global batch 15360, and
  Mixtral 8x22B on 256 H100s, seq 4096, global batch 1024 (target < 10 s);
- a model as users bring it: Llama-3.1-405B's Hugging Face ``config.json`` (traced whole
  by ``torch.export``, each tensor-parallel layout rehearsed on the model's own code) on
  1024 H100s, seq 8192, global batch 1024 (target < 30 s).

Quality: for every run in ``published_runs.csv`` with a global batch, the search on the
same model, GPUs, global batch and software options must contain the published
configuration (as this project's runtime runs it: Megatron's plain data parallelism
under a pipeline becomes ZeRO-1, the same bytes; fp16 and fp8 rows, which this runtime
does not train, searched for their own framework: torchtitan 0.2 or Megatron-LM) and
choose a plan predicted at least as
fast that fits. Prints, per row, the published and chosen configurations and both
predicted throughputs.

    python benchmarks/bench_search.py [--csv PATH] [--skip-speed] [--skip-quality]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench_accuracy import DEFAULT_CSV, Case, load_cases
from bench_trace import HF_CONFIGS

from planner.cost import CostModel, RunConfig, graph_from_spec
from planner.frameworks import PLANNER, Target, parse_target, training_refusal
from planner.parallel_dims import ParallelDims
from planner.solve.search import ModelLimits, Pins, in_search_space, search
from planner.spec import Strategy

SPEED_CASES = {
    "gpt3-175b on 1024 x a100-sxm-80gb, gbs 1536 (target < 5 s)": (
        "gpt3-175b", "a100-sxm-80gb", 1024, 1536, None,
    ),
    "llama3.1-405b on 16384 x h100-sxm-80gb, seq 8192, gbs 2048 (target < 10 s)": (
        "llama3.1-405b", "h100-sxm-80gb", 16384, 2048, 8192,
    ),
    "deepseek-v3 on 2048 x h100-sxm-80gb, seq 4096, gbs 15360 (target < 10 s)": (
        "deepseek-v3", "h100-sxm-80gb", 2048, 15360, 4096,
    ),
    "mixtral-8x22b on 256 x h100-sxm-80gb, seq 4096, gbs 1024 (target < 10 s)": (
        "mixtral-8x22b", "h100-sxm-80gb", 256, 1024, 4096,
    ),
    "Llama-3.1-405B's Hugging Face config on 1024 x h100-sxm-80gb, seq 8192, gbs 1024 "
    "(target < 30 s)": ("hf-llama3.1-405b", "h100-sxm-80gb", 1024, 1024, 8192),
}  # fmt: skip

# Run in a fresh process: build the model on meta, trace, search, stage DP, ILP, and
# report the planning time apart from the interpreter's start and imports.
# A Hugging Face case writes bench_trace's config to a temporary directory first.
_TIMED = """
import json, pathlib, sys, tempfile, time
started = time.perf_counter()
import planner, planner.planning, planner.tracing  # planner's own names load lazily
model, gpu, gpus, batch, seq = json.loads(sys.argv[1])
config = json.loads(sys.argv[2]).get(model)
if config is not None:
    import planner.hf
imported = time.perf_counter()
if config is None:
    handle = planner.resolve_model(model, seq_len=seq)
else:
    with tempfile.TemporaryDirectory() as directory:
        (pathlib.Path(directory) / "config.json").write_text(json.dumps(config))
        handle = planner.hf.resolve_hf_config(directory)
plan = planner.make_plan(
    handle, planner.Cluster(gpu=gpu, num_gpus=gpus),
    planner.Training(global_batch_size=batch, seq_len=seq),
)
done = time.perf_counter()
print(json.dumps({"import_s": imported - started, "plan_s": done - imported,
                  "solver": plan.solver.model_dump(), "strategy": plan.strategy.describe()}))
"""


def speed() -> None:
    print("planning time in a fresh process (build on meta, trace, search, stage DP, ILP):")
    for label, case in SPEED_CASES.items():
        started = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "-c", _TIMED, json.dumps(case), json.dumps(HF_CONFIGS)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        wall = time.perf_counter() - started
        timing = json.loads(result.stdout)
        solver = timing["solver"]
        print(
            f"  {label}: {timing['plan_s']:.2f} s planning ({timing['import_s']:.2f} s importing, "
            f"{wall:.2f} s process wall); {solver['candidates_enumerated']:,} candidates, "
            f"{solver['candidates_costed']:,} costed; chose {timing['strategy']}"
        )


def _limits(run: RunConfig) -> ModelLimits:
    spec = run.model
    return ModelLimits(
        num_blocks=spec.num_layers,
        seq_len=spec.seq_len,
        num_heads=spec.num_heads,
        num_kv_heads=spec.kv_heads,
        num_experts=spec.num_experts,
    )


def runnable(strategy: Strategy) -> Strategy:
    """The published strategy as this project's runtime runs it: Megatron's data-parallel
    all-reduce under a pipeline becomes ZeRO-1 (the same bytes, as a reduce-scatter and an
    all-gather), since DDP cannot run under a pipeline schedule here; Megatron's sequence
    parallelism beside expert parallelism is turned off (the experts here take tokens
    replicated over tp and split them: the same all-to-all bytes)."""
    s = strategy
    if s.ep > 1 and s.sequence_parallel:
        s = s.model_copy(update={"sequence_parallel": False})
    if s.zero == 0 and ParallelDims.of(s).ddp_blocker(tied=False):
        return s.model_copy(update={"zero": 1, "dp_shard": s.dp})
    return s


def row_target(case: Case, run: RunConfig) -> Target:
    """This runtime, or for a precision it does not run (fp16, fp8) the row's framework:
    torchtitan's release of the benchmark for its rows, Megatron-LM for the rest."""
    if training_refusal(PLANNER, run.training) is None:
        return PLANNER
    return parse_target("torchtitan==0.2" if case.source == "torchtitan" else "megatron")


def quality_row(case: Case) -> tuple[str, bool]:
    """One table row and whether the row meets the bar."""
    run = RunConfig.from_dict(case.config, case.label)
    free_batch = run.training.model_copy(update={"micro_batch_size": None})
    graph = graph_from_spec(run.model, dtype=run.training.dtype)
    model = CostModel(graph, run.cluster, free_batch, options=run.options)
    target = row_target(case, run)
    strategy = runnable(run.strategy) if target.is_planner else run.strategy
    published = model.estimate(strategy)
    inside = in_search_space(model, _limits(run), strategy, target)
    started = time.perf_counter()
    best = search(model, _limits(run), pins=Pins(), top_k=1, target=target).best
    took = time.perf_counter() - started
    chosen = best.prediction
    ok = inside and chosen.fits and chosen.step_time_s <= published.step_time_s * (1 + 1e-9)
    gain = published.step_time_s / chosen.step_time_s - 1
    text = (
        f"{case.label[:34]:<34} {strategy.describe()[:44]:<44} {str(target)[:16]:<16} "
        f"{published.tokens_per_s_per_gpu:>8.0f} {'yes' if published.fits else 'NO':>4} "
        f"{'yes' if inside else 'NO':>6} | {best.strategy.describe()[:52]:<52} "
        f"{chosen.tokens_per_s_per_gpu:>8.0f} {gain:>+7.1%} {took:>6.2f}s {'ok' if ok else 'FAIL'}"
    )
    return text, ok


def quality(csv: Path) -> bool:
    cases = [c for c in load_cases(csv) if c.config["training"]["global_batch_size"]]
    print(
        f"\n{'published run':<34} {'published config':<44} {'searched for':<16} {'tok/s/g':>8} {'fits':>4} "
        f"{'in space':>6} | {'chosen config':<52} {'tok/s/g':>8} {'gain':>7} {'search':>7}"
    )
    results = [quality_row(case) for case in cases]
    for text, _ in results:
        print(text)
    passed = sum(ok for _, ok in results)
    print(f"\n{passed}/{len(results)} rows: published config in the space, chosen plan fits "
          "and is predicted at least as fast")  # fmt: skip
    return passed == len(results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-quality", action="store_true")
    args = parser.parse_args()
    if not args.skip_speed:
        speed()
    ok = True
    if not args.skip_quality:
        ok = quality(args.csv)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
