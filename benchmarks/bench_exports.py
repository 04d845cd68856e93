"""Exports fed to the frameworks' own parsers: accepted, refused by the exporter, or rejected.

Plans a dozen representative strategies (zoo presets on A100/H100 clusters, each pinned
to one way of training: FSDP, HSDP, DDP, tp+sp, pipelining with 1F1B, interleaved and
zero-bubble schedules, cp, fp8, full and selective recompute; Mixtral 8x7B (also with
expert tensor parallelism) and DeepSeek-V3 with expert parallelism, assembled as given), exports each to every
release :data:`planner.frameworks.RELEASES` lists, and runs every export through that
release's own parser in its own Python (``benchmarks/export_parsers/*_check.py``): torchtitan's
``ConfigManager`` + ``ParallelDims`` + ``parallelize_llama`` (DeepSeek-V3: torchtitan's
``deepseek_v3`` 671B, pipelined and expert-parallel) on the meta device,
Megatron-LM's ``parse_args`` + ``validate_args`` + ``TransformerConfig``, DeepSpeed's
``DeepSpeedConfig``. Prints one row per plan and target: ``accepted``, ``refused`` (by
the exporter, with its reason) or ``REJECTED`` (by the parser, with its error), then the
counts per target.

Where each release's parser lives is one environment variable per release, named for the
target (``megatron==0.16`` -> ``PLANNER_PARSER_MEGATRON_0_16``), holding that Python and,
after a ``:``, any directories to put on its ``PYTHONPATH`` (Megatron-LM's
``megatron/training`` is not in the megatron-core wheel)::

    PLANNER_PARSER_TORCHTITAN_0_2=/venvs/tt02/bin/python
    PLANNER_PARSER_TORCHTITAN_0_3=/venvs/tt03/bin/python
    PLANNER_PARSER_MEGATRON_0_16=/venvs/megatron/bin/python:/src/megatron-lm-core_v0.16.1
    PLANNER_PARSER_DEEPSPEED_0_19_8=/venvs/ds0198/bin/python

A release without its variable is reported ``no parser`` (its exports still run).

    python benchmarks/bench_exports.py [--jobs 2] [--only PLAN_LABEL ...]

Each release's exports run in one parser process that imports the framework once and
checks each export in a child forked from it (``export_parsers/forked.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from planner.assemble import assemble_plan
from planner.errors import ExportError
from planner.export import TARGETS, export_plan
from planner.frameworks import RELEASES, Framework, Target
from planner.models import resolve_model
from planner.parallel_dims import ParallelDims
from planner.planning import make_plan
from planner.solve.search import Pins
from planner.spec import Cluster, DType, Plan, RecomputeMode, Schedule, Strategy, Training

CHECKERS = Path(__file__).resolve().parent / "export_parsers"
CHECK_TIMEOUT_S = 300
# torchtitan's llama3 flavors of the zoo presets (its models/llama3 registry)
FLAVORS = {"llama3-8b": "8B", "llama3-70b": "70B", "llama3.1-405b": "405B"}
# torchtitan's other models whose flavors have a zoo preset's sizes: (model, flavor); Mixtral
# is checked on a Qwen3 MoE (torchtitan has no Mixtral; 0.3 validates the experts' dispatcher)
MODELS = {"deepseek-v3": ("deepseek_v3", "671B"), "mixtral-8x7b": ("qwen3", "30B_A3B")}
FLAVORS_02 = {"30B_A3B": "30B-A3B"}  # torchtitan 0.2's spelling of a flavor 0.3 renamed
# compute capability major of the cluster GPUs (Megatron's validate_args asks CUDA for it)
GPU_ARCH = {"a100": 8, "h100": 9, "h200": 9, "b200": 10}


@dataclass(frozen=True)
class Case:
    """A plan to export: a zoo preset on a cluster, pinned to one way of training."""

    label: str
    model: str
    gpu: str
    gpus: int
    global_batch: int
    pins: Pins
    dtype: DType = DType.BF16
    seq_len: int | None = 4096  # tokens; None: the model's
    target: str = "planner"  # the framework the search keeps to

    def plan(self) -> Plan:
        training = Training(
            global_batch_size=self.global_batch, dtype=self.dtype, seq_len=self.seq_len
        )
        cluster = Cluster(gpu=self.gpu, num_gpus=self.gpus)
        return make_plan(
            resolve_model(self.model), cluster, training, pins=self.pins, target=self.target
        )


@dataclass(frozen=True)
class FixedCase:
    """A plan to export: a zoo preset on a cluster under one strategy, assembled as given
    (not searched: mixture-of-experts plans with ep > 1, which the search may not pick)."""

    label: str
    model: str
    gpu: str
    strategy: Strategy
    seq_len: int = 4096
    target: str = "planner"  # a plan only this target runs carries no layout of ours

    def plan(self) -> Plan:
        strategy = self.strategy
        batch = strategy.dp * strategy.micro_batch_size * strategy.num_microbatches
        training = Training(global_batch_size=batch, seq_len=self.seq_len)
        cluster = Cluster(gpu=self.gpu, num_gpus=strategy.world_size)
        layout = None if self.target == "planner" else {}
        return assemble_plan(
            resolve_model(self.model), cluster, training, strategy, tp_layout=layout,
            target=self.target,
        )  # fmt: skip


H100, A100 = "h100-sxm-80gb", "a100-sxm-80gb"
FULL, SELECTIVE, NONE = RecomputeMode.FULL, RecomputeMode.SELECTIVE, RecomputeMode.NONE
CASES = (
    Case("gpt3-175b 1f1b", "gpt3-175b", A100, 1024, 1536,
         Pins(tp=8, pp=16, schedule=Schedule.ONE_F_ONE_B), seq_len=None),
    Case("8b fsdp", "llama3-8b", H100, 64, 64,
         Pins(tp=1, pp=1, cp=1, zero=3, dp_shard=64, recompute=NONE)),
    Case("8b hsdp zero3", "llama3-8b", H100, 64, 64,
         Pins(tp=1, pp=1, cp=1, zero=3, dp_shard=8, recompute=NONE)),
    Case("8b hsdp zero2", "llama3-8b", H100, 64, 64,
         Pins(tp=1, pp=1, cp=1, zero=2, dp_shard=8, recompute=NONE)),
    Case("1.3b ddp", "gpt3-1.3b", H100, 8, 64,
         Pins(tp=1, pp=1, cp=1, zero=0, recompute=FULL), seq_len=None),
    Case("8b tp no-sp", "llama3-8b", H100, 16, 32,
         Pins(tp=2, pp=1, cp=1, zero=3, sequence_parallel=False, recompute=NONE)),
    Case("8b cp", "llama3-8b", H100, 64, 64,
         Pins(tp=1, pp=1, cp=4, zero=3, recompute=NONE)),
    Case("8b fp8", "llama3-8b", H100, 64, 64,
         Pins(tp=1, pp=1, cp=1, zero=3, recompute=NONE), dtype=DType.FP8,
         target="torchtitan==0.2"),  # fp8 GEMMs: this runtime has none
    Case("70b tp+sp full", "llama3-70b", H100, 256, 256,
         Pins(tp=8, pp=1, cp=1, zero=3, sequence_parallel=True, recompute=FULL)),
    Case("70b pp 1f1b", "llama3-70b", H100, 256, 512,
         Pins(tp=8, pp=4, cp=1, zero=1, sequence_parallel=True, schedule=Schedule.ONE_F_ONE_B,
              recompute=NONE)),
    Case("70b interleaved", "llama3-70b", H100, 256, 512,
         Pins(tp=8, pp=4, cp=1, zero=1, sequence_parallel=True, virtual_stages=2,
              schedule=Schedule.INTERLEAVED_1F1B, recompute=SELECTIVE)),
    Case("70b ddp under pp", "llama3-70b", H100, 256, 512,
         Pins(tp=8, pp=4, cp=1, zero=0, sequence_parallel=True, schedule=Schedule.ONE_F_ONE_B,
              recompute=NONE), target="megatron"),  # Megatron-LM's DDP runs a pipeline
    Case("70b zero-bubble", "llama3-70b", H100, 256, 512,
         Pins(tp=8, pp=4, cp=1, zero=1, sequence_parallel=True, schedule=Schedule.ZERO_BUBBLE,
              recompute=NONE)),
    Case("405b selective", "llama3.1-405b", H100, 2048, 2048,
         Pins(tp=8, pp=16, cp=1, zero=1, sequence_parallel=True, schedule=Schedule.ONE_F_ONE_B,
              recompute=SELECTIVE)),
    # 128 chunks of 126 layers: the embedding and the head each a chunk of their own
    Case("405b embedding, head alone", "llama3.1-405b", H100, 256, 512,
         Pins(tp=8, pp=16, cp=1, zero=2, sequence_parallel=True, virtual_stages=8,
              schedule=Schedule.INTERLEAVED_1F1B, recompute=FULL), target="torchtitan"),
    FixedCase("mixtral ep8 fsdp", "mixtral-8x7b", H100,
              Strategy(dp=16, zero=3, ep=8, recompute=FULL)),
    FixedCase("mixtral tp2 ep4 etp2", "mixtral-8x7b", H100,
              Strategy(dp=8, tp=2, zero=1, ep=4, etp=2, sequence_parallel=True, recompute=FULL),
              target="megatron"),
    FixedCase("deepseek-v3 ep64", "deepseek-v3", H100,
              Strategy(dp=64, pp=4, zero=1, ep=64, num_microbatches=8,
                       schedule=Schedule.ONE_F_ONE_B, recompute=FULL)),
)  # fmt: skip


def targets() -> list[Target]:
    """Every release the exporters write settings for."""
    return [Target(framework, version) for framework in TARGETS for version in RELEASES[framework]]


@dataclass(frozen=True)
class Parser:
    """A release's parser: its Python and the extra ``PYTHONPATH`` it needs."""

    python: str
    path: str

    @classmethod
    def find(cls, target: Target) -> Parser | None:
        value = os.environ.get(variable(target), "").strip()
        if not value:
            return None
        python, _, path = value.partition(":")
        return cls(python, path)


