"""Fuzzing the ``plan`` command: every subcommand fed malformed files, absurd numbers and
bad output paths.

Each case must end with status 2 and exactly one line starting ``error:`` on stderr
(or with status 0 and a correct result), never a ``Traceback``, within 10 seconds.
Most cases run in-process through :func:`planner.cli.main`; a few run as real
processes (marked ``slow``), among them Ctrl-C during a search. The good plan is the
stored ``plan -o`` output of tiny-llama (``tests/golden``). ``plan run`` and ``plan
measure`` start ``torch.distributed`` only after their inputs are checked, so no case
here trains anything.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.cli import main
from planner.measured import MeasuredProfile, Provenance, plan_fingerprint
from planner.spec import Plan, load_document
from tests.test_io import BAD_OUTPUTS, bad_output_path

ROOT = Path(__file__).resolve().parents[1]
GOLDEN_PLAN = ROOT / "tests" / "golden" / "tiny-llama-2.json"
TIME_LIMIT_S = 10.0

# Malformed documents, by name: each is written as <name>.json and fed where a file goes.
MALFORMED: dict[str, bytes] = {
    "binary": bytes(range(256)) * 8,
    "latin1": '{"model_name": "caf\xe9"}'.encode("latin-1"),
    "utf16": '{"schema_version": 1}'.encode("utf-16"),
    "truncated": b'{"schema_version": 1, "planner_version": "0.1", "model_na',
    "deep-array": b"[" * 100_000 + b"]" * 100_000,
    "deep-object": b'{"a": ' * 20_000 + b"1" + b"}" * 20_000,
    "nesting-65": b"[" * 65 + b"]" * 65,
    "nan": b'{"schema_version": 1, "num_layers": NaN}',
    "infinity": b'{"peak_tflops": {"bf16": -Infinity}}',
    "overflow": b'{"hidden_size": 1e999}',
    "huge-int": b'{"num_layers": ' + b"9" * 5000 + b"}",
    "wrong-type": b"[1, 2, 3]",
    "string": b'"plan.json"',
    "null": b"null",
    "empty": b"",
    "whitespace": b" \n\t ",
    "bom-object": b'\xef\xbb\xbf{"schema_version": 1}',
    "wrong-fields": b'{"schema_version": "one", "num_gpus": "many", "strategy": []}',
    "bad-trace": b'{"traceEvents": [{"ph": "X", "dur": "abc", "ts": 1, "name": "ProfilerStep#1"}]}',
    "trace-without-ts": b'{"traceEvents": [{"ph": "X", "dur": 5, "name": "aten::mm"}]}',
}
# Ways a path can fail to be a readable file.
NOT_FILES = ("directory", "missing", "fifo", "device")

# ModelSpec, Cluster, hardware profile and run-config fields past the bounds, or nonsense.
LLAMA = {"family": "llama", "num_layers": 2, "hidden_size": 64, "num_heads": 4,
         "vocab_size": 128, "seq_len": 32}  # fmt: skip
ABSURD_SPECS = [
    {"num_layers": 100_000}, {"num_layers": 10**7}, {"hidden_size": 10**7, "num_heads": 1},
    {"num_heads": 10**6}, {"vocab_size": 10**9}, {"seq_len": 10**8}, {"num_layers": 0},
    {"num_layers": -3}, {"num_layers": 2.5}, {"num_layers": "two"}, {"norm_eps": 0},
    {"family": "mamba"}, {"num_kv_heads": 3}, {"ffn_hidden_size": 10**9},
]  # fmt: skip
ABSURD_CLUSTERS = [
    {"gpu": "h100-sxm-80gb", "num_gpus": 10**7},
    {"gpu": "h100-sxm-80gb", "num_gpus": 8, "gpus_per_node": 10**5},
    {"gpu": "h100-sxm-80gb", "num_gpus": 8, "inter_node_GBps": -1},
    {"gpu": "h100-sxm-80gb", "num_gpus": 8, "intra_node_GBps": 1e-320},
    {"gpu": "h100-sxm-80gb", "num_gpus": 0},
    {"gpu": "no-such-gpu", "num_gpus": 8},
    {"gpu": 7, "num_gpus": 8},
]
ABSURD_PROFILE_FIELDS = [
    {"peak_tflops": {"bf16": 0}}, {"peak_tflops": {"bf16": -100}},
    {"peak_tflops": {"bf16": 1e300}}, {"peak_tflops": {}}, {"matmul_efficiency": 0},
    {"matmul_efficiency": 2}, {"memory_capacity_gib": 0}, {"memory_bandwidth_GBps": -1},
    {"kernel_overhead_us": -1}, {"gpus_per_node": 0},
]  # fmt: skip
ABSURD_RUNS = [
    {"model": {"preset": "gpt3-175b", "num_layers": 10**7}},
    {"training": {"global_batch_size": 10**18}},
    {"training": {"global_batch_size": 1536, "micro_batch_size": 10**12}},
    {"cluster": {"gpu": "a100-sxm-80gb", "num_gpus": 10**9}},
    {"strategy": {"dp": 10**9, "tp": 8, "pp": 16}},
    {"options": "options.json"},
    {"model": 5},
    {"unknown": {}},
]
RUN = {
    "model": {"preset": "gpt3-175b"},
    "cluster": {"gpu": "a100-sxm-80gb", "num_gpus": 1024},
    "training": {"global_batch_size": 1536, "micro_batch_size": 1},
    "strategy": {"dp": 8, "tp": 8, "pp": 16, "recompute": "full"},
}

SEARCH = ["--model", "tiny-llama", "--gpus", "2", "--global-batch", "8", "--seq", "32"]
# Absurd numbers on the command line, per subcommand (the plan file is filled in).
ABSURD_ARGS = [
    ["--model", "tiny-llama", "--gpus", "2", "--global-batch", "0"],
    ["--model", "tiny-llama", "--gpus", "2", "--global-batch", "-8"],
    ["--model", "tiny-llama", "--gpus", "2", "--global-batch", "1e3"],
    ["--model", "tiny-llama", "--gpus", "2", "--global-batch", "nan"],
    ["--model", "tiny-llama", "--gpus", "2", "--global-batch", str(10**18)],
    ["--model", "tiny-llama", "--gpus", "2", "--global-batch", "9" * 5000],
    ["--model", "tiny-llama", "--gpus", "0", "--global-batch", "8"],
    ["--model", "tiny-llama", "--gpus", str(2**21), "--global-batch", "8"],
    [*SEARCH, "--micro-batch", str(10**9)],
    [*SEARCH, "--tp", str(10**7)],
    [*SEARCH, "--gpus-per-node", str(10**5)],
    [*SEARCH, "--virtual-stages", str(10**5)],
    [*SEARCH, "--top-k", str(10**9)],
    [*SEARCH, "--seq", str(10**8)],
    [*SEARCH, "--zero", "7"],
    [*SEARCH, "--dtype", "fp4"],
    [*SEARCH, "--allow-lossy-compression", "powersgd:nan"],
    [*SEARCH, "--bogus"],
    ["trace", "--model", "tiny-llama", "--batch", "0"],
    ["trace", "--model", "tiny-llama", "--batch", str(10**12)],
    ["trace", "--model", "tiny-llama", "--seq", "-1"],
    ["run", "{plan}", "--lr", "nan"],
    ["run", "{plan}", "--lr", "inf"],
    ["run", "{plan}", "--lr", "-1"],
    ["run", "{plan}", "--lr", "0"],
    ["run", "{plan}", "--steps", "0"],
    ["run", "{plan}", "--steps", str(10**12)],
    ["run", "{plan}", "--seed", "-1"],
    ["run", "{plan}", "--seed", str(2**70)],
    ["measure", "{plan}", "-o", "{tmp}/m.json", "--warmup", "-1"],
    ["measure", "{plan}", "-o", "{tmp}/m.json", "--steps", "0"],
    ["calibrate", "-o", "{tmp}/p.json", "--peak-tflops", "nan"],
    ["calibrate", "-o", "{tmp}/p.json", "--peak-tflops", "0"],
    ["calibrate", "-o", "{tmp}/p.json", "--peak-tflops", "-5"],
    ["calibrate", "-o", "{tmp}/p.json", "--peak-tflops", "1e300"],
    ["export", "{plan}", "--to", "jax"],
    ["schema", "bogus"],
    ["--model", ":", "--gpus", "2", "--global-batch", "8"],
    ["--model", "json:loads", "--gpus", "2", "--global-batch", "8"],
    ["--model", "os:getcwd", "--gpus", "2", "--global-batch", "8"],
    ["--model", "no_such_module_xyz:build", "--gpus", "2", "--global-batch", "8"],
    ["--model", "tests.test_fuzz_cli:raising_model", "--gpus", "2", "--global-batch", "8"],
]


def raising_model() -> object:
    """A ``module:function`` model whose call fails (``--model tests.test_fuzz_cli:...``)."""
    raise RuntimeError("the weights server is down\n(second line)")


def sleepy_model() -> object:
    """A model function that signals it runs, then sleeps: the Ctrl-C test interrupts it."""
    Path(os.environ["PLAN_FUZZ_MARKER"]).write_text("started")
    time.sleep(60)
    raise AssertionError("not interrupted")


# ----- running ---------------------------------------------------------------------------


def run_plan(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``plan ARGV`` in-process: (status, stdout, stderr), checked for time."""
    capsys.readouterr()
    started = time.perf_counter()
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse: bad arguments (2), --help (0)
        status = exc.code if isinstance(exc.code, int) else 1
    elapsed = time.perf_counter() - started
    out, err = capsys.readouterr()
    assert elapsed < TIME_LIMIT_S, f"plan {' '.join(argv)[:200]} took {elapsed:.1f} s"
    return status, out, err


