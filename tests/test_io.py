"""planner.io: what every reader refuses, strict JSON, output-path checks, atomic writes."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

import pytest

from planner.errors import SpecError
from planner.io import (
    MAX_JSON_DEPTH,
    check_output_path,
    document_json,
    dumps_json,
    parse_json,
    read_bytes,
    read_json,
    read_text,
    write_bytes_atomic,
    write_text_atomic,
)
from planner.spec import Prediction, Training, load_document

# ----- reading -----------------------------------------------------------------------------


def test_read_text_decodes_utf8_and_skips_a_byte_order_mark(tmp_path: Path) -> None:
    path = tmp_path / "doc.json"
    path.write_bytes(b'\xef\xbb\xbf{"name": "caf\xc3\xa9"}')
    assert read_text(path, what="Plan file") == '{"name": "café"}'
    assert read_json(path, what="Plan file") == {"name": "café"}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\xff\xfe{", r"Plan file .*doc\.json is not UTF-8 text \(byte 0xff at offset 0\)"),
        ('{"a": "é"}'.encode("latin-1"), r"byte 0xe9 at offset 7"),
    ],
)
def test_non_utf8_is_named_with_the_byte_and_the_fix(tmp_path: Path, data, message) -> None:
    path = tmp_path / "doc.json"
    path.write_bytes(data)
    with pytest.raises(SpecError, match=message) as info:
        read_json(path, what="Plan file")
    assert "save it as UTF-8" in str(info.value)


def test_missing_directory_and_special_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"cannot read Plan file .*nope\.json: it does not exist"):
        read_bytes(tmp_path / "nope.json", what="Plan file")
    with pytest.raises(SpecError, match="it is a directory; give the file inside it"):
        read_bytes(tmp_path, what="Plan file")
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(SpecError, match=r"it is a FIFO \(named pipe\), not a regular file"):
        read_bytes(tmp_path / "pipe", what="Plan file")  # refused, never blocks
    with pytest.raises(SpecError, match="it is a character device"):
        read_bytes("/dev/zero", what="Plan file")
    with pytest.raises(SpecError, match="name is empty"):
        read_bytes("", what="Plan file")


def test_a_file_over_the_size_limit_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "big.json"
    path.write_bytes(b" " * 2000)
    with pytest.raises(SpecError, match=r"it is 2,000 bytes, more than the 1,000 bytes"):
        read_bytes(path, what="Plan file", max_bytes=1000)
    assert len(read_bytes(path, what="Plan file", max_bytes=2000)) == 2000


def test_unreadable_file_is_named(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads any file")
    path = tmp_path / "secret.json"
    path.write_text("{}")
    path.chmod(0)
    with pytest.raises(SpecError, match="Permission denied"):
        read_bytes(path, what="Plan file")


# ----- strict JSON -------------------------------------------------------------------------


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999", "-1e400"])
def test_non_finite_numbers_are_refused(literal: str) -> None:
    with pytest.raises(SpecError, match=f"holds the number {literal}, which is not finite"):
        parse_json(f'{{"x": [1, {literal}]}}', "doc.json", what="Plan file")


def test_other_programs_files_may_hold_non_finite_numbers() -> None:
    assert math.isinf(parse_json('{"x": Infinity}', "config.json", finite=False)["x"])


def test_nesting_is_bounded_and_never_a_recursion_error() -> None:
    for depth in (MAX_JSON_DEPTH + 1, 5000, 100_000):
        with pytest.raises(SpecError, match=f"more than {MAX_JSON_DEPTH} levels deep"):
            parse_json("[" * depth + "]" * depth, "deep.json")
    with pytest.raises(SpecError, match="levels deep"):
        parse_json('{"a": ' * 100 + "1" + "}" * 100, "deep.json")


def test_deepest_allowed_document_parses() -> None:
    value = parse_json("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH, "ok.json")
    depth = 0
    while isinstance(value, list):
        depth += 1
        value = value[0] if value else None
    assert depth == MAX_JSON_DEPTH


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", r"doc\.json is empty"),
        ("  \n", "is empty"),
        ('{"a": 1', r"is not valid JSON \(Expecting ',' delimiter at line 1 column 8\)"),
        ("{'a': 1}", "is not valid JSON"),
        ('{"a": ' + "9" * 5000 + "}", "holds a number out of range"),
    ],
)
def test_malformed_json_says_where(text: str, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse_json(text, "doc.json", what="Plan file")


# ----- JSON out ----------------------------------------------------------------------------


def test_dumps_json_never_emits_non_finite_numbers() -> None:
    assert dumps_json({"a": [1.5, 2]}) == json.dumps({"a": [1.5, 2]}, indent=2)
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(SpecError, match=r"summary: a\[1\]\.b is not a finite number"):
            dumps_json({"a": [0, {"b": bad}]}, what="summary")


def test_documents_refuse_non_finite_numbers_in_and_out() -> None:
    fields = dict(step_time_s=1.0, tokens_per_s_per_gpu=1.0, model_tflops_per_gpu=1.0, mfu=0.5,
                  hfu=0.5, flop_convention="6N", peak_memory_gib=1.0, memory_limit_gib=80.0,
                  fits=True)  # fmt: skip
    with pytest.raises(ValueError, match="finite number"):
        Prediction(**{**fields, "mfu": math.nan})
    sneaked = Prediction(**fields).model_copy(update={"step_time_s": math.inf})  # no validation
    with pytest.raises(SpecError, match="step_time_s is not a finite number"):
        sneaked.to_json()
    with pytest.raises(SpecError, match="is not a finite number"):
        document_json(sneaked)


# ----- output paths ------------------------------------------------------------------------


def test_a_new_file_in_a_writable_directory_is_accepted(tmp_path: Path) -> None:
    assert check_output_path(str(tmp_path / "plan.json")) == tmp_path / "plan.json"
    (tmp_path / "old.json").write_text("old")
    assert check_output_path(tmp_path / "old.json", option="-o") == tmp_path / "old.json"


def test_a_relative_path_in_the_current_directory_is_accepted(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert check_output_path("plan.json") == Path("plan.json")


def bad_output_path(kind: str, tmp: Path) -> str:
    """A path of the ``kind`` in ``tmp`` that no file can be written to."""
    if kind == "empty":
        return ""
    if kind == "directory":
        return str(tmp)
    if kind == "trailing-slash":
        return f"{tmp}/new/"
    if kind == "missing-parent":
        return str(tmp / "no" / "out.json")
    if kind == "parent-is-file":
        (tmp / "file").write_text("x")
        return str(tmp / "file" / "out.json")
    if kind == "device":
        return "/dev/null"
    if kind == "fifo":
        os.mkfifo(tmp / "pipe")
        return str(tmp / "pipe")
    if kind == "symlink":
        (tmp / "target.json").write_text("keep")
        (tmp / "link.json").symlink_to(tmp / "target.json")
        return str(tmp / "link.json")
    if kind == "read-only":
        (tmp / "locked.json").write_text("keep")
        (tmp / "locked.json").chmod(0o444)
        return str(tmp / "locked.json")
    assert kind == "read-only-directory"
    (tmp / "locked").mkdir()
    (tmp / "locked").chmod(0o555)
    return str(tmp / "locked" / "out.json")


BAD_OUTPUTS = {
    "empty": r"--output is empty: give a file path",
    "directory": r"is a directory: give a file path, such as .*out\.json",
    "trailing-slash": r"ends in '/', so it names a directory",
    "missing-parent": r"directory .*/no does not exist; create it \(mkdir -p",
    "parent-is-file": r"/file is not a directory; give another path",
    "device": r"/dev/null is a character device, not a regular file.*leave --output out",
    "fifo": r"is a FIFO \(named pipe\), not a regular file",
    "symlink": r"is a symbolic link \(to .*target\.json\).*give the real path",
    "read-only": r"is read-only: make it writable \(chmod u\+w",
    "read-only-directory": r"directory .*locked is not writable",
}


@pytest.mark.parametrize("kind", BAD_OUTPUTS)
def test_bad_output_paths_are_refused_with_why_and_what_to_do(tmp_path: Path, kind: str) -> None:
    path = bad_output_path(kind, tmp_path)
    with pytest.raises(SpecError, match=BAD_OUTPUTS[kind]) as info:
        check_output_path(path, option="--output")
    assert str(info.value).startswith("--output")
    if kind != "trailing-slash":  # a Path drops the slash; the CLI checks the text
        with pytest.raises(SpecError):  # the writers check the same way
            write_text_atomic(Path(path), "new")
    if kind in ("symlink", "read-only"):
        assert (
            tmp_path / ("target.json" if kind == "symlink" else "locked.json")
        ).read_text() == "keep"


# ----- atomic writes -----------------------------------------------------------------------


def test_writes_are_atomic_and_leave_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    write_text_atomic(path, "first")
    write_text_atomic(path, "second")
    assert path.read_text() == "second"
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask


@pytest.mark.parametrize("failure", [KeyboardInterrupt, OSError(28, "No space left on device")])
def test_an_interrupted_or_failed_write_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: BaseException | type
) -> None:
    path = tmp_path / "plan.json"
    path.write_text("old")

    def fail(*args: object) -> None:
        raise failure  # type: ignore[misc]

    monkeypatch.setattr(os, "replace", fail)
    expected = SpecError if isinstance(failure, OSError) else KeyboardInterrupt
    with pytest.raises(expected) as info:  # type: ignore[type-var]
        write_bytes_atomic(path, b"new")
    if expected is SpecError:
        assert "No space left on device; nothing was written" in str(info.value)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_load_document_reads_through_the_io_layer(tmp_path: Path) -> None:
    path = tmp_path / "training.json"
    path.write_bytes(b'{"global_batch_size": NaN}')
    with pytest.raises(SpecError, match=r"Training file .*training\.json holds the number NaN"):
        load_document(Training, path)
    with pytest.raises(SpecError, match=r"Training \(text\) holds the number Infinity"):
        Training.from_json('{"global_batch_size": Infinity}')
