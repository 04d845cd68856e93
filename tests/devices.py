"""A test device on which tensor parallelism pays even for tiny layers.

Slow compute and a fast link with no latency: the planner shards what it can, so the
tests exercise real layouts on tiny models.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["TP_PAYS", "write_tp_pays"]

TP_PAYS: dict[str, Any] = {
    "schema_version": 1, "name": "tp-pays", "description": "test device: TP always pays",
    "device_kind": "gpu", "peak_tflops": {"bf16": 1e-3, "fp16": 1e-3, "fp8": 2e-3, "fp32": 1e-3},
    "matmul_efficiency": 0.5, "matmul_overhead_us": 0.0, "attention_efficiency": 0.5,
    "memory_capacity_gib": 80.0, "memory_bandwidth_GBps": 0.01, "memory_efficiency": 1.0,
    "kernel_overhead_us": 0.0, "gpus_per_node": 8,
    "links": {
        "intra_node": {"bandwidth_GBps": 1e6, "latency_us": 0.0, "busbw_efficiency": 1.0},
        "inter_node": {"bandwidth_GBps": 1e6, "latency_us": 0.0, "busbw_efficiency": 1.0},
    },
}  # fmt: skip


def write_tp_pays(directory: Path) -> Path:
    """Write the device's hardware profile (every number sourced) into ``directory``."""
    path = directory / "tp-pays.json"
    path.write_text(
        json.dumps(dict(TP_PAYS, sources={k: "test device" for k in _numbers(TP_PAYS)}))
    )
    return path


def _numbers(document: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for key, value in document.items():
        if isinstance(value, dict):
            keys += _numbers(value, f"{prefix}{key}.")
        elif (
            isinstance(value, float | int)
            and not isinstance(value, bool)
            and key != "schema_version"
        ):
            keys.append(f"{prefix}{key}")
    return keys
