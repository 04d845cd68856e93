"""Feed a ``plan export --to torchtitan==X`` file to the installed torchtitan, as its trainer would.

Run with the Python of a venv that has torchtitan 0.2.x or 0.3.x (and torch), not the
planner's::

    python torchtitan_check.py EXPORT --world-size 64 [--model llama3] [--flavor 8B] [--gpu-arch 9]
    python torchtitan_check.py --jobs JOBS.json --results RESULTS.json  # many (forked.py)

Steps, each torchtitan's own code, in the trainer's order (``torchtitan/train.py`` in 0.2,
``torchtitan/trainer.py`` in 0.3):

1. parse: 0.2 ``ConfigManager().parse_args(["--job.config_file", EXPORT, ...])`` (the
   export is a TOML job config); 0.3 ``ConfigManager().parse_args(["--module",
   "tt03_configs", "--config", CONFIG, *overrides])`` (the export is command-line
   overrides; ``tt03_configs.py`` beside this script holds torchtitan's llama3 configs,
   405B without its fp8 converter), which also runs ``Trainer.Config.__post_init__``;
2. mesh: ``ParallelDims`` for ``--world-size`` ranks and ``build_mesh()`` on the fake
   process-group backend (one process stands for every rank);
3. batch: the trainer's global/local batch and sequence-length checks;
4. model (with ``--flavor``; ``--model`` another torchtitan model than llama3, e.g.
   ``deepseek_v3`` ``671B``, 0.3 under its ``{model}_{flavor}`` config function): the
   model on the meta device, its converters,
   then ``pipelining_fn`` (pp > 1) or ``parallelize_fn`` exactly as the trainer calls them.
   Meshes are built for the CPU (torchtitan falls back to ``cuda`` without an
   accelerator), the fp8 converter is told the plan's GPU (``--gpu-arch``), and 0.3 builds under ``spmd_backend = "full_dtensor"``: its default
   ``spmd_types`` backend leaves plain-tensor parameters that ``fully_shard`` refuses on
   torch 2.13's CPU build, even for a plain FSDP config.

Prints one JSON line (``--jobs``: writes a list of them): ``{"ok": true, "version": ...,
"stages": [...]}`` or ``{"ok": false, "stage": ..., "error": ...}``; exits 0 either way (1
only if this script itself breaks).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import io
import json
import os
import shlex
import sys
import tempfile
import traceback
from pathlib import Path

import torch
from forked import run_jobs

VERSION = importlib.metadata.version("torchtitan")
V03 = not VERSION.startswith(("0.0.", "0.1.", "0.2."))
# torchtitan 0.3 config_registry functions for the llama3 flavors: tt03_configs.py beside
# this script (torchtitan's own, 405B without its fp8 converter)
CONFIGS_03 = {"8B": "llama3_8b", "70B": "llama3_70b", "405B": "llama3_405b"}


class Rejected(Exception):
    """torchtitan refused the export at ``stage``."""

    def __init__(self, stage: str, error: BaseException) -> None:
        super().__init__(stage)
        self.stage = stage
        self.error = error


def _stage(name: str, done: list[str]):
    """Run a step; any exception from torchtitan becomes a :class:`Rejected` at ``name``."""

    class _Step:
        def __enter__(self) -> None:
            return None

        def __exit__(self, kind, error, tb) -> bool:
            if error is None:
                done.append(name)
                return False
            if isinstance(error, SystemExit):  # tyro/argparse exit on bad arguments
                error = ValueError(f"command line rejected (exit {error.code})")
            raise Rejected(name, error) from error

    return _Step()


def parse(text: str, flavor: str | None, model_name: str):
    """The config; tyro's complaint about a bad command line becomes the error."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return _parse(text, flavor, model_name)
    except SystemExit:
        lines = [line.strip(" │╭╰─╮╯") for line in captured.getvalue().splitlines()]
        raise ValueError(" ".join(line for line in lines if line)[-600:]) from None


