"""Feed a ``plan export --to deepspeed==X`` file to the installed DeepSpeed's config parser.

Run with the Python of a venv that has deepspeed (installed with ``DS_BUILD_OPS=0``)::

    python deepspeed_check.py EXPORT --world-size 64
    python deepspeed_check.py --jobs JOBS.json --results RESULTS.json  # many (forked.py)

Steps: a fake process group of ``--world-size`` ranks (one process stands for all) and
``deepspeed.init_distributed()`` on it, so the config sees the data-parallel world size
as under a real launch; then ``DeepSpeedConfig(EXPORT)``: the file path, as
``deepspeed.initialize(config=PATH)`` passes it (``hjson``, so ``//`` comments are read
as such), which validates every section with DeepSpeed's pydantic models, refuses removed
keys and checks ``train_batch_size = micro * accumulation * world``.

Prints one JSON line (``--jobs``: writes a list of them), ``{"ok": true, ...}`` or
``{"ok": false, "error": ...}``; exits 0 either way (1 only if this script itself breaks).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import logging
import sys
from pathlib import Path

from forked import run_jobs


def _preload() -> None:
    """Import DeepSpeed once (before the jobs fork, forked.py); register the fake backend."""
    import deepspeed  # noqa: F401
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - the "fake" backend
    from deepspeed.runtime.config import DeepSpeedConfig  # noqa: F401

    # A CPU launch JIT-builds a shared-memory all-reduce kernel (C++, ~30 s) that serves
    # collectives only: the config parse never calls it. (``deepspeed.comm.torch`` the
    # attribute is torch itself: the package star-imports it over its submodule.)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)


def check_job(job: dict) -> dict:
    """One export (``job``: its path and world size)."""
    import deepspeed
    import torch
    from deepspeed.runtime.config import DeepSpeedConfig

    torch.distributed.init_process_group(
        "fake", store=torch.distributed.HashStore(), rank=0, world_size=job["world_size"]
    )
    deepspeed.init_distributed()
    result: dict[str, object] = {
        "framework": "deepspeed",
        "version": importlib.metadata.version("deepspeed"),
    }
    try:
        config = DeepSpeedConfig(str(job["export"]))
        result |= {"ok": True, "world_size": config.world_size}
    except Exception as error:
        result |= {
            "ok": False,
            "stage": "DeepSpeedConfig",
            "error": f"{type(error).__name__}: {error}"[:2000],
        }
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path, nargs="?")
    parser.add_argument("--world-size", type=int)
    parser.add_argument("--jobs", type=Path, help="a JSON list of jobs (forked.py)")
    parser.add_argument("--results", type=Path, help="where --jobs writes its results")
    options = parser.parse_args()
    _preload()
    if options.jobs is not None:
        return run_jobs(options.jobs, options.results, check_job)
    print(json.dumps(check_job({"export": str(options.export), "world_size": options.world_size})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
