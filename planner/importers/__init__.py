"""What users already have, read as the run the planner prices (torch-free).

:func:`import_config` reads a torchtitan job config (TOML, or torchtitan 0.3's JSON
dump), Megatron-LM command-line arguments or a DeepSpeed config JSON, fills what the
config leaves open from the options (the model, the cluster, the GPU count) and returns
an :class:`ImportedRun`: its ``run`` is the :class:`~planner.cost.run.RunConfig` to
price (``planner.cost.estimate_run(imported.run)``), its ``describe()`` the keys read
and the defaults taken. Keys that change the math in a way the planner cannot price,
misspelt keys and runs the framework itself refuses (:func:`planner.frameworks.config_refusal`)
are refused with the key, its value and what to change. :func:`describe_changes` says
how two strategies differ, in words.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from pathlib import Path

from planner.errors import SpecError, UnknownNameError
from planner.importers.common import (
    ImportedRun,
    Options,
    command_words,
    describe_changes,
    looks_like_command,
)
from planner.importers.deepspeed import SIGNATURE_KEYS, read_deepspeed, without_comments
from planner.importers.megatron import read_megatron
from planner.importers.torchtitan import is_overrides, read_torchtitan
from planner.io import parse_json, read_text
from planner.spec import Cluster, ModelSpec

__all__ = ["FORMATS", "ImportedRun", "describe_changes", "detect_format", "import_config"]

Reader = Callable[[str, str, str, Options], ImportedRun]
FORMATS: dict[str, Reader] = {
    "torchtitan": read_torchtitan,
    "megatron": read_megatron,
    "deepspeed": read_deepspeed,
}


def import_config(
    path_or_text: str | Path,
    *,
    format: str | None = None,
    model: str | Path | ModelSpec | None = None,
    cluster: str | Path | Cluster | None = None,
    gpus: int | None = None,
    gpus_per_node: int | None = None,
) -> ImportedRun:
    """Read a framework config as the run the planner prices.

    ``path_or_text``: a file (a :class:`Path`, or a string naming one) or the config's
    text (several lines, or a command line). ``format``: a key of
    :data:`FORMATS` (default: detected). ``model``: a preset name, a ModelSpec JSON
    file or a :class:`ModelSpec`, for a config that does not describe its model.
    ``cluster``: a GPU profile (with ``gpus``, unless the config's degrees give the
    count), a cluster profile, a Cluster JSON file or a :class:`Cluster`;
    ``gpus_per_node`` for a GPU profile. Raises :class:`~planner.errors.SpecError`.
    """
    text, source, suffix = _read(path_or_text)
    if not without_comments(text).strip():
        raise SpecError(f"{source} is empty: give the framework config to read")
    if format is None:
        format, detected = detect_format(text, source, suffix)
    elif format in FORMATS:
        detected = "given"
    else:
        raise UnknownNameError("config format", format, FORMATS)
    options = Options.of(model, cluster, gpus, gpus_per_node)
    return FORMATS[format](text, source, detected, options)


def _read(path_or_text: str | Path) -> tuple[str, str, str]:
    """(text, how to name it in messages, file suffix)."""
    if isinstance(path_or_text, str) and _is_text(path_or_text):
        return path_or_text, "the config text", ""
    path = Path(path_or_text)
    return read_text(path, what="config"), str(path), path.suffix.lower()


def _is_text(value: str) -> bool:
    """Whether a string is a config's text rather than a file name: several lines, a
    leading ``{``, ``[`` or ``-``, or words with spaces that name no file."""
    if "\n" in value or value.lstrip().startswith(("{", "[", "-")):
        return True
    try:
        return any(c.isspace() for c in value) and not Path(value).is_file()
    except OSError:  # longer than a file name may be
        return True


def detect_format(text: str, source: str, suffix: str = "") -> tuple[str, str]:
    """(format, what gave it away) for a config's ``text``: TOML is torchtitan's, JSON
    with DeepSpeed's batch or ZeRO keys DeepSpeed's (with ``parallelism``/``training``
    tables torchtitan 0.3's dump), ``--section.key`` options torchtitan 0.3's, other
    ``--options`` Megatron-LM's."""
    if without_comments(text).lstrip().startswith("{"):
        data = parse_json(without_comments(text), source, what="config")
        if isinstance(data, dict) and {"planner_version", "strategy"} <= set(data):
            raise SpecError(
                f"{source} is a plan this planner wrote, not a framework config: price it "
                f"with plan estimate --plan {source}, or export it with plan export"
            )
        keys = [key for key in SIGNATURE_KEYS if isinstance(data, dict) and key in data]
        if keys:
            return "deepspeed", f"detected: JSON with {keys[0]}"
        if isinstance(data, dict) and {"parallelism", "training"} & set(data):
            return "torchtitan", "detected: JSON with parallelism/training tables (torchtitan 0.3)"
        raise SpecError(
            f"cannot tell the format of {source}: JSON without DeepSpeed's "
            f"{', '.join(SIGNATURE_KEYS)} or torchtitan's tables; give --format"
        )
    if looks_like_command(text):
        if is_overrides(command_words(text, source)[0]):
            return "torchtitan", "detected: --section.key overrides (torchtitan 0.3)"
        return "megatron", "detected: --options"
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        if suffix == ".toml":  # meant as torchtitan's job config: say where it breaks
            raise SpecError(f"cannot read {source}: not TOML ({error})") from None
    else:
        return "torchtitan", "detected: a .toml file" if suffix == ".toml" else "detected: TOML"
    raise SpecError(
        f"cannot tell the format of {source}: it is no TOML (torchtitan), JSON (DeepSpeed) or "
        f"--options (Megatron-LM); give --format ({', '.join(FORMATS)})"
    )
