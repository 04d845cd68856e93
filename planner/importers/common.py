"""What every importer shares: the keys a config holds and which were read, refusals,
the model, the world size and cluster, the stage split, and the run they produce.

An importer reads what a framework's config says, fills what it leaves open from the
caller's options (``--model``, ``--cluster``, ``--gpus``) and builds the
:class:`~planner.cost.run.RunConfig` the planner prices. A key that changes the math
in a way the planner cannot price is refused with :meth:`Settings.refuse`, which names
the key, its value and what to change.
"""

from __future__ import annotations

import difflib
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.clusters import resolve_cluster
from planner.cost.build import stage_indices
from planner.cost.run import RunConfig
from planner.cost.spec_graph import graph_from_spec
from planner.errors import SpecError
from planner.frameworks import Framework, config_refusal, parse_target
from planner.presets import PRESETS, get_preset
from planner.spec import Cluster, Family, ModelSpec, Strategy, load_model_spec

__all__ = [
    "ImportedRun",
    "Options",
    "Settings",
    "build_run",
    "choose_model",
    "chunks_of",
    "command_words",
    "launched_world",
    "looks_like_command",
    "option_values",
    "describe_changes",
    "layers_per_chunk",
    "matching_preset",
    "resolve_world",
]

_LISTED = 12  # keys named in a note before "and N more"
# an unread key within _MISSPELT_CHARS characters and a difflib ratio of _NEAR_MISS of a
# wanted one is its misspelling
_NEAR_MISS, _MISSPELT_CHARS = 0.9, 2
_SWITCHES = (".device", ".enabled", ".mode")  # leaves that switch their whole section on
_LAUNCH_GPUS = ("--nproc_per_node", "--nproc-per-node")  # torchrun's world-size options
_LAUNCH_NODES = ("--nnodes",)


@dataclass(frozen=True)
class ImportedRun:
    """A framework config read as the run the planner prices.

    ``run``: the :class:`~planner.cost.run.RunConfig` to price (model, cluster, training,
    strategy, implementation options, stage split). ``used``: the config keys it was read
    from; ``not_read``: keys present that the importer does not read (logging, paths,
    checkpointing, learning-rate schedule...); ``notes``: what came from defaults or
    options, or was approximated.
    """

    format: str
    source: str
    detected: str  # how the format was chosen: "given", or what gave it away
    run: RunConfig
    used: tuple[str, ...]
    not_read: tuple[str, ...]
    notes: tuple[str, ...]
    release: str = ""  # the release that reads this config (torchtitan==0.2 for TOML), if told

    def run_at(self, seq_len: int | None) -> RunConfig:
        """``run`` with ``seq_len`` tokens per sequence where the config states none (a
        DeepSpeed config); ``None``: as read. A length the config contradicts is refused."""
        if seq_len is None:
            return self.run
        stated = self.run.training.seq_len
        if stated is not None and stated != seq_len:
            raise SpecError(
                f"--seq {seq_len}, but {self.source} states seq_len = {stated}: drop --seq"
            )
        training = self.run.training.model_copy(update={"seq_len": seq_len})
        return self.run.model_copy(update={"training": training})

    def describe(self, seq_len: int | None = None) -> list[str]:
        """The lines ``plan estimate --from`` prints before its table (``seq_len``: its
        ``--seq``)."""
        lines = [f"read {self.source} as {self.format} ({self.detected})"]
        lines.append(f"used: {', '.join(self.used) or '(nothing)'}")
        if self.not_read:  # every one: a key the planner skips may matter to the user
            lines.append(f"not read: {', '.join(self.not_read)}")
        return lines + [f"note: {note}" for note in self.notes_at(seq_len)]

    def notes_at(self, seq_len: int | None = None) -> list[str]:
        """``notes``, and the sequence length priced where the config states none (the
        model's, or ``seq_len``: ``--seq``)."""
        if self.run.training.seq_len is not None:
            return list(self.notes)
        length = (
            f"sequence length {seq_len} (--seq)" if seq_len is not None else
            f"sequence length {self.run.model.seq_len}, the model's: the config states none; "
            "--seq sets it"
        )  # fmt: skip
        return [*self.notes, length]


def _listing(keys: Sequence[str]) -> str:
    shown = ", ".join(keys[:_LISTED])
    return shown + (f" and {len(keys) - _LISTED} more" if len(keys) > _LISTED else "")


