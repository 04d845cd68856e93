"""Files in and out: every document the planner reads or writes goes through here.

Reading (:func:`read_bytes`, :func:`read_text`, :func:`read_json`, :func:`parse_json`):

- only a regular file is read (a directory, device, FIFO or socket is refused, so a
  read never blocks), of at most :data:`MAX_DOCUMENT_BYTES` (64 MiB);
- text is UTF-8 (a leading byte-order mark is allowed);
- JSON is strict: at most :data:`MAX_JSON_DEPTH` (64) levels of nesting, numbers are
  finite (``NaN``, ``Infinity`` and overflowing literals such as ``1e999`` are refused)
  and integers have at most 4,300 digits (Python's limit).

Each refusal is a :class:`~planner.errors.SpecError` naming the file, what is wrong and
what to do.

Writing (:func:`check_output_path`, :func:`write_text_atomic`, :func:`write_bytes_atomic`):
an output path is checked before the work that produces it starts (the CLI calls
:func:`check_output_path` first), and again when written. Refused: an empty path, a path
ending in ``/``, an existing directory, an existing non-regular file (``/dev/null``, a
FIFO, a socket: a write replaces the file by rename, so it cannot go *through* one), a
symbolic link (the rename would replace the link, not write its target), an existing
read-only file, and a path whose directory is missing or not writable. The write itself
is atomic: a temporary file in the same directory, then a rename, so readers never see
half a file and a failed or interrupted write leaves the old file in place.

JSON is written by :func:`dumps_json` (``allow_nan=False``) and documents by
:func:`document_json`: a non-finite number is never emitted.
"""

from __future__ import annotations

import json
import math
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from planner.errors import SpecError

__all__ = [
    "MAX_DOCUMENT_BYTES",
    "MAX_JSON_DEPTH",
    "check_output_path",
    "document_json",
    "dumps_json",
    "parse_json",
    "read_bytes",
    "read_json",
    "read_text",
    "write_bytes_atomic",
    "write_text_atomic",
]

MAX_DOCUMENT_BYTES = 64 * 2**20  # the largest plan written so far is well under 1 MiB
MAX_JSON_DEPTH = 64  # a plan nests 5 levels deep, a measured profile 6


# ----- reading -----------------------------------------------------------------------------


def _kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _size(count: int) -> str:
    return f"{count / 2**20:.1f} MiB" if count >= 2**20 else f"{count:,} bytes"


def read_bytes(path: Path | str, *, what: str, max_bytes: int = MAX_DOCUMENT_BYTES) -> bytes:
    """The contents of the regular file ``path``, at most ``max_bytes`` of them;
    :class:`SpecError` naming the file otherwise. ``what`` names the file in messages
    ("Plan file", "--config"): "cannot read Plan file x.json: it does not exist"."""
    if os.fspath(path) == "":
        raise SpecError(f"{what} name is empty: give the path of a JSON file")
    path = Path(path)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise SpecError(f"cannot read {what} {path}: it does not exist; check the path") from None
    except OSError as exc:
        raise SpecError(f"cannot read {what} {path}: {exc.strerror}") from None
    if stat.S_ISDIR(info.st_mode):
        raise SpecError(f"cannot read {what} {path}: it is a directory; give the file inside it")
    if not stat.S_ISREG(info.st_mode):
        raise SpecError(
            f"cannot read {what} {path}: it is {_kind(info.st_mode)}, not a regular file; "
            "save its contents to a file and give that path"
        )
    if info.st_size > max_bytes:
        raise SpecError(
            f"cannot read {what} {path}: it is {_size(info.st_size)}, more than the "
            f"{_size(max_bytes)} a document may be; is it the right file?"
        )
    try:
        with open(path, "rb") as handle:
            data = handle.read(max_bytes + 1)
    except OSError as exc:
        raise SpecError(f"cannot read {what} {path}: {exc.strerror}") from None
    if len(data) > max_bytes:  # it grew since the stat
        raise SpecError(
            f"cannot read {what} {path}: it is more than the {_size(max_bytes)} a document may be"
        )
    return data


