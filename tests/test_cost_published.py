"""Every published training run in the shared CSV must come out as fitting (they ran)."""

import pytest

from planner.cost import estimate_run
from tests.benchmark_modules import load_benchmark


def test_every_published_run_fits():
    bench = load_benchmark("bench_accuracy")
    if not bench.DEFAULT_CSV.is_file():
        pytest.skip(f"published runs CSV not present at {bench.DEFAULT_CSV}")
    cases = bench.load_cases(bench.DEFAULT_CSV)
    assert len(cases) >= 40
    misfits = [case.label for case in cases if not estimate_run(case.config).fits]
    assert misfits == []