def assert_clean(status: int, out: str, err: str, argv: list[str]) -> None:
    """Status 0, or status 2 with exactly one ``error:`` line; never a traceback."""
    shown = " ".join(argv)[:200]
    assert "Traceback" not in err + out, f"plan {shown}:\n{err[-2000:]}"
    assert status in (0, 2), f"plan {shown}: status {status}\n{err[-2000:]}"
    if status == 2:
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, f"plan {shown}: stderr is\n{err[-2000:]}"
        assert len(errors[0]) < 2000, f"plan {shown}: a very long error line"


def assert_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """``plan ARGV`` exits 2 with one ``error:`` line; returns that line."""
    status, out, err = run_plan(argv, capsys)
    assert_clean(status, out, err, argv)
    assert status == 2, f"plan {' '.join(argv)[:200]} was accepted:\n{out[-1000:]}"
    return next(line for line in err.splitlines() if line.startswith("error:"))


# ----- files -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every malformed document and non-file, by name; and a good plan and measurement."""
    folder = tmp_path_factory.mktemp("fuzz")
    paths = {}
    for name, data in MALFORMED.items():
        paths[name] = folder / f"{name}.json"
        paths[name].write_bytes(data)
    paths["directory"] = folder / "directory.json"
    paths["directory"].mkdir()
    paths["missing"] = folder / "missing.json"
    paths["fifo"] = folder / "fifo.json"
    os.mkfifo(paths["fifo"])
    paths["device"] = Path("/dev/zero")
    plan = load_document(Plan, GOLDEN_PLAN)
    paths["plan"] = folder / "plan.json"
    paths["plan"].write_text(plan.to_json())
    paths["measured"] = folder / "measured.json"
    paths["measured"].write_text(_measured(plan).model_dump_json())
    return paths


