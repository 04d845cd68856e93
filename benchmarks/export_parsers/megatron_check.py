"""Feed a ``plan export --to megatron==X`` file to Megatron-LM's own argument validation.

Megatron-LM's ``megatron/training/arguments.py`` (``parse_args``, ``validate_args``,
``core_transformer_config_from_args``) is not in the ``megatron-core`` wheel: it lives
in the NVIDIA/Megatron-LM repository. Run with a venv that has ``megatron-core`` and
torch, and ``PYTHONPATH`` holding a checkout of that repository's ``megatron/training``
(and ``megatron/rl``, ``megatron/post_training``, which it imports) at the matching
``core_vX.Y.Z`` tag::

    PYTHONPATH=/path/megatron-lm python megatron_check.py EXPORT --world-size 64 --gpu-arch 9

Steps: the export's launch environment (its ``# env: NAME=VALUE`` header lines) is set;
``sys.argv`` is ``pretrain_gpt.py`` plus the export's arguments (comments removed) plus
what a launch adds (``--tokenizer-type NullTokenizer``, ``--mock-data``, and
``--no-rope-fusion``: the fused RoPE needs Transformer Engine, which has no CPU build); then
``parse_args()``, ``validate_args(args)`` for ``WORLD_SIZE`` ranks and
``core_transformer_config_from_args(args)``, then Megatron-Core's
``initialize_model_parallel`` for those sizes on the fake process-group backend as rank 0
(the rank order and expert-parallel checks of ``megatron/core/parallel_state.py``; the
printed ``expert_group`` is rank 0's expert-parallel group). ``validate_args`` asks CUDA for the
device's compute capability (``get_device_arch_version``, and
``torch.cuda.get_device_capability`` for ``--moe-grouped-gemm``); this script answers
``--gpu-arch`` instead (8 A100, 9 H100, 10 B200).

Prints one JSON line (``--jobs JOBS.json --results RESULTS.json``: writes a list of them,
forked.py), ``{"ok": true, "expert_group": [...], ...}`` or ``{"ok": false, "stage": ...,
"error": ...}``; exits 0 either way (1 only if this script itself breaks).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import sys
import warnings
from pathlib import Path

from forked import run_jobs

_ENV = re.compile(r"^#\s*env:\s*([A-Z_][A-Z0-9_]*)=(\S*)", re.MULTILINE)
# What a launch adds; --no-rope-fusion because the fused RoPE kernel needs Transformer
# Engine, which has no CPU build (core_transformer_config_from_args refuses without it).
_LAUNCH = ["--tokenizer-type", "NullTokenizer", "--mock-data", "--no-rope-fusion"]


def _expert_group(args: argparse.Namespace) -> list[int]:
    """Megatron-Core's process groups for the export's sizes, built as
    ``megatron/training/initialize.py`` builds them (its rank order, its expert-parallel
    checks) on the fake backend as global rank 0; returns rank 0's expert-parallel group."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=args.world_size)
    parallel_state.initialize_model_parallel(
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        order="tp-cp-ep-dp-pp" if not args.use_tp_pp_dp_mapping else "tp-cp-ep-pp-dp",
        create_gloo_process_groups=False,
    )
    return dist.get_process_group_ranks(parallel_state.get_expert_model_parallel_group())


def check_job(job: dict) -> dict:
    """One export (``job``: its path, world size and GPU architecture). Megatron-LM is
    imported here, after the export's launch environment is set, as a launch does."""
    text = Path(job["export"]).read_text()
    gpu_arch = job.get("gpu_arch", 9)
    environment = dict(_ENV.findall(text))
    os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    os.environ |= environment | {"WORLD_SIZE": str(job["world_size"]), "RANK": "0"}

    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
    import megatron.training.arguments as arguments
    from megatron.core import package_info

    arguments.get_device_arch_version = lambda: gpu_arch
    arguments.torch.cuda.get_device_capability = lambda *device: (gpu_arch, 0)
    result: dict[str, object] = {
        "framework": "megatron",
        "version": package_info.__version__,
        "environment": environment,
    }
    sys.argv = ["pretrain_gpt.py", *shlex.split(text, comments=True), *_LAUNCH]
    stage = "parse_args"
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            args = arguments.parse_args()
            stage = "validate_args"
            arguments.validate_args(args, {})
            stage = "TransformerConfig"
            arguments.core_transformer_config_from_args(args)
            stage = "initialize_model_parallel"
            expert_group = _expert_group(args)
        result |= {
            "ok": True, "data_parallel_size": args.data_parallel_size,
            "expert_group": expert_group,
        }  # fmt: skip
    except (Exception, SystemExit) as error:  # argparse exits on an unknown option
        message = f"{type(error).__name__}: {error}"
        if isinstance(error, SystemExit):
            tail = [line for line in captured.getvalue().splitlines() if "error" in line]
            message = tail[-1] if tail else message
        result |= {"ok": False, "stage": stage, "error": message[:2000]}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path, nargs="?")
    parser.add_argument("--world-size", type=int)
    parser.add_argument("--gpu-arch", type=int, default=9, help="compute capability major")
    parser.add_argument("--jobs", type=Path, help="a JSON list of jobs (forked.py)")
    parser.add_argument("--results", type=Path, help="where --jobs writes its results")
    options = parser.parse_args()
    if options.jobs is not None:
        return run_jobs(options.jobs, options.results, check_job)
    job = {
        "export": str(options.export), "world_size": options.world_size,
        "gpu_arch": options.gpu_arch,
    }  # fmt: skip
    print(json.dumps(check_job(job)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