def _parse(text: str, flavor: str | None, model_name: str):
    from torchtitan.config import ConfigManager

    if V03:
        if model_name != "llama3":  # its own config function for the flavor
            module, config = model_name, f"{model_name}_{(flavor or 'debugmodel').lower()}"
        elif flavor:
            module, config = "tt03_configs", CONFIGS_03[flavor]
        else:
            module, config = "llama3", "llama3_debugmodel"
        args = ["--module", module, "--config", config, *shlex.split(text, comments=True)]
        return ConfigManager().parse_args(args)
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as handle:
        handle.write(text)
    model = ["--model.name", model_name, "--model.flavor", flavor or "debugmodel"]
    return ConfigManager().parse_args(["--job.config_file", handle.name, *model])


def parallel_dims(config, world_size: int):
    from torchtitan.distributed import ParallelDims

    if V03:
        return ParallelDims.from_config(config.parallelism, world_size)
    p = config.parallelism
    return ParallelDims(
        dp_shard=p.data_parallel_shard_degree, dp_replicate=p.data_parallel_replicate_degree,
        cp=p.context_parallel_degree, tp=p.tensor_parallel_degree,
        pp=p.pipeline_parallel_degree, ep=p.expert_parallel_degree,
        etp=p.expert_tensor_parallel_degree, world_size=world_size,
    )  # fmt: skip


def check_batch(config, dims) -> None:
    """The trainer's batch-size and sequence-length checks."""
    training = config.training
    batch_degree = dims.get_mesh("batch").size() if dims.dp_enabled else 1
    global_batch = training.global_batch_size
    if global_batch < 0:
        global_batch = training.local_batch_size * batch_degree
    if global_batch % (training.local_batch_size * batch_degree):
        raise ValueError(
            f"global batch size must be multiple of local batch size times data-parallel "
            f"degree ({global_batch} % ({training.local_batch_size} * {batch_degree}) != 0)"
        )
    if dims.pp_enabled and training.local_batch_size % (
        config.parallelism.pipeline_parallel_microbatch_size
    ):
        raise ValueError("local_batch_size is not a multiple of pipeline_parallel_microbatch_size")
    if V03:
        sp = dims.tp if config.parallelism.enable_sequence_parallel else 1
        divisor = sp * (2 * dims.cp if dims.cp > 1 else 1)
    else:
        divisor = dims.seq_len_divisor
    if training.seq_len % divisor:
        raise ValueError(f"seq_len {training.seq_len} is not divisible by {divisor}")


def parameter_names(parts) -> set[str]:
    """Parameter FQNs of model parts, wrapper prefixes (checkpoint, compile) removed."""
    names = set()
    for part in parts:
        for name, _ in part.named_parameters():
            names.add(name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""))
    return names


def check_parts(names: set[str], parts) -> None:
    """The last rank's chunks keep the final norm and head: torchtitan drops the modules
    no chunk names, silently (a head named ``output`` in 0.3, where it is ``lm_head``,
    would train without a head). Run as the last rank, which holds the last chunk."""
    last = {name for name in names if not name.startswith(("layers.", "tok_embeddings."))}
    missing = sorted(last - parameter_names(parts))
    if missing:
        raise ValueError(f"the last pipeline chunk lost {missing} (no chunk names its module)")


def parallelize_02(config, dims) -> None:
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.protocols.model_converter import build_model_converters
    from torchtitan.protocols.train_spec import get_train_spec
    from torchtitan.tools import utils

    spec = get_train_spec(config.model.name)
    model_args = spec.model_args[config.model.flavor]
    model_args.update_from_config(config)
    with torch.device("meta"), utils.set_default_dtype(TORCH_DTYPE_MAP[config.training.dtype]):
        model = spec.model_cls(model_args)
    build_model_converters(config, dims).convert(model)
    if dims.pp_enabled:
        names = parameter_names([model])
        loss_fn = spec.build_loss_fn(config, parallel_dims=dims)
        _, parts, _, _ = spec.pipelining_fn(
            model, dims, config, torch.device("cpu"), model_args, spec.parallelize_fn, loss_fn
        )
        check_parts(names, parts)
    else:
        spec.parallelize_fn(model, dims, config)