@dataclass(frozen=True)
class Options:
    """What the caller gives besides the config: the model (a preset, a ModelSpec file or
    a :class:`ModelSpec`), the cluster (a GPU profile, a cluster profile, a Cluster JSON
    file or a :class:`Cluster`), the GPU count and GPUs per node."""

    model: ModelSpec | None = None
    cluster: str | Cluster | None = None
    gpus: int | None = None
    gpus_per_node: int | None = None

    @classmethod
    def of(
        cls,
        model: str | Path | ModelSpec | None,
        cluster: str | Path | Cluster | None,
        gpus: int | None,
        gpus_per_node: int | None,
    ) -> Options:
        """Options with the model resolved (torch-free: presets and ModelSpec files)."""
        if isinstance(cluster, Path):
            cluster = str(cluster)
        return cls(_model_option(model), cluster, gpus, gpus_per_node)


def _model_option(model: str | Path | ModelSpec | None) -> ModelSpec | None:
    if model is None or isinstance(model, ModelSpec):
        return model
    text = str(model)
    if isinstance(model, Path) or text.endswith(".json") or Path(text).is_file():
        return load_model_spec(text)
    if ":" in text:
        raise SpecError(
            f"--model {text!r}: an imported config is priced on a model spec; a module:function "
            "is traced instead (use planner.make_plan); give a preset (see 'plan models') or "
            "a ModelSpec JSON file"
        )
    return get_preset(text)


