"""Cost-model accuracy on MLPerf Training LLM pretraining submissions.

    python benchmarks/bench_mlperf.py           # every row, then per benchmark and GPU
    python benchmarks/bench_mlperf.py --implied  # the step ratio each group implies
    python benchmarks/bench_mlperf.py --fit gb200  # fit a profile's matmul efficiency on half its rows

Each row of ``benchmarks/data/mlperf_runs.csv`` (described in ``benchmarks/data/MLPERF.md``)
is one MLPerf Training submission of GPT-3 175B, Llama 3.1 405B or Llama 3.1 8B
pretraining: its parallel layout from the submitted config, its measured seconds per
optimizer step from the result logs. No row was used to fit anything but the GB200
profile's matmul efficiency (``--fit gb200``, on every other GB200 row). A row is priced
as NeMo / Megatron-Core runs it: Megatron-Core's kernels, the distributed optimizer
(ZeRO-1) with overlapped gradient reduce and parameter gather, gradients reduced and
kept in bf16 (NeMo 1's ``distributed_fused_adam`` ``grad_sync_dtype: bf16``, NeMo 2's
``grad_reduce_in_fp32=False`` in the submissions' ``pretrain.py``), fp8 weights where
the row's optimizer gathers them in fp8 (``FP8_PARAMS``), sequence parallelism with TP,
TP communication overlap where the submission applies it, Transformer Engine fp8 with
the row's recipe (delayed scaling; v5.1's tensorwise current scaling reads each tensor
for its amax first), no dropout, no recompute; an interleaved schedule with
the row's virtual stages, the embedding and the loss counted as a layer each where
the layers do not split evenly otherwise (Llama 3.1 405B: 126 + 2 over 64 chunks).
Vocabularies are the benchmarks' own (``VOCAB``). A GB200 run's node is its NVLink
domain (``_scale_up_domain``). Rows on GPUs without a shipped profile (GB300, B300, AMD
MI350X/MI355X) and NVFP4 rows (no fp4 peak is modelled) are listed as skipped with the
reason.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_accuracy import _int, _schedule, _stats, nvl72_domain
from scipy.optimize import minimize_scalar

from planner.cost import estimate_run
from planner.frameworks import KERNELS, Framework
from planner.hardware import load_profile
from planner.importers.common import chunks_of
from planner.importers.megatron import even_split
from planner.presets import PRESETS
from planner.spec import ModelSpec, Prediction

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "benchmarks" / "data" / "mlperf_runs.csv"

# GPU as the submission's system description names it -> shipped profile
GPUS = {
    "H100-SXM5-80GB": "h100-sxm-80gb",
    "H100-SXM-80GB": "h100-sxm-80gb",
    "H200-SXM5-141GB": "h200-sxm-141gb",
    "B200-SXM-180GB": "b200",
    "GB200": "gb200",
}
PRESET = {"llama31_405b": "llama3.1-405b", "llama31_8b": "llama3-8b"}
# The benchmarks' vocabularies: GPT-3 the reference's 50,257 (mlcommons/training
# large_language_model paxml reference, PassThroughVocabulary(size=50257)); Llama 3.1
# 405B the Mixtral 8x22B tokenizer's 32,000 and Llama 3.1 8B the Llama tokenizer's
# 128,000 (the model tables of mlcommons/training large_language_model_pretraining and
# small_llm_pretraining READMEs)
VOCAB = {"gpt3": 50257, "llama31_405b": 32000, "llama31_8b": 128000}


@dataclass(frozen=True)
class MlperfCase:
    """One submission: its label, group (benchmark and GPU), run config and measured step
    (s), or why it is skipped."""

    label: str
    group: str
    config: dict[str, Any] | None
    measured_s: float
    skipped: str | None = None


def _profile(gpu: str) -> str | None:
    return next((name for key, name in GPUS.items() if key in gpu), None)


def _skip(row: dict[str, str]) -> str | None:
    """Why the planner cannot price this row, or None."""
    if row["precision"] == "fp4":
        return "NVFP4: no fp4 peak in the profiles"
    if _profile(row["gpu"]) is None:
        return f"no hardware profile for {row['gpu'].rsplit(' (', 1)[0]}"
    return None


def _model(row: dict[str, str]) -> dict[str, Any]:
    """The model the row ran: GPT-3 175B from its dimensions, Llama 3.1 from the preset."""
    benchmark, seq = row["benchmark"], _int(row["seq"])
    if benchmark == "gpt3":
        hidden = _int(row["hidden"])
        return {
            "name": "gpt3-175b", "family": "gpt", "num_layers": _int(row["layers"]),
            "hidden_size": hidden, "num_heads": _int(row["heads"]),
            "ffn_hidden_size": _int(row["ffn_hidden"], 4 * hidden),
            "vocab_size": VOCAB[benchmark], "seq_len": seq,
        }  # fmt: skip
    return {"preset": PRESET[benchmark], "vocab_size": VOCAB[benchmark], "seq_len": seq}


def _stages(row: dict[str, str], chunks: int) -> list[list[str]] | None:
    """Megatron's split counting the embedding and the loss as a layer each, where the
    layers alone do not split over ``chunks`` (None: an even split of layers)."""
    layers = _int(row["layers"])
    if row["benchmark"] == "gpt3" or layers % chunks == 0:
        return None
    spec = ModelSpec.model_validate({**PRESETS[PRESET[row["benchmark"]]].model_dump(),
                                     "vocab_size": VOCAB[row["benchmark"]]})  # fmt: skip
    counts = even_split(layers, chunks, embedding=True, loss=True)
    assert counts is not None, f"{row['system']}: {layers} layers + 2 over {chunks} chunks"
    return [list(chunk) for chunk in chunks_of(spec, counts)]


def _scale_up_domain(row: dict[str, str]) -> int:
    """GPUs sharing one NVLink domain (this planner's node): a GB200 rack's 72, or the 64
    of them a multi-rack run uses; the system's GPUs per node elsewhere."""
    if _profile(row["gpu"]) != "gb200":
        return _int(row["gpus_per_node"], 8)
    return nvl72_domain(_int(row["n_gpus"]))


def mlperf_config(row: dict[str, str]) -> dict[str, Any]:
    """The row as a RunConfig dict (the module docstring says how it is priced)."""
    tp, pp, cp = _int(row["tp"], 1), _int(row["pp"], 1), _int(row["cp"], 1)
    virtual = _int(row["vp"], 1) if pp > 1 else 1
    strategy = {
        "dp": _int(row["dp"]), "tp": tp, "pp": pp, "cp": cp, "zero": 1,
        "sequence_parallel": tp > 1 and row["sequence_parallel"] != "False",
        "recompute": "none", **_schedule(pp, virtual),
    }  # fmt: skip
    options: dict[str, Any] = {
        "attention": "flash", "dropout": False, "fused_pointwise": True, "grad_reduce_bytes": 2,
        "overlap_grad_reduce": True, "overlap_param_gather": True,
        "tp_comm_overlap": tp > 1 and row["tp_comm_overlap"].startswith("True"),
        "fp8_param_gather": "fp8 param gather=True" in row["distributed_optimizer"],
        **KERNELS[Framework.MEGATRON],
        "fp8_scaling": "dynamic" if "tensorwise" in row["fp8_recipe"] else "delayed",
    }  # fmt: skip
    config: dict[str, Any] = {
        "model": _model(row),
        "cluster": {"gpu": _profile(row["gpu"]), "num_gpus": _int(row["n_gpus"]),
                    "gpus_per_node": _scale_up_domain(row)},
        "training": {"global_batch_size": _int(row["gbs"]), "micro_batch_size": _int(row["mbs"], 1),
                     "dtype": row["precision"]},
        "strategy": strategy,
        "options": options,
    }  # fmt: skip
    stages = _stages(row, pp * virtual) if pp > 1 else None
    if stages is not None:
        config["stages"] = stages
    return config


def mlperf_case(row: dict[str, str]) -> MlperfCase:
    gpu = _profile(row["gpu"]) or row["gpu"].rsplit(" (", 1)[0].removeprefix("NVIDIA ")
    label = (
        f"{row['round']} {row['submitter'][:12]} {row['benchmark']} {_int(row['n_gpus'])}x"
        f"{gpu} tp{row['tp']} pp{row['pp']} cp{row['cp'] or 1} dp{row['dp']} {row['precision']}"
    )
    group = f"{row['benchmark']} {gpu} {row['precision']}"
    measured = float(row["measured_step_time_s"])
    skipped = _skip(row)
    if skipped is not None:
        return MlperfCase(label, group, None, measured, skipped)
    return MlperfCase(label, group, mlperf_config(row), measured)


def load_cases(path: Path = DATA) -> list[MlperfCase]:
    with path.open(newline="") as handle:
        return [mlperf_case(row) for row in csv.DictReader(handle)]


def report(cases: list[MlperfCase], implied: bool) -> None:
    """Every priced row, the errors per group and overall, then the skipped rows."""
    priced = [c for c in cases if c.config is not None]
    predictions: list[Prediction] = [estimate_run(c.config) for c in priced]  # type: ignore[arg-type]
    print(f"{'run':<66}{'meas s':>9}{'pred s':>9}{'err':>8}{'MFU':>7}  fits")
    groups: dict[str, list[float]] = defaultdict(list)
    for case, pred in zip(priced, predictions, strict=True):
        error = pred.step_time_s / case.measured_s - 1
        groups[case.group].append(error)
        print(f"{case.label[:65]:<66}{case.measured_s:>9.3f}{pred.step_time_s:>9.3f}"
              f"{error:>+8.1%}{pred.mfu:>7.1%}  {'yes' if pred.fits else 'NO'}")  # fmt: skip
    print(f"\n{'benchmark, profile, precision':<36}{'rows':>5}{'mean |err|':>12}{'max |err|':>11}"
          f"{'mean err':>10}")  # fmt: skip
    for group, errors in sorted(groups.items()):
        mean, worst = _stats(errors)
        print(f"{group:<36}{len(errors):>5}{mean:>12.1%}{worst:>11.1%}"
              f"{statistics.fmean(errors):>+10.1%}")  # fmt: skip
    benchmarks: dict[str, list[float]] = defaultdict(list)
    for group, errors in groups.items():
        benchmarks[group.split()[0]].extend(errors)
    for benchmark, errors in sorted(benchmarks.items()):
        mean, worst = _stats(errors)
        print(f"{benchmark}: {len(errors)} rows, mean |err| {mean:.1%}, max |err| {worst:.1%}")
    every = [e for errors in groups.values() for e in errors]
    mean, worst = _stats(every)
    print(f"all priced rows: {len(every)}, mean |err| {mean:.1%}, max |err| {worst:.1%}")
    fitting = sum(p.fits for p in predictions)
    print(f"MLPerf configurations estimated as fitting: {fitting}/{len(predictions)}")
    reasons: dict[str, int] = defaultdict(int)
    for case in cases:
        if case.skipped is not None:
            reasons[case.skipped] += 1
    print("skipped: " + "; ".join(f"{n} rows ({why})" for why, n in sorted(reasons.items())))
    if implied:
        _implied(priced, predictions)


def _implied(cases: list[MlperfCase], predictions: list[Prediction]) -> None:
    """The compute-only scale each group would need (measured over predicted step, on
    the rows' median): what a matmul efficiency fitted to them would absorb. Printed,
    never applied."""
    ratios: dict[str, list[float]] = defaultdict(list)
    for case, pred in zip(cases, predictions, strict=True):
        ratios[case.group].append(case.measured_s / pred.step_time_s)
    print("\nmeasured / predicted step, median per group (not applied):")
    for group, values in sorted(ratios.items()):
        print(f"  {group:<36}{statistics.median(values):>7.3f}")


def fit_efficiency(cases: list[MlperfCase], name: str) -> None:
    """Fit ``name``'s matmul_efficiency on every other of its rows (in file order), print
    the held-out rest's error; the profile file is not modified."""
    rows = [c for c in cases if c.config is not None and c.config["cluster"]["gpu"] == name]
    train, test = rows[0::2], rows[1::2]
    base = load_profile(name)

    def log_error(efficiency: float, chosen: list[MlperfCase]) -> float:
        profile = base.model_copy(update={"matmul_efficiency": efficiency})
        return statistics.fmean(
            abs(math.log(estimate_run(c.config, profile=profile).step_time_s / c.measured_s))
            for c in chosen
        )

    fitted = minimize_scalar(
        log_error, bounds=(0.3, 0.99), args=(train,), method="bounded", options={"xatol": 1e-3}
    )  # fmt: skip
    profile = base.model_copy(update={"matmul_efficiency": float(fitted.x)})
    for role, chosen in (("fitted on", train), ("held out", test)):
        errors = [
            estimate_run(c.config, profile=profile).step_time_s / c.measured_s - 1 for c in chosen
        ]
        mean, worst = _stats(errors)
        print(f"{name}: matmul_efficiency {fitted.x:.3f} (profile {base.matmul_efficiency}); "
              f"{role} {len(chosen)} rows: mean |err| {mean:.1%}, max {worst:.1%}")  # fmt: skip
        for case, error in zip(chosen, errors, strict=True):
            print(f"    {case.label[:64]:<65}{error:>+8.1%}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--csv", type=Path, default=DATA, help="MLPerf runs CSV")
    parser.add_argument("--implied", action="store_true",
                        help="print the step-time ratio each group implies")  # fmt: skip
    parser.add_argument("--fit", metavar="PROFILE",
                        help="fit PROFILE's matmul_efficiency on every other of its rows")  # fmt: skip
    args = parser.parse_args(argv)
    if args.fit:
        fit_efficiency(load_cases(args.csv), args.fit)
        return 0
    report(load_cases(args.csv), args.implied)
    return 0


if __name__ == "__main__":
    sys.exit(main())