def _decode(data: bytes, source: str, what: str) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise SpecError(
            f"{what} {source} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
            f"{exc.start}): give the right file, or save it as UTF-8 (JSON files are UTF-8)"
        ) from None


def read_text(path: Path | str, *, what: str, max_bytes: int = MAX_DOCUMENT_BYTES) -> str:
    """The UTF-8 text of ``path`` (see :func:`read_bytes`)."""
    return _decode(read_bytes(path, what=what, max_bytes=max_bytes), str(path), what)


def read_json(
    path: Path | str,
    *,
    what: str,
    max_bytes: int = MAX_DOCUMENT_BYTES,
    finite: bool = True,
) -> Any:
    """The JSON value in ``path``, strictly parsed (see :func:`parse_json`)."""
    return parse_json(read_text(path, what=what, max_bytes=max_bytes), str(path), what=what,
                      finite=finite)  # fmt: skip


class _NonFinite(ValueError):
    def __init__(self, literal: str) -> None:
        super().__init__(literal)
        self.literal = literal


def _refuse_constant(literal: str) -> float:
    raise _NonFinite(literal)


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise _NonFinite(literal)
    return value


def parse_json(text: str, source: str, *, what: str = "JSON", finite: bool = True) -> Any:
    """``text`` as JSON, refusing what Python's ``json`` would take but a document must not
    hold: ``NaN``, ``Infinity`` and overflowing numbers (unless ``finite`` is False, for
    other programs' files), integers of more than 4,300 digits, and nesting deeper than
    :data:`MAX_JSON_DEPTH`. ``source`` names the text in messages (a path)."""
    if not text.strip():
        raise SpecError(f"{what} {source} is empty: write the JSON document into it")
    constant: Callable[[str], Any] | None = _refuse_constant if finite else None
    number: Callable[[str], Any] | None = _finite_float if finite else None
    try:
        data = json.loads(text, parse_constant=constant, parse_float=number)
    except _NonFinite as exc:
        raise SpecError(
            f"{what} {source} holds the number {exc.literal[:40]}, which is not finite: "
            "JSON documents here take finite numbers only; write a finite value"
        ) from None
    except json.JSONDecodeError as exc:
        raise SpecError(
            f"{what} {source} is not valid JSON ({exc.msg} at line {exc.lineno} column "
            f"{exc.colno}): the file is truncated or not a {what}; fix it or write it again"
        ) from None
    except RecursionError:
        raise _too_deep(source, what) from None
    except ValueError as exc:  # an integer past the 4,300-digit limit
        message = str(exc).split(";")[0]
        raise SpecError(f"{what} {source} holds a number out of range ({message})") from None
    if _depth_exceeds(data, MAX_JSON_DEPTH):
        raise _too_deep(source, what)
    return data


def _too_deep(source: str, what: str) -> SpecError:
    return SpecError(
        f"{what} {source} nests arrays or objects more than {MAX_JSON_DEPTH} levels deep "
        "(the planner's documents nest 6 at most): it is not one of them; give the right file"
    )