class Settings:
    """A config's keys as dotted names (``zero_optimization.stage``) and their values,
    with a record of the keys read, for refusals and the ``used`` note."""

    def __init__(self, values: dict[str, Any], source: str) -> None:
        self.values = values
        self.source = source
        self.used: list[str] = []
        self.asked: set[str] = set()  # every key the importer looked for, present or not

    @classmethod
    def nested(cls, data: dict[str, Any], source: str) -> Settings:
        """Tables (TOML) or objects (JSON) flattened to dotted names; lists are values."""
        flat: dict[str, Any] = {}

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict) and value:
                for key, item in value.items():
                    walk(f"{prefix}.{key}" if prefix else str(key), item)
            else:
                flat[prefix] = value

        walk("", data)
        return cls(flat, source)

    def __contains__(self, key: str) -> bool:
        self.asked.add(key)
        return key in self.values

    def under(self, prefix: str) -> dict[str, Any]:
        """The keys below ``prefix`` (``prefix.x`` as ``x``), marked read."""
        found = {k.removeprefix(prefix + "."): v for k, v in self.values.items()
                 if k.startswith(prefix + ".") or k == prefix}  # fmt: skip
        self.used += [k for k in self.values if k.startswith(prefix + ".") or k == prefix]
        return found

    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key`` (marked read), or ``default`` when absent."""
        self.asked.add(key)
        if key not in self.values:
            return default
        if key not in self.used:
            self.used.append(key)
        return self.values[key]

    def integer(self, key: str, default: int, *, least: int = 1) -> int:
        """An integer >= ``least`` (Megatron's text values are parsed)."""
        value = self.get(key, default)
        number = _as_int(value)
        if number is None or number < least:
            raise self.refuse(key, value, f"expected an integer >= {least}", "give a whole number")
        return number

    def number(self, key: str, default: float) -> float:
        value = self.get(key, default)
        try:
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise ValueError
            return float(value)
        except ValueError:
            raise self.refuse(key, value, "expected a number", "give a number") from None

    def flag(self, key: str, default: bool = False) -> bool:
        value = self.get(key, default)
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if not isinstance(value, bool):
            raise self.refuse(key, value, "expected true or false", "give a boolean")
        return value

    def text(self, key: str, default: str) -> str:
        value = self.get(key, default)
        if not isinstance(value, str):
            raise self.refuse(key, value, "expected a string", "give a name in quotes")
        return value

    def check_unpriced(self, table: dict[str, tuple[tuple[Any, ...], str]]) -> None:
        """Refuse a key of ``table`` (key -> (harmless values, why)) set otherwise (text
        values compared as written: ``"1"`` is 1, ``"false"`` False)."""
        for key, (harmless, why) in table.items():
            value = self.get(key)
            if value not in harmless and str(value).lower() not in {
                str(h).lower() for h in harmless
            }:
                section = key.rpartition(".")[0] if key.endswith(_SWITCHES) else key
                raise self.refuse(key, value, why, f"remove {section} to price the run without it")

    def refuse(self, key: str, value: Any, why: str, fix: str) -> SpecError:
        """``cannot read SOURCE: key = value: why; fix``."""
        shown = str(value).lower() if isinstance(value, bool) else repr(value)
        return SpecError(f"cannot read {self.source}: {key} = {shown}: {why}; {fix}")

    def not_read(self) -> list[str]:
        return [key for key in self.values if key not in self.used]

    def check_misspelled(self, format: str) -> None:
        """Refuse a key nothing read that is a near-miss of one the importer looks for
        (``tensor_paralel_degree``): the framework would refuse it, and taking it as
        unread would price the run without it."""
        for key in self.not_read():
            near = [k for k in sorted(self.asked) if abs(len(k) - len(key)) <= _MISSPELT_CHARS]
            meant = difflib.get_close_matches(key, near, n=1, cutoff=_NEAR_MISS)
            if meant:
                raise self.refuse(
                    key, self.values[key], f"{format} has no such key", f"did you mean {meant[0]}?"
                )


def looks_like_command(text: str) -> bool:
    """Whether ``text`` reads as command-line options: its first word, or the first
    after a training script, is a ``--option``."""
    try:
        words = shlex.split(_joined(text), comments=True)
    except ValueError:
        return False
    return any(word.startswith("--") for word in words[:1] + words[_script(words) + 1 :][:1])


def _joined(text: str) -> str:
    return text.replace("\\\r\n", " ").replace("\\\n", " ")


def _script(words: list[str]) -> int:
    """Index of the training script in a command (``pretrain_gpt.py``, or the module
    after ``-m``), -1 if none."""
    found = [
        i for i, word in enumerate(words)
        if word.endswith(".py") or (i > 0 and words[i - 1] == "-m")
    ]  # fmt: skip
    return found[-1] if found else -1


def command_words(text: str, source: str) -> tuple[list[str], dict[str, str]]:
    """The words after the training script of a command (all of them without one:
    shell quoting, ``#`` comments, ``\\`` line continuations), and the world-size
    options of a launcher (``torchrun --nproc_per_node N --nnodes M``) before it."""
    try:
        words = shlex.split(_joined(text), comments=True)
    except ValueError as exc:
        raise SpecError(f"cannot read {source}: {exc} (shell quoting)") from None
    script = _script(words)
    launcher: dict[str, str] = {}
    for index, word in enumerate(words[: max(script, 0)]):
        name, has, value = word.partition("=")
        if name in _LAUNCH_GPUS + _LAUNCH_NODES:
            launcher[name] = value if has else " ".join(words[index + 1 : index + 2])
    return words[script + 1 :], launcher


def option_values(
    words: list[str], source: str, flags: frozenset[str], framework: str
) -> dict[str, Any]:
    """``--name value`` pairs (or ``--name=value``): an option in ``flags`` or without a
    value is True, one value a string, several a list."""
    values: dict[str, Any] = {}
    name = None
    for word in words:
        if word.startswith("--"):
            name, has, value = word.partition("=")
            values[name] = value if has else True
            if has or name in flags:
                name = None
            continue
        if name is None:
            raise SpecError(
                f"cannot read {source}: {word!r} is no --option and follows no option that "
                f"takes a value; give {framework} options"
            )
        current = values[name]
        values[name] = word if current is True else [*_listed(current), word]
    return values


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def launched_world(settings: Settings) -> tuple[int | None, str]:
    """The GPUs ``torchrun --nproc_per_node N [--nnodes M]`` starts (None without it)."""
    key = next((key for key in _LAUNCH_GPUS if key in settings), None)
    if key is None:
        return None, "no torchrun --nproc_per_node"
    for name in (key, *_LAUNCH_NODES):
        value = settings.get(name)
        if isinstance(value, str) and value.startswith("$"):  # a launch script's variable
            raise settings.refuse(
                name, value, "a shell variable, whose value the config does not hold",
                "write the number, or remove the torchrun options and give --gpus",
            )  # fmt: skip
    return settings.integer(key, 1) * settings.integer("--nnodes", 1), f"torchrun {key} x --nnodes"


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"[+-]?\d+", value.strip()):
        return int(value)
    return None


