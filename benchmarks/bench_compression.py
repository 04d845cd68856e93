"""Where gradient compression starts to pay: the planner's choice as inter-node bandwidth falls.

For Llama-3-8B (256 x 8192 tokens per step) and GPT-3 13B (1024 x 2048) on 64 H100s
(8 nodes of 8), the inter-node bandwidth per GPU is swept from 400 Gb/s (one 400G NIC
per GPU, the DGX norm) down to 1 Gb/s. At each point the search runs three times:
exact only, with ``bf16,int8,powersgd:4`` allowed, and with ``local_sgd:8`` allowed too; the
table shows the chosen plan, its predicted step time, the compression compute it adds
and the bytes each rank puts into data-parallel reductions per step without and with
its compression. Then, for each option alone, the highest bandwidth at which the
search picks it (a log-spaced scan refined by bisection).

    python benchmarks/bench_compression.py            # both models, about 3-6 minutes
    python benchmarks/bench_compression.py --quick    # Llama-3-8B, fewer points
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from planner.cost import CostModel, graph_from_spec
from planner.cost.compression import all_gather_break_even_ranks
from planner.models import get_preset
from planner.solve.lossy import LossyCompression, crossover_bandwidth
from planner.solve.search import ModelLimits, Scored, search
from planner.spec import Cluster, Compression, CompressionKind, Training

GPUS, GPUS_PER_NODE = 64, 8
SWEEP_GBIT = (400, 200, 100, 50, 25, 10, 5, 2, 1)
QUICK_GBIT = (400, 25, 5, 1)
ALLOWED = LossyCompression.parse("bf16,int8,powersgd:4")
WITH_LOCAL = LossyCompression.parse("bf16,int8,powersgd:4,local_sgd:8")
OPTIONS = {
    "bf16": (LossyCompression.parse("bf16"), CompressionKind.BF16),
    "int8": (LossyCompression.parse("int8"), CompressionKind.INT8),
    "powersgd:4": (LossyCompression.parse("powersgd:4"), CompressionKind.POWERSGD),
    "local_sgd:8": (LossyCompression.parse("local_sgd:8"), CompressionKind.LOCAL_SGD),
}


@dataclass(frozen=True)
class Case:
    preset: str
    global_batch: int


CASES = (Case("llama3-8b", 256), Case("gpt3-13b", 1024))


class Planner:
    """One model's searches at any inter-node bandwidth (Gb/s per GPU)."""

    def __init__(self, case: Case) -> None:
        spec = get_preset(case.preset)
        self.graph = graph_from_spec(spec)
        self.training = Training(global_batch_size=case.global_batch)
        self.limits = ModelLimits(spec.num_layers, spec.seq_len, spec.num_heads, spec.kv_heads)
        self.searches = 0

    def model(self, gbit: float) -> CostModel:
        cluster = Cluster(
            gpu="h100-sxm-80gb", num_gpus=GPUS, gpus_per_node=GPUS_PER_NODE,
            inter_node_GBps=gbit / 8,
        )  # fmt: skip
        return CostModel(self.graph, cluster, self.training)

    def best(self, gbit: float, lossy: LossyCompression | None) -> tuple[Scored, CostModel]:
        model = self.model(gbit)
        self.searches += 1
        return search(model, self.limits, top_k=1, lossy=lossy).best, model


def _gb(size: float) -> str:
    return f"{size / 1e9:.2f}" if size >= 1e7 else f"{size / 1e9:.4f}"


def sweep(planner: Planner, points: tuple[int, ...]) -> None:
    header = (
        f"{'Gb/s':>5} | {'exact: plan':<44}{'step s':>8} | {'bf16,int8,powersgd:4 allowed: plan':<58}"
        f"{'step s':>8}{'gain':>7}{'comp ms':>9}{'GB/rank':>14} | {'+local_sgd:8':<22}{'step s':>8}"
    )
    print(header)
    print("-" * len(header))
    for gbit in points:
        exact, model = planner.best(gbit, None)
        chosen, _ = planner.best(gbit, ALLOWED)
        local, _ = planner.best(gbit, WITH_LOCAL)
        step, lossy_step = exact.prediction.step_time_s, chosen.prediction.step_time_s
        compute_ms = chosen.prediction.breakdown_s.get("compression", 0.0) * 1e3
        uncompressed = chosen.strategy.model_copy(update={"compression": Compression()})
        moved = (
            f"{_gb(model.dp_payload_bytes(uncompressed))}->"
            f"{_gb(model.dp_payload_bytes(chosen.strategy))}"
        )
        print(
            f"{gbit:>5} | {exact.strategy.describe():<44.44}{step:>8.2f} | "
            f"{chosen.strategy.describe():<58.58}{lossy_step:>8.2f}{step / lossy_step:>6.2f}x"
            f"{compute_ms:>9.0f}{moved:>14} | {local.strategy.compression.describe():<22.22}"
            f"{local.prediction.step_time_s:>8.2f}"
        )


def crossovers(planner: Planner, points: int) -> None:
    print("\nhighest bandwidth at which the search picks each option (allowed alone):")
    for name, (lossy, kind) in OPTIONS.items():

        def picks(
            gbit: float, lossy: LossyCompression = lossy, kind: CompressionKind = kind
        ) -> bool:
            return planner.best(gbit, lossy)[0].strategy.compression.kind is kind

        found = crossover_bandwidth(picks, 1.0, 400.0, points=points)
        text = "never, down to 1 Gb/s" if found is None else f"below {found:.1f} Gb/s per GPU"
        if found == 400.0:
            text = "already at 400 Gb/s"
        print(f"  {name:<12} {text}")


def composition() -> None:
    """Which collective each option needs, and where an all-gather-only one stops paying."""
    print("\nhow each option reduces (fp32 gradients, S bytes per rank):")
    rows = (
        ("none", "all-reduce", "S", "any"),
        ("bf16/fp16", "all-reduce", "S/2", "any"),
        ("powersgd:r", "3 all-reduces (rest, P, Q)", "r(m+n)/mn of each matrix", "any"),
        ("local_sgd:H", "all-reduce in the group; params / H", "S/H across groups", "any"),
        ("int8 (FSDP reduce-scatter)", "all-to-all, fp32 sum on arrival", "S/4 + scales", "any"),
        (
            "int8 by all-gather (not used)",
            "all-gather",
            "S/4",
            f"<= {all_gather_break_even_ranks(4)}",
        ),
    )
    print(f"  {'option':<32}{'collective':<38}{'payload':<27}{'pays for group sizes'}")
    for row in rows:
        print(f"  {row[0]:<32}{row[1]:<38}{row[2]:<27}{row[3]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Llama-3-8B only, 4 points")
    args = parser.parse_args()
    cases = CASES[:1] if args.quick else CASES
    composition()
    for case in cases:
        started = time.perf_counter()
        planner = Planner(case)
        seq = planner.graph.seq_len
        print(
            f"\n== {case.preset}, {case.global_batch} x {seq} tokens per step, {GPUS} x "
            f"h100-sxm-80gb ({GPUS // GPUS_PER_NODE} nodes of {GPUS_PER_NODE}), inter-node "
            "Gb/s per GPU swept =="
        )
        sweep(planner, QUICK_GBIT if args.quick else SWEEP_GBIT)
        crossovers(planner, points=8 if args.quick else 16)
        elapsed = time.perf_counter() - started
        print(f"({planner.searches} searches in {elapsed:.0f} s)")


if __name__ == "__main__":
    main()
