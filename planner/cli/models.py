"""``plan models``: list the built-in model zoo."""

from __future__ import annotations

import argparse

from planner.spec import ModelSpec


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "models",
        help="list the built-in models",
        description="List the model presets (--model NAME) with their sizes, the aliases "
        "and the small non-transformer models used in tests.",
    )
    parser.set_defaults(func=run)


def _experts(spec: ModelSpec) -> str:
    """``routed(+shared)/top_k`` for a mixture of experts, ``-`` for a dense model."""
    if not spec.moe:
        return "-"
    shared = f"+{spec.num_shared_experts}" if spec.num_shared_experts else ""
    return f"{spec.num_experts}{shared}/top{spec.top_k}"


def run(args: argparse.Namespace) -> int:
    from planner.models import ALIASES, PRESETS, SMALL_MODELS

    header = (
        f"{'name':<16}{'family':<9}{'params':>10}{'active':>10}{'layers':>8}{'hidden':>8}"
        f"{'heads':>7}{'kv':>5}{'experts':>12}{'seq':>7}"
    )
    print(header)
    for name, spec in PRESETS.items():
        params = f"{spec.num_params() / 1e9:.2f}B"
        active = f"{spec.active_params() / 1e9:.2f}B"
        print(
            f"{name:<16}{spec.family.value:<9}{params:>10}{active:>10}{spec.num_layers:>8}"
            f"{spec.hidden_size:>8}{spec.num_heads:>7}{spec.kv_heads:>5}{_experts(spec):>12}"
            f"{spec.seq_len:>7}"
        )
    print("active: parameters one token uses (routed experts counted top_k times)")
    print("aliases: " + ", ".join(f"{a} -> {b}" for a, b in ALIASES.items()))
    print("small models (not transformers): " + ", ".join(SMALL_MODELS))
    return 0