def _shape(spec: ModelSpec) -> dict[str, Any]:
    """What makes two specs the same model (its name and sequence length aside)."""
    return {
        "family": spec.family, "layers": spec.num_layers, "hidden": spec.hidden_size,
        "heads": spec.num_heads, "kv_heads": spec.kv_heads, "ffn": spec.ffn_size,
        "vocab": spec.vocab_size, "activation": spec.act, "tied": spec.tied_embeddings,
        "norm_eps": spec.norm_eps,
        "rope_theta": spec.rope_theta if spec.family is Family.LLAMA else None,
        "experts": (spec.num_experts, spec.top_k, spec.moe and spec.expert_ffn_size,
                    spec.num_shared_experts, spec.dense_layers),
        "latent": (spec.kv_lora_rank, spec.q_lora_rank, spec.qk_nope_head_dim,
                   spec.qk_rope_head_dim, spec.v_head_dim),
        "head": (spec.head_size, spec.qk_norm),
    }  # fmt: skip


def matching_preset(spec: ModelSpec) -> ModelSpec | None:
    """The zoo preset ``spec`` describes (at ``spec``'s sequence length), if any."""
    for preset in PRESETS.values():
        if _shape(preset) == _shape(spec):
            return preset.with_seq_len(spec.seq_len)
    return None


def choose_model(
    settings: Settings, described: ModelSpec | None, keys: str, option: ModelSpec | None
) -> ModelSpec:
    """The model the config ``described`` (from ``keys``) or, when it names none, the
    ``--model`` option; both must agree when both are given."""
    if described is None:
        if option is None:
            raise SpecError(
                f"cannot read {settings.source}: it does not describe the model ({keys}); give "
                "--model NAME (a preset, see 'plan models') or a ModelSpec JSON file"
            )
        return option
    if option is not None and _shape(option) != _shape(described):
        differ = next(k for k, v in _shape(option).items() if _shape(described)[k] != v)
        raise SpecError(
            f"cannot read {settings.source}: its model ({keys}: {described.name}) and --model "
            f"{option.name} differ in {differ} ({_shape(described)[differ]} vs "
            f"{_shape(option)[differ]}); drop --model, or give the model the config trains"
        )
    return option or described


def resolve_world(settings: Settings, options: Options, derived: int | None, how: str) -> Cluster:
    """The cluster to price on, its GPU count agreeing with the ``derived`` count the
    config implies (``how`` says from what, or why the config leaves it open when
    ``derived`` is None)."""
    source = settings.source
    if derived is not None and options.gpus is not None and derived != options.gpus:
        raise SpecError(
            f"cannot read {source}: {how} = {derived} GPUs, but --gpus is {options.gpus}; "
            "drop --gpus, or change the config's degrees or batch sizes"
        )
    if options.cluster is None:
        raise SpecError(
            "no cluster given: pass --cluster (a GPU profile with --gpus N, a cluster profile "
            "or a cluster.json), or cluster= in Python"
        )
    fixed = _fixed_cluster(options, derived, how, source)
    if fixed is None:  # a GPU profile: the count comes from the config
        return _resolve(options, derived)
    if derived is not None and derived != fixed.num_gpus:
        raise SpecError(
            f"cannot read {source}: {how} = {derived} GPUs, but the cluster has "
            f"num_gpus = {fixed.num_gpus}; change the config, or give a GPU profile as "
            "--cluster with --gpus"
        )
    return fixed


def _fixed_cluster(options: Options, derived: int | None, how: str, source: str) -> Cluster | None:
    """The cluster with its GPU count settled by the options (a Cluster, a cluster profile
    or file, or a GPU profile with --gpus); None for a GPU profile whose count the config
    gives."""
    cluster = options.cluster
    if isinstance(cluster, Cluster):
        if options.gpus is not None and options.gpus != cluster.num_gpus:
            raise SpecError(
                f"gpus = {options.gpus} with a Cluster of num_gpus = {cluster.num_gpus}: "
                "give one of them"
            )
        return cluster
    try:
        return _resolve(options, options.gpus)
    except SpecError as exc:
        if options.gpus is None and derived is not None:
            return None  # a GPU profile: the config's count completes it (or fails again)
        if options.gpus is None:
            raise SpecError(f"cannot read {source}: {how}: {exc}") from None
        raise


def _resolve(options: Options, num_gpus: int | None) -> Cluster:
    """:func:`~planner.clusters.resolve_cluster` of the options' cluster name."""
    per_node = {} if options.gpus_per_node is None else {"gpus_per_node": options.gpus_per_node}
    return resolve_cluster(str(options.cluster), num_gpus=num_gpus, **per_node)


def layers_per_chunk(model: ModelSpec, stages: Sequence[Sequence[str]]) -> list[int]:
    """Transformer blocks in each model chunk of a stage split (module FQNs); raises
    :class:`SpecError` for a module the model does not have."""
    graph = graph_from_spec(model)
    return [
        sum(graph.segment_type(graph.segments[index]).kind == "block" for index in chunk)
        for chunk in stage_indices(graph, stages)
    ]


