"""Run a checker's exports in forked children of one process that imported its framework.

A checker run as ``python X_check.py --jobs JOBS.json --results RESULTS.json`` reads a
JSON list of jobs (one export each: ``{"export": PATH, "world_size": N, ...}``), imports
its framework once, and checks each job in a child forked from that process, two at a
time: each child starts from the same freshly imported state (its own process group,
environment and monkeypatches), and the import (seconds for torch and a framework) is
paid once, not once per export. ``RESULTS.json`` gets one result object per job, in
order; a child that dies gets ``{"ok": null, "crash": ...}``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

Job = dict[str, Any]
Result = dict[str, Any]
_AT_ONCE = 2


def run_jobs(jobs_path: Path, results_path: Path, check: Callable[[Job], Result]) -> int:
    """Check every job of ``jobs_path`` with ``check`` in forked children; write the results."""
    jobs = json.loads(jobs_path.read_text())
    results: list[Result | None] = [None] * len(jobs)
    running: dict[int, tuple[int, int]] = {}  # pid -> (job index, read end of its pipe)
    pending = list(enumerate(jobs))
    while pending or running:
        while pending and len(running) < _AT_ONCE:
            index, job = pending.pop(0)
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: one check, its result down the pipe
                os.close(read)
                _child(job, write, check)
            os.close(write)
            running[pid] = (index, read)
        pid, status = os.wait()
        index, read = running.pop(pid)
        text = _drain(read)
        code = os.waitstatus_to_exitcode(status)
        results[index] = json.loads(text) if text else {"ok": None, "crash": f"exit {code}"}
    results_path.write_text(json.dumps(results))
    return 0


def _child(job: Job, write: int, check: Callable[[Job], Result]) -> None:
    try:
        result = check(job)
    except BaseException as error:
        result = {"ok": None, "crash": f"{type(error).__name__}: {error}"[:2000]}
    data = json.dumps(result).encode()
    while data:
        data = data[os.write(write, data) :]
    os._exit(0)


def _drain(read: int) -> str:
    chunks = []
    while chunk := os.read(read, 1 << 16):
        chunks.append(chunk)
    os.close(read)
    return b"".join(chunks).decode()