def variable(target: Target) -> str:
    """``megatron==0.16`` -> ``PLANNER_PARSER_MEGATRON_0_16``."""
    version = "_".join(str(part) for part in target.version)
    return f"PLANNER_PARSER_{target.framework.value.upper()}_{version}"


@dataclass(frozen=True)
class Outcome:
    """What became of one export: ``accepted``, ``refused``, ``rejected`` or ``no parser``."""

    verdict: str
    detail: str = ""


def checker_job(target: Target, plan: Plan) -> dict[str, object]:
    """The launch facts a checker needs from the plan (the export's path is added)."""
    framework = target.framework
    job: dict[str, object] = {"world_size": plan.strategy.world_size}
    if framework is Framework.TORCHTITAN and plan.model_name in FLAVORS:
        job["flavor"] = FLAVORS[plan.model_name]
    if framework is Framework.TORCHTITAN and plan.model_name in MODELS:
        model, flavor = MODELS[plan.model_name]
        if target.version[:2] == (0, 2):
            flavor = FLAVORS_02.get(flavor, flavor)
        job |= {"model": model, "flavor": flavor}
    if framework is not Framework.DEEPSPEED:
        job["gpu_arch"] = next(v for k, v in GPU_ARCH.items() if plan.cluster.gpu.startswith(k))
    return job