def _depth_exceeds(data: Any, limit: int) -> bool:
    """Whether ``data`` nests lists and dicts more than ``limit`` levels deep."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if not isinstance(value, dict | list):
            continue
        children = list(value.values()) if isinstance(value, dict) else value
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


# ----- JSON out ----------------------------------------------------------------------------


def _non_finite_path(data: Any, prefix: str = "") -> str | None:
    """The dotted path of the first non-finite float in ``data``, if any."""
    stack: list[tuple[Any, str]] = [(data, prefix)]
    while stack:
        value, where = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return where or "(value)"
        if isinstance(value, dict):
            stack.extend((v, f"{where}.{k}" if where else str(k)) for k, v in value.items())
        elif isinstance(value, list | tuple):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(value))
    return None


def _refuse_non_finite(data: Any, what: str) -> None:
    where = _non_finite_path(data)
    if where is not None:
        raise SpecError(
            f"cannot write {what}: {where} is not a finite number and JSON has none; an "
            "input is out of range (or this is a bug: please report the command)"
        )


def dumps_json(data: Any, *, what: str = "JSON", indent: int | None = 2) -> str:
    """``json.dumps`` with ``allow_nan=False``: every JSON the planner prints or writes
    goes through here, so ``NaN`` and ``Infinity`` are never emitted."""
    _refuse_non_finite(data, what)
    return json.dumps(data, indent=indent, allow_nan=False)


class _Document(Protocol):
    def model_dump(self) -> dict[str, Any]: ...
    def model_dump_json(self, *, indent: int | None = None) -> str: ...


def document_json(document: _Document, *, what: str | None = None) -> str:
    """A pydantic document as indented JSON (pydantic's own formatting), after checking
    that every number in it is finite (pydantic would write ``null`` for ``NaN``)."""
    _refuse_non_finite(document.model_dump(), what or type(document).__name__)
    return document.model_dump_json(indent=2)


# ----- writing -----------------------------------------------------------------------------


def _writable(path: Path, info: os.stat_result) -> bool:
    """Writable by this process, and not marked read-only (root ignores the mode bits,
    but a file nobody may write was made read-only on purpose)."""
    return os.access(path, os.W_OK) and bool(stat.S_IMODE(info.st_mode) & 0o222)


def check_output_path(path: Path | str, *, option: str = "--output") -> Path:
    """``path`` as a :class:`Path` if a file can be written there atomically; otherwise
    :class:`SpecError` naming ``option``, the path, why, and what to do (the policy is in
    this module's docstring). Call it before the work whose result is written."""
    text = os.fspath(path)
    if text == "":
        raise SpecError(f"{option} is empty: give a file path such as out.json")
    if text.endswith(os.sep):
        raise SpecError(
            f"{option} {text} ends in '{os.sep}', so it names a directory: give a file path "
            f"such as {text}out.json"
        )
    path = Path(text)
    try:
        info = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # the directory is checked below
        info = None
    except OSError as exc:
        raise SpecError(f"{option} {path}: cannot use this path ({exc.strerror})") from None
    if info is not None:
        if stat.S_ISLNK(info.st_mode):
            raise SpecError(
                f"{option} {path} is a symbolic link (to {os.readlink(path)}): the write "
                "would replace the link by a file; give the real path, or remove the link"
            )
        if stat.S_ISDIR(info.st_mode):
            raise SpecError(
                f"{option} {path} is a directory: give a file path, such as {path / 'out.json'}"
            )
        if not stat.S_ISREG(info.st_mode):
            raise SpecError(
                f"{option} {path} is {_kind(info.st_mode)}, not a regular file: files are "
                "written by renaming a temporary file over the path, which would replace "
                f"it; give a file path (to discard the output, leave {option} out)"
            )
        if not _writable(path, info):
            raise SpecError(
                f"{option} {path} is read-only: make it writable (chmod u+w {path}) or "
                "give another path"
            )
    parent = path.parent
    try:
        parent_info = os.stat(parent)
    except FileNotFoundError:
        raise SpecError(
            f"{option} {path}: directory {parent} does not exist; create it "
            f"(mkdir -p {parent}) or give another path"
        ) from None
    except OSError as exc:
        raise SpecError(
            f"{option} {path}: cannot use directory {parent} ({exc.strerror})"
        ) from None
    if not stat.S_ISDIR(parent_info.st_mode):
        raise SpecError(f"{option} {path}: {parent} is not a directory; give another path")
    if not (os.access(parent, os.W_OK | os.X_OK) and _writable(parent, parent_info)):
        raise SpecError(
            f"{option} {path}: directory {parent} is not writable; give a path in a "
            "directory you can write to"
        )
    return path


def write_text_atomic(path: Path, text: str, *, option: str = "output") -> None:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file and a rename, so
    readers never see half a file and a failed write leaves the old one in place.
    ``path`` is checked as :func:`check_output_path` does."""
    write_bytes_atomic(path, text.encode(), option=option)


def write_bytes_atomic(path: Path, data: bytes, *, option: str = "output") -> None:
    """Write ``data`` to ``path`` atomically (see :func:`write_text_atomic`)."""
    path = check_output_path(path, option=option)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise SpecError(f"cannot write {path}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give what open() would
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise SpecError(f"cannot write {path}: {exc.strerror}; nothing was written") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
