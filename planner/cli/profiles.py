"""``plan profiles``: list the GPU and cluster profiles shipped in ``profiles/``."""

from __future__ import annotations

import argparse

from planner.clusters import list_clusters, load_cluster
from planner.hardware import list_profiles, load_profile
from planner.spec import DType


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "profiles",
        help="list the built-in GPU and cluster profiles (for --cluster)",
        description="List the GPU profiles (use with --gpus N) and the cluster profiles "
        "(GPUs and network links included) shipped with the planner.",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print("GPU profiles (--cluster NAME --gpus N)")
    print(f"{'name':<18}{'bf16 TFLOP/s':>13}{'memory GiB':>12}{'HBM GB/s':>10}  description")
    for name in list_profiles():
        profile = load_profile(name)
        tflops = profile.peak_flops(DType.BF16) / 1e12
        print(
            f"{name:<18}{tflops:>13.0f}{profile.memory_capacity_gib:>12.1f}"
            f"{profile.memory_bandwidth_GBps:>10.0f}  {profile.description}"
        )
    print("\nCluster profiles (--cluster NAME: GPUs and links included)")
    print(f"{'name':<18}{'GPUs':>6}  {'GPU':<16}description")
    for name in list_clusters():
        cluster = load_cluster(name)
        print(f"{name:<18}{cluster.num_gpus:>6}  {cluster.gpu:<16}{cluster.description}")
    return 0