def run_parsers(
    parser: Parser, target: Target, exports: Sequence[tuple[Plan, str]]
) -> list[Outcome]:
    """Feed each ``(plan, text)`` (``text`` the export of ``plan`` for ``target``) to
    ``parser``: one checker process, each export in a child forked from it
    (``export_parsers/forked.py``)."""
    with tempfile.TemporaryDirectory(prefix="export-check-") as folder:
        jobs = []
        for index, (plan, text) in enumerate(exports):
            path = Path(folder) / f"export-{index}"
            path.write_text(text)
            jobs.append({"export": str(path), **checker_job(target, plan)})
        (Path(folder) / "jobs.json").write_text(json.dumps(jobs))
        environment = os.environ | {"PYTHONPATH": parser.path, "OMP_NUM_THREADS": "1"}
        script = str(CHECKERS / f"{target.framework.value}_check.py")
        command = [parser.python, script, "--jobs", "jobs.json", "--results", "results.json"]
        done = subprocess.run(
            command, capture_output=True, text=True, env=environment, cwd=folder,
            timeout=CHECK_TIMEOUT_S * len(jobs), check=False,
        )  # fmt: skip
        results = Path(folder) / "results.json"
        if done.returncode != 0 or not results.exists():
            tail = done.stderr.strip().splitlines()[-3:]
            raise RuntimeError(f"{target} checker failed ({done.returncode}): {' | '.join(tail)}")
        found = json.loads(results.read_text())
    return [
        _outcome(target, plan, result) for (plan, _), result in zip(exports, found, strict=True)
    ]


