"""Start-up cost of the light commands: CPU seconds (user + system) of a fresh process.

The decision core and the CLI's parser load no torch (PEP 562 lazy attributes; each
subcommand imports its heavy dependencies when it runs), so reading, explaining and
exporting a plan take a fraction of a second. Each command runs ``--repeats`` times;
the median is printed, with the interpreter's own start-up for reference.

    python benchmarks/bench_startup.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TARGET_EXPLAIN_S = 0.5  # the target for `plan explain plan.json`, CPU seconds


def cpu_seconds(argv: list[str]) -> float:
    """User + system CPU seconds of running ``argv`` to completion in a child process."""
    before = os.times()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after = os.times()
    return (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    python = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        plan = Path(tmp) / "plan.json"
        subprocess.run(
            [python, "-m", "planner", "--model", "llama3-8b", "--gpus", "64",
             "--global-batch", "64", "-o", str(plan)],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        commands = {
            "python -c pass": [python, "-c", "pass"],
            "import planner.spec": [python, "-c", "import planner.spec"],
            "plan --help": [python, "-m", "planner", "--help"],
            "plan explain plan.json": [python, "-m", "planner", "explain", str(plan)],
            "plan export plan.json --to megatron": [
                python, "-m", "planner", "export", str(plan), "--to", "megatron",
            ],
            "import torch (for scale)": [python, "-c", "import torch"],
        }  # fmt: skip
        print(f"{'command':<40}{'CPU s (median of ' + str(args.repeats) + ')':>26}")
        for name, argv in commands.items():
            median = statistics.median(cpu_seconds(argv) for _ in range(args.repeats))
            print(f"{name:<40}{median:>26.3f}")
            if name.startswith("plan explain"):
                explain = median
    verdict = "met" if explain < TARGET_EXPLAIN_S else "MISSED"
    print(f"target: plan explain under {TARGET_EXPLAIN_S} CPU s: {verdict}")


if __name__ == "__main__":
    main()