def _measured(plan: Plan) -> MeasuredProfile:
    return MeasuredProfile(
        model_name=plan.model_name, model_fingerprint=plan.model_fingerprint,
        plan_fingerprint=plan_fingerprint(plan), plan=plan, world_size=plan.strategy.world_size,
        warmup_steps=1, step_times_s=(0.1,), step_time_median_s=0.1, step_time_p10_s=0.1,
        step_time_p90_s=0.1, peak_memory_gib=(0.1,) * plan.strategy.world_size,
        provenance=Provenance(host="h", date="2026-01-01", torch_version="t", device="cpu",
                              method="synthetic"),
    )  # fmt: skip


def _file_commands(bad: str, paths: dict[str, Path], tmp: Path) -> Iterator[list[str]]:
    """Every place a subcommand reads a file, with ``bad`` there."""
    cluster = tmp / "cluster-with-bad-profile.json"
    cluster.write_text(json.dumps({"gpu": bad, "num_gpus": 2, "gpus_per_node": 2}))
    yield ["explain", bad]
    for target in ("torchtitan", "megatron", "deepspeed"):
        yield ["export", bad, "--to", target]
    yield ["estimate", "--config", bad]
    yield ["estimate", "--plan", bad]
    yield ["search", "--model", bad, "--gpus", "2", "--global-batch", "8"]
    yield ["--model", "tiny-llama", "--cluster", bad, "--global-batch", "8"]
    yield ["--model", "tiny-llama", "--cluster", str(cluster), "--global-batch", "8"]
    yield ["trace", "--model", bad]
    yield ["trace", "--hf-config", bad]
    yield ["run", bad]
    yield ["measure", bad, "-o", str(tmp / "measured-out.json")]
    yield ["compare", bad, str(paths["measured"])]
    yield ["compare", str(paths["plan"]), bad]
    yield ["compare", str(paths["plan"]), str(paths["measured"]), "--profile", bad]
    yield ["calibrate", "--profile", bad, "--from", str(paths["measured"]),
           "-o", str(tmp / "p.json")]  # fmt: skip
    yield ["calibrate", "--profile", "h100-sxm-80gb", "--from", bad, "-o", str(tmp / "p.json")]


