"""``plan models``: list the built-in model zoo."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "models",
        help="list the built-in models",
        description="List the model presets (--model NAME) with their sizes, the aliases "
        "and the small non-transformer models used in tests.",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from planner.models import ALIASES, PRESETS, SMALL_MODELS

    header = f"{'name':<16}{'family':<9}{'params':>10}{'layers':>8}{'hidden':>8}{'heads':>7}{'kv':>5}{'seq':>7}"
    print(header)
    for name, spec in PRESETS.items():
        params = f"{spec.num_params() / 1e9:.2f}B"
        print(
            f"{name:<16}{spec.family.value:<9}{params:>10}{spec.num_layers:>8}"
            f"{spec.hidden_size:>8}{spec.num_heads:>7}{spec.kv_heads:>5}{spec.seq_len:>7}"
        )
    print("aliases: " + ", ".join(f"{a} -> {b}" for a, b in ALIASES.items()))
    print("small models (not transformers): " + ", ".join(SMALL_MODELS))
    return 0
