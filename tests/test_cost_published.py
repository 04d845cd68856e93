"""Every published training run in the shared CSV must come out as fitting (they ran)."""

import importlib.util
import sys
from pathlib import Path

import pytest

from planner.cost import estimate_run

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_accuracy.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_accuracy", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_every_published_run_fits():
    bench = _bench()
    if not bench.DEFAULT_CSV.is_file():
        pytest.skip(f"published runs CSV not present at {bench.DEFAULT_CSV}")
    cases = bench.load_cases(bench.DEFAULT_CSV)
    assert len(cases) >= 40
    misfits = [case.label for case in cases if not estimate_run(case.config).fits]
    assert misfits == []
