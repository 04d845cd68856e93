"""Every export the exporter accepts is accepted by that framework release's own parser.

The plans and the parser runs are ``benchmarks/bench_exports.py``'s: torchtitan's
``ConfigManager`` + ``ParallelDims`` + ``parallelize_llama`` on meta, Megatron-LM's
``parse_args`` + ``validate_args`` + ``TransformerConfig``, DeepSpeed's ``DeepSpeedConfig``,
each in the Python of its own venv. A release is skipped unless its variable names that
Python (``PLANNER_PARSER_TORCHTITAN_0_3=/venvs/tt03/bin/python``, ``megatron==0.16`` ->
``PLANNER_PARSER_MEGATRON_0_16=PYTHON:MEGATRON_LM_CHECKOUT``; see the benchmark's
docstring for the list and the README's exports section for the installs).
"""

from __future__ import annotations

import functools

import pytest

from tests.benchmark_modules import load_benchmark


def _bench():
    return load_benchmark("bench_exports")


@functools.cache
def _plans():
    return {case.label: case.plan() for case in _bench().CASES}


@pytest.mark.slow
@pytest.mark.parametrize("target", _bench().targets(), ids=str)
def test_every_accepted_export_parses(target) -> None:
    bench = _bench()
    if bench.Parser.find(target) is None:
        pytest.skip(f"no {target} parser: set {bench.variable(target)}")
    plans = _plans()
    found = bench.outcomes(target, list(plans.values()))
    assert any(outcome.verdict == "accepted" for outcome in found)
    rejected = [
        f"{label}: {outcome.detail}"
        for label, outcome in zip(plans, found, strict=True)
        if outcome.verdict not in ("accepted", "refused")
    ]
    assert rejected == []
