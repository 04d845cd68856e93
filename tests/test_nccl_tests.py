"""Reading nccl-tests output, and ``plan calibrate --nccl-tests`` fitting a profile's links to it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from planner.calibrate import CalibrationError
from planner.calibrate.links import table_error
from planner.calibrate.nccl_tests import parse_nccl_tests, read_nccl_tests
from planner.cost.communication import Algorithm, Collective
from planner.hardware import load_profile

DATA = Path(__file__).resolve().parent / "data" / "nccl_tests"
EFA = DATA / "p5_efa_2node_all_reduce.txt"
RING = DATA / "ib_2node_ring_all_reduce.txt"


def test_a_two_node_table_reads_its_ranks_nodes_and_out_of_place_times() -> None:
    [table] = read_nccl_tests(EFA)
    assert (table.kind, table.ranks, table.nodes, table.per_node) == (
        Collective.ALL_REDUCE, 16, 2, 8,
    )  # fmt: skip
    assert table.device == "NVIDIA H100 80GB HBM3"
    assert table.algorithm is None
    assert table.rows[0] == (8192, pytest.approx(81.44e-6))
    assert table.rows[-1] == (17179869184, pytest.approx(66132e-6))
    assert len(table.rows) == 22
    assert {s.tier for s in table.samples} == {"inter_node"}


def test_a_run_that_forced_rings_is_priced_as_rings() -> None:
    [table] = read_nccl_tests(RING)
    assert table.algorithm is Algorithm.RING
    assert all(s.algorithm is Algorithm.RING for s in table.samples)


def test_launcher_prefixes_and_several_tests_in_one_file() -> None:
    text = EFA.read_text()
    tagged = "\n".join(f"[1,0]<stdout>:{line}" for line in text.splitlines())
    labelled = "\n".join(f"0: {line}" for line in text.splitlines())
    gather = text.replace("all_reduce_perf", "all_gather_perf").replace(" sum ", " none")
    expected = parse_nccl_tests(text, "run.log")
    assert parse_nccl_tests(tagged, "run.log") == expected
    assert parse_nccl_tests(labelled, "run.log") == expected
    both = parse_nccl_tests(text + gather, "run.log")
    assert [t.kind for t in both] == [Collective.ALL_REDUCE, Collective.ALL_GATHER]
    assert both[1].rows == expected[0].rows


def test_older_outputs_are_named_by_their_file() -> None:
    text = re.sub(r"^# Collective test starting.*\n", "", EFA.read_text(), flags=re.M)
    [table] = parse_nccl_tests(text, "reduce_scatter_perf.txt")
    assert table.kind is Collective.REDUCE_SCATTER
    with pytest.raises(CalibrationError, match="name the file after the test"):
        parse_nccl_tests(text, "node1.log")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: re.sub(r"^#\s+Rank.*\n", "", t, flags=re.M), "keep the whole output"),
        (lambda t: t.replace("      0    81.44", "      3    81.44"), "3 wrong results at 8192 bytes"),
        (lambda t: t.replace("p5-st-p5-2 device  7", "p5-st-p5-3 device  7"), "as many GPUs on every node"),
        (lambda t: t.replace("all_reduce_perf", "reduce_perf"), "reduce_perf is not a collective"),
        (lambda t: t + "\nNCCL INFO NCCL_ALGO set by environment to NVLS\n", "NCCL_ALGO was set to nvls"),
        (lambda t: "\n".join(line for line in t.splitlines() if "float" not in line), "0 timed sizes"),
    ],
)  # fmt: skip
def test_outputs_that_are_not_a_measurement_say_what_to_do(edit: object, message: str) -> None:
    with pytest.raises(CalibrationError, match=message):
        parse_nccl_tests(edit(EFA.read_text()), "run.log")  # type: ignore[operator]


def _calibrate(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "planner", "calibrate", *map(str, args)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip


def test_calibrate_fits_the_network_to_a_clusters_nccl_tests(tmp_path: Path) -> None:
    out = tmp_path / "my-h100.json"
    done = _calibrate("--base", "h100-sxm-80gb", "--nccl-tests", EFA, RING, "-o", out)
    assert done.returncode == 0, done.stderr
    fitted, base = load_profile(str(out)), load_profile("h100-sxm-80gb")
    assert fitted.name == "my-h100"
    assert fitted.links.intra_node == base.links.intra_node  # no single-node table given
    assert fitted.links.inter_node != base.links.inter_node
    source = fitted.sources["links.inter_node.launch_us"]
    assert "p5_efa_2node_all_reduce.txt" in source and "--nccl-tests" in source
    for path in (EFA, RING):
        samples = read_nccl_tests(path)[0].samples
        assert table_error(samples, fitted) < table_error(samples, base)
    assert re.search(
        r"p5_efa_2node_all_reduce\.txt: all_reduce over 16 ranks on 2 nodes", done.stdout
    )
    assert "links.inter_node.launch_us" in done.stdout
    assert "h100-sxm-80gb's links fitted to nccl-tests run on NVIDIA H100 80GB HBM3" in done.stdout


def test_calibrate_nccl_tests_needs_a_base_and_no_runs(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    done = _calibrate("--nccl-tests", EFA, "-o", out)
    assert done.returncode != 0 and "--nccl-tests needs --base PROFILE" in done.stderr
    done = _calibrate("--base", "h100-sxm-80gb", "--nccl-tests", EFA, "--from", "m.json", "-o", out)
    assert done.returncode != 0 and "one after the other" in done.stderr
    done = _calibrate("--base", "h100-sxm-80gb", "--nccl-tests", tmp_path / "none.txt", "-o", out)
    assert done.returncode != 0 and "none.txt: cannot read it" in done.stderr
    assert not out.exists()


def test_a_calibrated_profile_plans(tmp_path: Path) -> None:
    out = tmp_path / "my-h100.json"
    assert _calibrate("--base", "h100-sxm-80gb", "--nccl-tests", EFA, "-o", out).returncode == 0
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"gpu": str(out), "num_gpus": 16, "gpus_per_node": 8}))
    done = subprocess.run(
        [sys.executable, "-m", "planner", "--model", "llama3-8b", "--cluster", str(cluster),
         "--global-batch", "64", "--seq", "4096", "-o", str(tmp_path / "plan.json")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
