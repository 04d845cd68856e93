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
``core_transformer_config_from_args(args)``. ``validate_args`` asks CUDA for the
device's compute capability (``get_device_arch_version``); this script answers
``--gpu-arch`` instead (8 A100, 9 H100, 10 B200).

Prints one JSON line, ``{"ok": true, ...}`` or ``{"ok": false, "stage": ..., "error": ...}``;
exits 0 either way (1 only if this script itself breaks).
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

_ENV = re.compile(r"^#\s*env:\s*([A-Z_][A-Z0-9_]*)=(\S*)", re.MULTILINE)
# What a launch adds; --no-rope-fusion because the fused RoPE kernel needs Transformer
# Engine, which has no CPU build (core_transformer_config_from_args refuses without it).
_LAUNCH = ["--tokenizer-type", "NullTokenizer", "--mock-data", "--no-rope-fusion"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--gpu-arch", type=int, default=9, help="compute capability major")
    options = parser.parse_args()
    text = options.export.read_text()
    environment = dict(_ENV.findall(text))
    os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    os.environ |= environment | {"WORLD_SIZE": str(options.world_size), "RANK": "0"}

    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
    import megatron.training.arguments as arguments
    from megatron.core import package_info

    arguments.get_device_arch_version = lambda: options.gpu_arch
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
        result |= {"ok": True, "data_parallel_size": args.data_parallel_size}
    except (Exception, SystemExit) as error:  # argparse exits on an unknown option
        message = f"{type(error).__name__}: {error}"
        if isinstance(error, SystemExit):
            tail = [line for line in captured.getvalue().splitlines() if "error" in line]
            message = tail[-1] if tail else message
        result |= {"ok": False, "stage": stage, "error": message[:2000]}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