@pytest.mark.parametrize("argv", [["profiles"], ["models"], ["schema", "model"], ["--version"]])
def test_commands_without_input_files_succeed(argv: list[str], capsys) -> None:
    status, out, err = run_plan(argv, capsys)
    assert (status, err) == (0, "") and out


@pytest.mark.parametrize("name", [*MALFORMED, *NOT_FILES])
def test_every_reader_refuses_a_malformed_file(
    name: str, files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv in _file_commands(str(files[name]), files, tmp_path):
        assert_refused(argv, capsys)
    assert not (tmp_path / "p.json").exists() and not (tmp_path / "measured-out.json").exists()


def test_the_messages_say_what_is_wrong_with_the_file(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    expected = {
        "binary": "is not UTF-8 text (byte 0x80 at offset 128)",
        "truncated": "is not valid JSON",
        "deep-array": "more than 64 levels deep",
        "deep-object": "more than 64 levels deep",
        "nesting-65": "more than 64 levels deep",
        "nan": "holds the number NaN, which is not finite",
        "infinity": "holds the number -Infinity, which is not finite",
        "overflow": "holds the number 1e999, which is not finite",
        "huge-int": "a number out of range",
        "empty": "is empty",
        "directory": "it is a directory",
        "missing": "it does not exist",
        "fifo": "it is a FIFO (named pipe), not a regular file",
        "device": "it is a character device, not a regular file",
    }
    for name, words in expected.items():
        line = assert_refused(["explain", str(files[name])], capsys)
        assert words in line and str(files[name]) in line, line


@pytest.mark.parametrize(
    ("document", "fields"),
    [("spec", f) for f in ABSURD_SPECS] + [("cluster", f) for f in ABSURD_CLUSTERS]
    + [("profile", f) for f in ABSURD_PROFILE_FIELDS] + [("run", f) for f in ABSURD_RUNS],
)  # fmt: skip
def test_absurd_values_in_documents_are_refused(
    document: str, fields: dict[str, object], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / f"{document}.json"
    if document == "spec":
        path.write_text(json.dumps({**LLAMA, **fields}))
        argvs = [["--model", str(path), "--gpus", "2", "--global-batch", "8"],
                 ["trace", "--model", str(path)]]  # fmt: skip
    elif document == "cluster":
        path.write_text(json.dumps(fields))
        argvs = [["--model", "tiny-llama", "--cluster", str(path), "--global-batch", "8"]]
    elif document == "profile":
        profile = json.loads((ROOT / "profiles" / "h100-sxm-80gb.json").read_text())
        path.write_text(json.dumps({**profile, **fields}))
        cluster = tmp_path / "cluster.json"
        cluster.write_text(json.dumps({"gpu": str(path), "num_gpus": 2}))
        argvs = [["--model", "tiny-llama", "--cluster", str(cluster), "--global-batch", "8"]]
    else:
        run = {**RUN, **fields}
        if isinstance(fields.get("model"), dict):
            run["model"] = {**RUN["model"], **fields["model"]}  # type: ignore[dict-item]
        path.write_text(json.dumps(run))
        argvs = [["estimate", "--config", str(path)]]
    for argv in argvs:
        assert_refused(argv, capsys)


@pytest.mark.parametrize("argv", ABSURD_ARGS, ids=lambda a: " ".join(a)[:60])
def test_absurd_arguments_are_refused(
    argv: list[str], files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [a.format(plan=files["plan"], tmp=tmp_path) for a in argv]
    line = assert_refused(argv, capsys)
    if "raising_model" in " ".join(argv):
        assert "RuntimeError: the weights server is down (second line)" in line


def test_bounds_name_the_limit_and_why(files: dict[str, Path], capsys) -> None:
    line = assert_refused([*SEARCH[:4], "--global-batch", str(10**18)], capsys)
    assert f"{10**18} > 100000000: the largest published runs" in line
    line = assert_refused(["run", str(files["plan"]), "--lr", "nan"], capsys)
    assert line == (
        "error: argument --lr: expected a positive finite number, got 'nan'; see 'plan run --help'"
    )


# ----- outputs ---------------------------------------------------------------------------


def _output_commands(bad: str, files: dict[str, Path]) -> Iterator[tuple[str, list[str]]]:
    plan, measured = str(files["plan"]), str(files["measured"])
    yield "--output", [*SEARCH, "-o", bad]
    yield "--plot", [*SEARCH, "--plot", bad]
    yield "--output", ["export", plan, "--to", "torchtitan", "-o", bad]
    yield "--output", ["calibrate", "-o", bad]
    yield "--output", ["calibrate", "--profile", "h100-sxm-80gb", "--from", measured, "-o", bad]
    yield "--output", ["measure", plan, "-o", bad]
    yield "--plot", ["compare", plan, measured, "--plot", bad]


@pytest.mark.parametrize("kind", BAD_OUTPUTS)
def test_bad_output_paths_are_refused_before_the_work(
    kind: str, files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = bad_output_path(kind, tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    for option, argv in _output_commands(bad, files):
        line = assert_refused(argv, capsys)
        assert option in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written
    if kind in ("symlink", "read-only"):
        kept = tmp_path / ("target.json" if kind == "symlink" else "locked.json")
        assert kept.read_text() == "keep"


# ----- generated inputs ------------------------------------------------------------------


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.binary(max_size=300))
def test_random_bytes_are_refused(data: bytes, tmp_path: Path, capsys) -> None:
    path = tmp_path / "random.json"
    path.write_bytes(data)
    for argv in (["explain", str(path)], ["estimate", "--config", str(path)],
                 ["trace", "--model", str(path)]):  # fmt: skip
        status, out, err = run_plan(argv, capsys)
        assert_clean(status, out, err, argv)
        assert status == 2


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)  # fmt: skip


def _leaves(value: object, path: tuple[object, ...] = ()) -> Iterator[tuple[object, ...]]:
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _leaves(child, (*path, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from _leaves(child, (*path, index))
    else:
        yield path


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(pick=st.integers(min_value=0), value=_JSON)
def test_a_plan_with_one_field_replaced_is_explained_or_refused(
    pick: int, value: object, files: dict[str, Path], tmp_path: Path, capsys
) -> None:
    plan = json.loads(files["plan"].read_text())
    leaves = list(_leaves(plan))
    where = leaves[pick % len(leaves)]
    holder = plan
    for key in where[:-1]:
        holder = holder[key]
    holder[where[-1]] = value
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(plan))
    status, out, err = run_plan(["explain", str(path)], capsys)
    assert_clean(status, out, err, ["explain", f"(plan with {where} = {value!r})"])


def test_interrupt_exits_130_with_one_line(monkeypatch, capsys) -> None:
    import planner.cli.profiles

    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(planner.cli.profiles, "run", interrupted)  # bound when parsing
    status, out, err = run_plan(["profiles"], capsys)
    assert (status, out, err) == (130, "", "interrupted\n")


# ----- real processes --------------------------------------------------------------------


def _plan_process(args: list[str], **kwargs: object) -> subprocess.Popen[str]:
    """``plan ARGS`` in a child process that takes Ctrl-C as a terminal's would: a
    shell without job control starts background jobs with SIGINT ignored, and Python
    then installs no KeyboardInterrupt handler."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **kwargs.pop("env", {})}  # type: ignore[dict-item]
    return subprocess.Popen(
        [sys.executable, "-m", "planner", *args], cwd=ROOT, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        ["explain", "{binary}"],
        ["estimate", "--config", "{deep-array}"],
        ["--model", "llama3-8b", "--gpus", "8", "--global-batch", str(10**18)],
        ["run", "{plan}", "--lr", "nan"],
        ["--model", "tiny-llama", "--gpus", "2", "--global-batch", "8", "-o", "/dev/null"],
        ["export", "{plan}", "--to", "megatron", "-o", ""],
    ],
    ids=lambda a: " ".join(a)[:50],
)
def test_real_processes_print_one_error_line(args: list[str], files: dict[str, Path]) -> None:
    args = [a.format_map({k: str(v) for k, v in files.items()}) for a in args]
    started = time.perf_counter()
    process = _plan_process(args)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 2, err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert "Traceback" not in out + err
    assert time.perf_counter() - started < 30  # a fresh interpreter imports torch


@pytest.mark.slow
def test_ctrl_c_during_a_search_exits_130_and_writes_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "started"
    out = tmp_path / "plan.json"
    process = _plan_process(
        ["--model", "tests.test_fuzz_cli:sleepy_model", "--gpus", "2", "--global-batch", "8",
         "-o", str(out)],
        env={"PLAN_FUZZ_MARKER": str(marker)},
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), process.communicate()[1]
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=30)
    assert (process.returncode, err) == (130, "interrupted\n")
    assert not out.exists()