def _outcome(target: Target, plan: Plan, result: dict[str, object]) -> Outcome:
    """What a checker's ``result`` for ``plan``'s export says."""
    if result["ok"] is None:
        raise RuntimeError(f"{target} checker crashed on {plan.model_name}: {result['crash']}")
    dims = ParallelDims.of(plan.strategy)  # EP groups: ep ranks etp apart
    ours = list(range(0, dims.expert_group, dims.etp))
    if result["ok"] and result.get("expert_group", ours) != ours:
        return Outcome(
            "rejected", f"{result['version']}: rank 0's expert-parallel group is "
            f"{result['expert_group']}, not the planner's ranks {ours}",
        )  # fmt: skip
    if result["ok"]:
        return Outcome("accepted", f"{target.framework.value} {result['version']}")
    return Outcome("rejected", f"{result['version']} {result['stage']}: {result['error']}")


def outcomes(target: Target, plans: Sequence[Plan]) -> list[Outcome]:
    """Export each of ``plans`` to ``target`` and feed the exports that worked to the
    release's parser, all in one checker process (:func:`run_parsers`)."""
    found: list[Outcome | None] = []
    exports: list[tuple[Plan, str]] = []
    for plan in plans:
        try:
            exports.append((plan, export_plan(plan, target)))
            found.append(None)
        except ExportError as error:
            found.append(Outcome("refused", str(error).split(": ", 1)[-1]))
    parser = Parser.find(target)
    if parser is None:
        parsed = [Outcome("no parser", f"set {variable(target)}")] * len(exports)
    else:
        parsed = run_parsers(parser, target, exports) if exports else []
    answers = iter(parsed)
    return [outcome if outcome is not None else next(answers) for outcome in found]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2, help="releases checked at once")
    parser.add_argument("--only", nargs="+", metavar="LABEL", help="plans to run (labels)")
    args = parser.parse_args(argv)
    cases = [case for case in CASES if not args.only or case.label in args.only]
    started = time.perf_counter()
    plans = {case.label: case.plan() for case in cases}
    planned = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        checked = pool.map(lambda target: outcomes(target, list(plans.values())), targets())
        per_target = dict(zip(targets(), checked, strict=True))
    jobs = [(label, target) for label in plans for target in targets()]
    labels = list(plans)
    results = [per_target[target][labels.index(label)] for label, target in jobs]
    print(f"{'plan':<18} {'strategy':<44} {'target':<19} verdict")
    for (label, target), result in zip(jobs, results, strict=True):
        strategy = plans[label].strategy.describe()
        line = f"{label:<18} {strategy:<44} {target!s:<19} {result.verdict}"
        detail = "" if result.verdict == "accepted" else f": {result.detail[:160]}"
        print(line + detail)
    print()
    counts = {target: Counter() for target in targets()}
    for (_, target), result in zip(jobs, results, strict=True):
        counts[target][result.verdict] += 1
    verdicts = ("accepted", "refused", "rejected", "no parser")
    print(f"{'target':<19} " + " ".join(f"{v:>9}" for v in verdicts))
    for target, count in counts.items():
        print(f"{target!s:<19} " + " ".join(f"{count[v]:>9}" for v in verdicts))
    print(
        f"\n{len(plans)} plans in {planned - started:.0f} s, {len(jobs)} exports checked in "
        f"{time.perf_counter() - planned:.0f} s ({args.jobs} releases at once, each release's "
        "exports two at a time in one parser process)"
    )
    return 1 if any(result.verdict == "rejected" for result in results) else 0


if __name__ == "__main__":
    sys.exit(main())