def chunks_of(model: ModelSpec, counts: Sequence[int]) -> tuple[tuple[str, ...], ...]:
    """The stage split that gives chunk ``i`` ``counts[i]`` consecutive blocks, the
    embeddings on the first and the final norm and head on the last (module FQNs of the
    graph the planner prices)."""
    graph = graph_from_spec(model)
    kinds = [graph.segment_type(segment).kind for segment in graph.segments]
    blocks = [s for s, kind in zip(graph.segments, kinds, strict=True) if kind == "block"]
    first = kinds.index("block")
    before = [m for s in graph.segments[:first] for m in s.modules]
    after = [m for s in graph.segments[first + len(blocks) :] for m in s.modules]
    chunks: list[list[str]] = []
    start = 0
    for count in counts:
        chunks.append([m for s in blocks[start : start + count] for m in s.modules])
        start += count
    chunks[0] = before + chunks[0]
    chunks[-1] = chunks[-1] + after
    return tuple(tuple(chunk) for chunk in chunks)


def build_run(
    settings: Settings,
    *,
    format: str,
    detected: str,
    model: ModelSpec,
    cluster: Cluster,
    training: dict[str, Any],
    strategy: dict[str, Any],
    options: dict[str, Any],
    stages: Sequence[Sequence[str]] = (),
    notes: Sequence[str] = (),
    release: str = "",
) -> ImportedRun:
    """The :class:`ImportedRun`, checked as ``plan estimate`` checks a run config."""
    data = {
        "model": model.model_dump(mode="json"),
        "cluster": cluster.model_dump(mode="json"),
        "training": training,
        "strategy": strategy,
        "options": options,
        "stages": [list(chunk) for chunk in stages],
    }
    settings.check_misspelled(format)
    if not settings.used:
        raise SpecError(
            f"{settings.source} read as {format} gave none of its keys "
            f"({_listing(settings.not_read()) or 'none'}): is it a {format} config? Drop "
            "--format to detect the format, or give the right one"
        )
    run = RunConfig.from_dict(data, f"{settings.source} (read as {format})")
    _check_framework(settings.source, release or format, run)
    return ImportedRun(
        format=format, source=settings.source, detected=detected, run=run,
        used=tuple(k for k in settings.values if k in settings.used), not_read=tuple(settings.not_read()), notes=tuple(notes),
        release=release,
    )  # fmt: skip


def _check_framework(source: str, framework: str, run: RunConfig) -> None:
    """Refuse a run its own framework would refuse (``framework``: ``torchtitan==0.2``
    where the release is known, else the framework: every release of it), with the rule
    the search keeps to under ``--for`` (:func:`planner.frameworks.config_refusal`)."""
    target = parse_target(framework, field="format") if "==" in framework else Framework(framework)
    refusal = config_refusal(target, run.model, run.strategy, run.training)
    if refusal is not None:
        raise SpecError(
            f"{source}: {framework} would not run this: {refusal.describe()}; {refusal.fix}"
        )


def _facts(strategy: Strategy) -> dict[str, object]:
    """What ``plan --from`` compares, in the words it prints."""
    s = strategy
    return {
        "dp": s.dp, "dp_shard": s.shard_degree, "tp": s.tp, "pp": s.pp, "cp": s.cp,
        "ep": s.ep, "etp": s.etp,
        "zero": s.zero, "sp": "on" if s.sequence_parallel else "off",
        "recompute": s.recompute.value,
        "recompute per stage": "/".join(m.value for m in s.recompute_per_stage or ()) or "-",
        "recompute blocks": "all" if s.recompute_blocks is None else s.recompute_blocks,
        "micro-batch": s.micro_batch_size, "micro-batches": s.num_microbatches,
        "schedule": s.schedule.value if s.pp > 1 else "-", "virtual stages": s.virtual_stages,
        "compression": s.compression.describe(),
    }  # fmt: skip


def describe_changes(before: Strategy, after: Strategy) -> str:
    """How ``after`` differs from ``before``, in words: ``tp 8 -> 4, zero 1 -> 3,
    recompute full -> selective`` (``no change`` when they agree)."""
    old, new = _facts(before), _facts(after)
    changes = [
        f"{name} {old[name]} -> {value}" for name, value in new.items() if old[name] != value
    ]
    return ", ".join(changes) or "no change"
