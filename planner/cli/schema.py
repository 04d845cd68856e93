"""``plan schema``: print the JSON Schema of the planner's documents."""

from __future__ import annotations

import argparse

from pydantic import BaseModel

from planner.io import dumps_json
from planner.spec import Cluster, ModelSpec, Plan, Strategy, Training

DOCUMENTS: dict[str, type[BaseModel]] = {
    "plan": Plan,
    "model": ModelSpec,
    "cluster": Cluster,
    "training": Training,
    "strategy": Strategy,
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "schema",
        help="print the JSON Schema of a document type",
        description="Print the JSON Schema of a plan, model spec, cluster, training or "
        "strategy document (for editors and validation of hand-written files).",
    )
    parser.add_argument(
        "document", nargs="?", default="plan", choices=sorted(DOCUMENTS),
        help="which document (default: plan)",
    )  # fmt: skip
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print(dumps_json(DOCUMENTS[args.document].model_json_schema(), what="the schema"))
    return 0