def parallelize_03(config, dims) -> None:
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.tools import utils

    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    spec = config.model_spec
    model_config = spec.model
    model_config.update_from_config(config=config)
    config._validate_cuda_graphs()
    with torch.device("meta"), utils.set_default_dtype(TORCH_DTYPE_MAP[config.training.dtype]):
        model = model_config.build()
    common = {
        "parallel_dims": dims, "training": config.training, "parallelism": config.parallelism,
        "compile_config": config.compile, "ac_config": config.activation_checkpoint,
        "dump_folder": config.dump_folder,
    }  # fmt: skip
    if dims.pp_enabled:
        names = parameter_names([model])
        loss_fn = config.loss.build(compile_config=config.compile)
        _, parts, _, _ = spec.pipelining_fn(
            model, device=torch.device("cpu"), model_config=model_config,
            parallelize_fn=spec.parallelize_fn, loss_fn=loss_fn, **common,
        )  # fmt: skip
        check_parts(names, parts)
    else:
        spec.parallelize_fn(model, **common)


def simulate_hardware(gpu_arch: int) -> None:
    """Build meshes for the CPU (torchtitan falls back to ``cuda`` without an accelerator,
    and FSDP asks the mesh's device for its current index), and answer the fp8
    converter's compute-capability question for the plan's GPU (``gpu_arch``.0)."""
    import torchtitan.components.quantization.float8 as float8
    import torchtitan.distributed.parallel_dims as module

    module.device_type = "cpu"
    float8.has_cuda_capability = lambda major, minor: (gpu_arch, 0) >= (major, minor)


def check(
    text: str, world_size: int, flavor: str | None, gpu_arch: int, model_name: str = "llama3"
) -> list[str]:
    done: list[str] = []
    simulate_hardware(gpu_arch)
    with _stage("parse", done):
        config = parse(text, flavor, model_name)
    if V03 and flavor is not None:
        # 0.3's default spmd_types backend leaves plain-tensor parameters that fully_shard
        # refuses on this CPU build (torch 2.13); the DTensor backend builds the same shards.
        config.parallelism.spmd_backend = "full_dtensor"
    with _stage("mesh", done):
        dims = parallel_dims(config, world_size)
        rank = world_size - 1 if dims.pp_enabled else 0  # the last pipeline rank
        torch.distributed.init_process_group(
            "fake", store=torch.distributed.HashStore(), rank=rank, world_size=world_size
        )
        dims.build_mesh()
    with _stage("batch", done):
        check_batch(config, dims)
    if flavor is not None:
        with _stage("model", done):
            (parallelize_03 if V03 else parallelize_02)(config, dims)
    return done


def check_job(job: dict) -> dict:
    """One export (``job``: its path and launch facts, as the command line gives them)."""
    os.environ.setdefault("LOCAL_RANK", "0")
    result: dict[str, object] = {"framework": "torchtitan", "version": VERSION}
    try:
        stages = check(
            Path(job["export"]).read_text(), job["world_size"], job.get("flavor"),
            job.get("gpu_arch", 9), job.get("model") or "llama3",
        )  # fmt: skip
        result |= {"ok": True, "stages": stages}
    except Rejected as rejected:
        message = f"{type(rejected.error).__name__}: {rejected.error}".strip()
        result |= {"ok": False, "stage": rejected.stage, "error": message[:2000]}
        if os.environ.get("EXPORT_CHECK_TRACEBACK"):
            traceback.print_exception(rejected.error, file=sys.stderr)
    return result


def _preload() -> None:
    """What every check imports, imported once before the jobs fork (forked.py)."""
    import torchtitan.config
    import torchtitan.distributed

    if V03:
        import torchtitan.trainer
    else:
        import torchtitan.protocols.train_spec
        import torchtitan.train  # noqa: F401


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path, nargs="?")
    parser.add_argument("--world-size", type=int)
    parser.add_argument("--flavor", help="torchtitan flavor (llama3: 8B, 70B, 405B)")
    parser.add_argument("--model", default="llama3", help="torchtitan model (deepseek_v3, ...)")
    parser.add_argument("--gpu-arch", type=int, default=9, help="compute capability major")
    parser.add_argument("--jobs", type=Path, help="a JSON list of jobs (forked.py)")
    parser.add_argument("--results", type=Path, help="where --jobs writes its results")
    args = parser.parse_args()
    if args.jobs is not None:
        _preload()
        return run_jobs(args.jobs, args.results, check_job)
    job = {
        "export": str(args.export), "world_size": args.world_size, "flavor": args.flavor,
        "model": args.model, "gpu_arch": args.gpu_arch,
    }  # fmt: skip
    print(json.dumps(check_job(job)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
