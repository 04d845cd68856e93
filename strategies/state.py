"""This rank's training state as Distributed Checkpoint (DCP) sees it: save, resume under
any plan, and model weights from a checkpoint or a Hugging Face safetensors directory.

Every tensor of the model and the optimizer goes to DCP as what it is of the whole
model, under the whole model's FQN (pipeline chunks keep them): a DTensor over the
plan's mesh (FSDP/HSDP and tensor-parallel shards; DDP-over-TP shards wrapped back from
their locals, :func:`strategies.data_parallel.as_shard_of`) or a plain tensor (a
replica: DCP writes one copy). DCP writes each rank's shards and reads, for each rank,
the overlap of what was saved with what the rank holds. So a checkpoint saved under one
plan loads under any other, and a rank's peak host memory while loading is its shards
plus one saved chunk (at most one tensor).

A checkpoint root holds ``step-00000100/`` (one DCP checkpoint) per save and ``latest``
(the name of the newest complete one). A save writes ``step-N.partial``, renames it once
every rank finished, then replaces ``latest`` atomically, so a save killed half-way
leaves the previous checkpoint the latest. Keys, as DCP flattens them:

- ``model.<fqn>``: parameters and persistent buffers;
- ``optimizer.<fqn>.<key>``: each parameter's optimizer state (``exp_avg``, ``step``...);
- ``param_groups.<fqn>.<key>``: the hyperparameters of its group (``lr``, ``betas``...);
- ``meta.step``, ``meta.plan``: the step and the plan it was saved under;
- ``carried.rank<r>``: what rank ``r``'s gradient compression carries between steps
  (:func:`strategies.compression.carried_state`), when it carries anything;
- ``replicas.rank<r>.model...``, ``replicas.rank<r>.optimizer...``: rank ``r``'s own
  replica, where replicas differ (local SGD).
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.optim.lr_scheduler import LRScheduler

from planner.errors import SpecError
from planner.io import dumps_json, parse_json, write_text_atomic
from planner.models.hf_layout import (
    ExpertTensors,
    check_hf_config,
    hf_aliases,
    hf_names_for,
    per_expert_layouts,
)
from strategies.data_parallel import as_shard_of

__all__ = [
    "ModelState",
    "model_state",
    "local_part",
    "save",
    "load",
    "checkpoint_path",
    "WeightSource",
    "weight_source",
    "load_weights",
    "export_hf",
    "LATEST",
]

log = logging.getLogger(__name__)

LATEST = "latest"  # the file naming the newest complete checkpoint of a root
_PARTIAL = ".partial"
_METADATA = ".metadata"  # DCP's index of a checkpoint
_HF_INDEX = "model.safetensors.index.json"  # which file holds each tensor of a sharded model


@dataclass(frozen=True)
class ModelState:
    """This rank's model tensors as DCP sees them: ``tensors`` maps each FQN of the whole
    model to a DTensor of the whole tensor, or a plain replica, sharing storage with what
    the rank trains; ``names`` gives the (first) FQN of each parameter or buffer object."""

    tensors: dict[str, torch.Tensor]
    names: dict[int, str]


def model_state(
    modules: Iterable[nn.Module], parameters: Iterable[tuple[str, torch.Tensor]] = ()
) -> ModelState:
    """Parameters and persistent buffers of ``modules`` (the rank's model or pipeline
    chunks, unwrapped) as they are now, tied ones under each of their names; ``names``
    covers ``parameters`` (the (FQN, parameter) pairs an optimizer is given, when the
    modules no longer list them: DDP over tensor-parallel shards) and the modules' own."""
    tensors: dict[str, torch.Tensor] = {}
    names: dict[int, str] = {}
    for fqn, param in parameters:
        names.setdefault(id(param), fqn)
    for module in modules:
        for fqn, tensor in module.state_dict(keep_vars=True).items():
            tensors[fqn] = as_shard_of(tensor.detach(), tensor)
            names.setdefault(id(tensor), fqn)
    return ModelState(tensors, names)


def local_part(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """The part of ``tensor`` this rank holds and where it lies in the whole tensor: a
    DTensor's local shard at its offset, else all of it."""
    data = tensor.data if isinstance(tensor, nn.Parameter) else tensor
    if not isinstance(data, DTensor):
        return data, ()
    shape, offset = compute_local_shape_and_global_offset(
        data.shape, data.device_mesh, data.placements
    )
    return data.to_local(), tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))


# ---- save and resume


def save(
    root: str | Path,
    model: ModelState,
    *,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    plan: str,
    scheduler: LRScheduler | None = None,
    carried: bytes | None = None,
    per_rank: bool = False,
) -> Path:
    """Write a checkpoint of ``model`` (and ``optimizer``'s and ``scheduler``'s state, and
    this rank's ``carried`` compression state) at ``step`` under ``root`` on every rank,
    atomically; returns its directory. ``plan`` says what saved it (plan and world size).

    ``per_rank`` also keeps each rank's own model and optimizer state, for replicas that
    differ (local SGD): a run under the same plan resumes each rank from its own."""
    if step < 0:
        raise SpecError(f"save: step = {step}; give the number of optimizer steps taken (>= 0)")
    root = Path(root)
    final = root / f"step-{step:08d}"
    partial = final.with_name(final.name + _PARTIAL)
    if _rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)  # a save killed before
        partial.mkdir(parents=True)
    _barrier()
    state: dict[str, Any] = {
        "model": dict(model.tensors),
        "meta": {"step": step, "plan": plan},
    }
    if optimizer is not None:
        state["optimizer"], state["param_groups"] = _optimizer_state(optimizer, model)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if carried is not None:
        state["carried"] = {f"rank{_rank()}": carried}
    if per_rank:
        own: dict[str, Any] = {"model": dict(model.tensors)}
        if optimizer is not None:
            own["optimizer"] = state["optimizer"]
        state["replicas"] = {f"rank{_rank()}": own}
    _dcp_save(state, FileSystemWriter(partial))
    _barrier()
    if _rank() == 0:
        _publish(root, final, partial)
    _barrier()
    log.info("checkpoint: step %d saved to %s", step, final)
    return final


def _publish(root: Path, final: Path, partial: Path) -> None:
    """Make ``partial`` the checkpoint ``final`` and the latest, each by one rename."""
    if final.exists():  # saved again at the same step: the old one goes once replaced
        stale = final.with_name(final.name + ".old")
        shutil.rmtree(stale, ignore_errors=True)
        final.rename(stale)
        partial.rename(final)
        shutil.rmtree(stale)
    else:
        partial.rename(final)
    write_text_atomic(root / LATEST, final.name + "\n", option="checkpoint")


def checkpoint_path(root: str | Path, step: int | None = None) -> Path:
    """The checkpoint directory of ``root`` at ``step`` (the latest when ``None``); ``root``
    may be a checkpoint directory itself."""
    root = Path(root)
    if (root / _METADATA).is_file() and step is None:
        return root
    if step is not None:
        path = root / f"step-{step:08d}"
    elif (root / LATEST).is_file():
        path = root / (root / LATEST).read_text().strip()
    else:
        raise SpecError(
            f"checkpoint {str(root)!r} has no {LATEST!r} file and is not a checkpoint "
            "directory: give the directory parallel.save wrote (or plan run --checkpoint-dir)"
        )
    if not (path / _METADATA).is_file():
        saved = sorted(p.name for p in root.glob("step-*") if (p / _METADATA).is_file())
        raise SpecError(
            f"checkpoint {str(path)!r} does not exist or is incomplete; complete ones in "
            f"{str(root)!r}: {', '.join(saved) or 'none'}"
        )
    return path


def load(
    root: str | Path,
    model: ModelState,
    *,
    optimizer: torch.optim.Optimizer | None,
    step: int | None,
    plan: str = "",
    scheduler: LRScheduler | None = None,
    restore: Callable[[bytes], None] | None = None,
) -> int:
    """Read the checkpoint of ``root`` at ``step`` (the latest when ``None``) into
    ``model``, ``optimizer`` and ``scheduler`` in place, whatever plan saved it; returns
    its step.

    Where the checkpoint keeps each rank's own replica (:func:`save` ``per_rank``) and
    ``plan`` (this run's plan and world size) saved it, each rank reads its own;
    ``restore(carried)`` gets this rank's saved compression state, if any."""
    path = checkpoint_path(root, step)
    reader = FileSystemReader(path)
    saved = reader.read_metadata().state_dict_metadata
    _check_covers(path, saved, model.tensors, _checkpoint_keys(model.tensors))
    meta: dict[str, Any] = {"meta": {"step": 0, "plan": ""}}
    _dcp_load(meta, reader)
    rank = f"rank{_rank()}"
    own = f"replicas.{rank}."
    replicas = meta["meta"]["plan"] == plan and any(key.startswith(own) for key in saved)
    body: dict[str, Any] = {"model": dict(model.tensors)}  # the rank's own or the shared
    state: dict[str, Any] = {"replicas": {rank: body}} if replicas else body
    if optimizer is not None:
        _fill_state(optimizer)
        entries, groups = _optimizer_state(optimizer, model)
        prefix = own if replicas else ""
        body["optimizer"] = _saved_part(entries, prefix + "optimizer", saved, path)
        state["param_groups"] = _saved_part(groups, "param_groups", saved, path)
    if scheduler is not None:
        state["scheduler"] = _saved_scheduler(scheduler, saved, path)
    if restore is not None and f"carried.{rank}" in saved:
        state["carried"] = {rank: b""}
    _dcp_load(state, reader)
    if optimizer is not None:
        _set_hyperparameters(optimizer, model, state["param_groups"])
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    if "carried" in state:
        assert restore is not None
        restore(state["carried"][rank])
    step_loaded = int(meta["meta"]["step"])
    log.info("checkpoint: step %d loaded from %s (saved under %s%s)", step_loaded, path,
             meta["meta"]["plan"], ", each rank its own replica" if replicas else "")  # fmt: skip
    return step_loaded


def _saved_scheduler(scheduler: LRScheduler, saved: dict[str, Any], path: Path) -> dict[str, Any]:
    """``scheduler``'s state to read the checkpoint's into; refused where the checkpoint
    has none, or another scheduler's."""
    template = scheduler.state_dict()
    mine = {f"scheduler.{key}" for key in template}
    theirs = {key for key in saved if key.startswith("scheduler.")}
    if not theirs:
        raise SpecError(
            f"checkpoint {str(path)!r} holds no learning-rate scheduler: it was saved without "
            "scheduler=; load it without one (and step a new scheduler to the checkpoint's "
            "step), or save with parallel.save(..., scheduler=scheduler)"
        )
    if theirs != mine:
        raise SpecError(
            f"checkpoint {str(path)!r} holds another scheduler's state (keys "
            f"{sorted(k.removeprefix('scheduler.') for k in theirs ^ mine)} differ from "
            f"{type(scheduler).__name__}'s): build the scheduler the checkpoint was saved with"
        )
    return template


def _checkpoint_keys(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Each model FQN's key in a :func:`save` checkpoint."""
    return {fqn: f"model.{fqn}" for fqn in tensors}


def _check_covers(
    path: Path, saved: dict[str, Any], tensors: dict[str, torch.Tensor], names: dict[str, str]
) -> None:
    """Raise unless the checkpoint (``saved``: its metadata by key) holds every tensor of
    the model, whole-shaped alike."""
    missing = [fqn for fqn in tensors if names[fqn] not in saved]
    if missing:
        raise SpecError(
            f"checkpoint {str(path)!r} has no {names[missing[0]]!r} for the model's "
            f"{missing[0]!r} ({len(missing)} of {len(tensors)} tensors missing): it was "
            "saved from another model; load it into the model that saved it"
        )
    for fqn, tensor in tensors.items():
        entry = saved[names[fqn]]
        size = tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else None
        if size != tuple(tensor.shape):
            raise SpecError(
                f"checkpoint {str(path)!r}: {names[fqn]!r} has shape {size} but the model's "
                f"{fqn!r} has {tuple(tensor.shape)}: the checkpoint is of another model size"
            )


# ---- optimizer state


def _optimizer_state(
    optimizer: torch.optim.Optimizer, model: ModelState
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Each parameter's optimizer state (tensors shaped like it laid out as it is) and its
    group's hyperparameters, keyed by the parameter's FQN."""
    state: dict[str, dict[str, Any]] = {}
    groups: dict[str, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        hyper = {key: value for key, value in group.items() if key != "params"}
        for param in group["params"]:
            fqn = model.names.get(id(param))
            if fqn is None:
                raise SpecError(
                    f"the optimizer holds a parameter of shape {tuple(param.shape)} that is "
                    "not the model's: give the optimizer parallel.parameters()"
                )
            groups[fqn] = hyper
            state[fqn] = {
                key: as_shard_of(value, param) if _is_tensor_like(value, param) else value
                for key, value in optimizer.state.get(param, {}).items()
            }
    return state, groups


def _is_tensor_like(value: object, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.shape == param.shape and value.ndim > 0


def _fill_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter its optimizer state (one step at learning rate 0 on zero
    gradients, which changes no parameter), so loading has tensors to write into."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if all(p in optimizer.state for p in params):
        return
    rates = [group["lr"] for group in optimizer.param_groups]
    grads = [p.grad for p in params]
    with _without_step_hooks(optimizer):
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    for p, grad in zip(params, grads, strict=True):
        p.grad = grad


@contextlib.contextmanager
def _without_step_hooks(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """No optimizer-step hooks (local SGD's averaging) around a step that is not one."""
    from torch.optim import optimizer as optim_module

    kept_global = dict(optim_module._global_optimizer_post_hooks)
    kept_own = dict(optimizer._optimizer_step_post_hooks)
    optim_module._global_optimizer_post_hooks.clear()
    optimizer._optimizer_step_post_hooks.clear()
    try:
        yield
    finally:
        optim_module._global_optimizer_post_hooks.update(kept_global)
        optimizer._optimizer_step_post_hooks.update(kept_own)


def _saved_part(
    part: dict[str, dict[str, Any]], prefix: str, saved: dict[str, Any], path: Path
) -> dict[str, dict[str, Any]]:
    """``part`` with only the entries the checkpoint (``saved``: its metadata by key)
    holds; raise when it holds a parameter's state under other keys (another optimizer)."""
    kept: dict[str, dict[str, Any]] = {}
    for fqn, entries in part.items():
        present = {key: v for key, v in entries.items() if f"{prefix}.{fqn}.{key}" in saved}
        if present and len(present) != len(entries):
            absent = next(key for key in entries if key not in present)
            raise SpecError(
                f"checkpoint {str(path)!r} has {prefix} entries for {fqn!r} but no {absent!r}: "
                "it was saved with another optimizer; build the one that saved it"
            )
        if present:
            kept[fqn] = present
    return kept


def _set_hyperparameters(
    optimizer: torch.optim.Optimizer, model: ModelState, loaded: dict[str, dict[str, Any]]
) -> None:
    """Each group's hyperparameters from its first parameter's saved group."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            saved = loaded.get(model.names[id(param)])
            if saved is not None:
                group.update(saved)
                break


# ---- model weights from a checkpoint or a Hugging Face directory


@dataclass(frozen=True)
class WeightSource:
    """Where a model's weights come from: ``names`` maps each of the model's FQNs to its
    key in the checkpoint at ``path`` (a :func:`save` checkpoint, or Hugging Face
    ``*.safetensors`` files); ``experts`` the grouped experts weights stored one tensor
    per expert there (their ``names`` entry describes the pattern); ``files`` which
    safetensors file holds each tensor."""

    path: Path
    hugging_face: bool
    names: dict[str, str]
    experts: dict[str, ExpertTensors] = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)

    def reader(self) -> FileSystemReader:
        if self.hugging_face:
            from torch.distributed.checkpoint import HuggingFaceStorageReader

            return HuggingFaceStorageReader(str(self.path))
        return FileSystemReader(self.path)

    def describe(self) -> str:
        kind = "Hugging Face safetensors" if self.hugging_face else "checkpoint"
        return f"{kind} {str(self.path)!r}"


def weight_source(path: str | Path, model: nn.Module) -> WeightSource:
    """Where ``model``'s weights are in ``path``, checked against the model (reads only
    the files' headers: call it before any collective).

    ``path`` is a checkpoint root or directory from :func:`save`, or a directory of
    Hugging Face ``*.safetensors`` files, named as
    :func:`planner.models.hf_layout.hf_names_for` says (or the other spelling
    :func:`~planner.models.hf_layout.hf_aliases` gives); a weight tied to another loads
    from the other's name when its own is absent (Hugging Face omits ``lm_head.weight``
    under ``tie_word_embeddings``). Grouped experts weights absent as such load from
    their per-expert tensors (:func:`~planner.models.hf_layout.per_expert_layouts`).
    """
    path = Path(path)
    tensors = model_state([model]).tensors
    if path.is_file():
        raise SpecError(
            f"weights {str(path)!r} is a file: give the directory that holds it "
            f"({str(path.parent)!r}), with every *.safetensors file of the model"
        )
    if not path.is_dir():
        raise SpecError(
            f"weights {str(path)!r}: no such directory; give a Hugging Face model directory "
            "(*.safetensors) or a checkpoint directory from parallel.save"
        )
    if not any(path.glob("*.safetensors")):
        _refuse_pickles(path)
        source = WeightSource(checkpoint_path(path), False, {})
        names = _checkpoint_keys(tensors)
        saved = source.reader().read_metadata().state_dict_metadata
        _check_covers(source.path, saved, tensors, names)
        model_keys = {key for key in saved if key.startswith(_MODEL_PREFIX)}
        _refuse_unread(source.describe(), model_keys - set(names.values()))
        return WeightSource(source.path, False, names)
    files = _safetensors_files(path)
    source = WeightSource(path, True, {})
    metadata = source.reader().read_metadata()
    saved = metadata.state_dict_metadata
    rename = hf_names_for(model)
    check_hf_config(model, path)
    names = {fqn: _saved_name(rename(fqn), saved) for fqn in tensors}
    names = _tied_names(model, names, metadata)
    experts = _per_expert_sources(path, tensors, names, saved)
    rest = {fqn: t for fqn, t in tensors.items() if fqn not in experts}
    _check_covers(path, saved, rest, names)
    _check_tied_copies(source.describe(), model, names, files)
    read = {names[fqn] for fqn in rest} | {
        name for fqn, layout in experts.items() for name in layout.names(tensors[fqn].shape[0])
    }
    ignored = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()
    _refuse_unread(
        source.describe(),
        {
            key for key in saved
            if key not in read and not _HF_BUFFERS.search(key)
            and not any(re.search(pattern, key) for pattern in ignored)
        },
    )  # fmt: skip
    return WeightSource(path, True, names, experts, files)


_MODEL_PREFIX = "model."  # a save() checkpoint's model keys
# buffers Hugging Face checkpoints of older transformers hold, which models rebuild
_HF_BUFFERS = re.compile(r"\.(inv_freq|masked_bias|attn\.bias)$")


def _refuse_pickles(path: Path) -> None:
    """Refuse a directory of PyTorch pickles (``pytorch_model.bin``), which is not read."""
    pickles = sorted(p.name for p in path.glob("*.bin"))
    if pickles and not (path / LATEST).exists():
        raise SpecError(
            f"weights {str(path)!r} holds {pickles[0]} and no *.safetensors: pickled "
            "checkpoints are not read; write the model with save_pretrained(DIR, "
            "safe_serialization=True) (transformers) and give that directory"
        )


def _refuse_unread(where: str, unread: set[str]) -> None:
    """Refuse a checkpoint holding tensors the model has none of: one of another model
    (more layers or experts) would otherwise load in part, silently."""
    if unread:
        first = sorted(unread)[0]
        raise SpecError(
            f"{where} holds {len(unread)} tensors the model has none of (first: {first!r}): "
            "they are of another model (more layers or experts?); build the model from the "
            "checkpoint's own config, or give the checkpoint of this one"
        )


def _check_tied_copies(
    where: str, model: nn.Module, names: dict[str, str], files: dict[str, Path]
) -> None:
    """Refuse a weight the model ties to another (``tie_word_embeddings``) that the
    checkpoint holds apart with other values: loading would keep one and drop the other."""
    for owner, fqn in _tied(model):
        a, b = names[owner], names[fqn]
        if a != b and a in files and b in files and not _same_values(files, a, b):
            raise SpecError(
                f"{where} holds {b!r} apart from {a!r}, with other values, but the model ties "
                f"{fqn!r} to {owner!r}: build it untied (tie_word_embeddings=False), as the "
                "checkpoint was saved"
            )


def _same_values(files: dict[str, Path], a: str, b: str, rows: int = 1024) -> bool:
    """Whether safetensors tensors ``a`` and ``b`` are equal, compared ``rows`` at a time."""
    from safetensors import safe_open

    with safe_open(files[a], framework="pt") as first, safe_open(files[b], framework="pt") as other:
        left, right = first.get_slice(a), other.get_slice(b)
        shape = left.get_shape()
        if shape != right.get_shape():
            return False
        return all(
            torch.equal(left[start : start + rows], right[start : start + rows])
            for start in range(0, shape[0] if shape else 1, rows)
        )


def _saved_name(name: str, saved: dict[str, Any]) -> str:
    """``name``, or its other spelling where only that one is in the checkpoint."""
    return next((alias for alias in hf_aliases(name) if alias in saved), name)


def _per_expert_sources(
    path: Path, tensors: dict[str, torch.Tensor], names: dict[str, str], saved: dict[str, Any]
) -> dict[str, ExpertTensors]:
    """The grouped experts weights the checkpoint holds one tensor per expert (their
    ``names`` entries become the pattern), each per-expert tensor's shape checked."""
    experts: dict[str, ExpertTensors] = {}
    for fqn, tensor in tensors.items():
        layouts = per_expert_layouts(names[fqn])
        if names[fqn] in saved or not layouts:
            continue
        count = tensor.shape[0]
        layout = next((lay for lay in layouts if lay.name(0, lay.parts[0]) in saved), layouts[0])
        part_shape = (tensor.shape[1] // len(layout.parts), tensor.shape[2])
        for name in layout.names(count):
            entry = saved.get(name)
            if entry is None:
                raise SpecError(
                    f"Hugging Face safetensors {str(path)!r} have no {name!r} for expert "
                    f"weights of the model's {fqn!r} {tuple(tensor.shape)} (nor the grouped "
                    f"{names[fqn]!r}): they are of another model; give its directory"
                )
            size = tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else None
            if size != part_shape:
                raise SpecError(
                    f"Hugging Face safetensors {str(path)!r}: {name!r} has shape {size} but "
                    f"the model's {fqn!r} {tuple(tensor.shape)} takes {part_shape} per "
                    "expert: the checkpoint is of another model size"
                )
        experts[fqn] = layout
        names[fqn] = layout.describe()
    return experts


def _tied(model: nn.Module) -> list[tuple[str, str]]:
    """(owner, fqn) of each parameter tied to one named before it (``tie_word_embeddings``:
    the embedding, then the head)."""
    first: dict[int, str] = {}
    pairs = []
    for fqn, param in model.named_parameters(remove_duplicate=False):
        owner = first.setdefault(id(param), fqn)
        if owner != fqn:
            pairs.append((owner, fqn))
    return pairs


def _tied_names(model: nn.Module, names: dict[str, str], metadata: Metadata) -> dict[str, str]:
    """``names`` with each tied weight absent from the checkpoint read from the name of
    the weight it is tied to (either way: safetensors' ``save_model`` may keep either)."""
    saved = metadata.state_dict_metadata
    resolved = dict(names)
    for owner, fqn in _tied(model):
        if names[fqn] not in saved and names[owner] in saved:
            resolved[fqn] = names[owner]
        elif names[owner] not in saved and names[fqn] in saved:
            resolved[owner] = names[fqn]
    return resolved


def load_weights(model: ModelState, source: WeightSource) -> None:
    """Read this rank's part of each of ``model``'s tensors from ``source`` in place
    (collective); grouped experts stored per expert: only the experts and rows the
    rank holds, a slice of one expert's tensor at a time."""
    state: dict[str, torch.Tensor] = {}
    targets: set[int] = set()  # local storages already read into (a tied weight: once)
    for fqn, tensor in model.tensors.items():
        local, _ = local_part(tensor)
        if fqn in source.experts or (local.numel() and local.data_ptr() in targets):
            continue
        targets.add(local.data_ptr())
        state[source.names[fqn]] = tensor
    _dcp_load(state, source.reader())
    if source.experts:
        _read_experts(model, source)
    log.info("weights: %d tensors loaded from %s", len(model.tensors), source.describe())


def _read_experts(model: ModelState, source: WeightSource) -> None:
    """Each per-expert-stored grouped weight's part this rank holds, sliced from the
    safetensors files (no collective)."""
    from safetensors import safe_open

    files = source.files
    with contextlib.ExitStack() as stack:
        handles = {
            file: stack.enter_context(safe_open(file, framework="pt"))
            for file in set(files.values())
        }

        def read(name: str, rows: slice, columns: slice) -> torch.Tensor:
            return handles[files[name]].get_slice(name)[rows, columns]

        for fqn, layout in source.experts.items():
            tensor = model.tensors.get(fqn)
            if tensor is None:  # a layer of another pipeline stage
                continue
            local, box = local_part(tensor)
            if not local.numel():
                continue
            box = box or tuple(slice(0, n) for n in tensor.shape)
            with torch.no_grad():
                _fill_experts(local, box, tensor.shape[1], layout, read)


def _fill_experts(
    local: torch.Tensor,
    box: tuple[slice, ...],
    height: int,
    layout: ExpertTensors,
    read: Callable[[str, slice, slice], torch.Tensor],
) -> None:
    """Copy into ``local``, the part ``box`` of a grouped weight ``[E, height, H]`` whose
    dim 1 stacks ``layout.parts``, the rows of each of its experts' parts, each read by
    ``read(name, rows, columns)``."""
    experts, rows, columns = box
    per_part = height // len(layout.parts)
    for j, expert in enumerate(range(experts.start, experts.stop)):
        for k, part in enumerate(layout.parts):
            start, stop = max(rows.start, k * per_part), min(rows.stop, (k + 1) * per_part)
            if start < stop:
                inside = slice(start - k * per_part, stop - k * per_part)
                target = local[j, start - rows.start : stop - rows.start]
                target.copy_(read(layout.name(expert, part), inside, columns))


def _safetensors_files(path: Path) -> dict[str, Path]:
    """Which ``*.safetensors`` file of ``path`` holds each tensor (headers only), every
    file its index names present and every header whole."""
    from safetensors import safe_open

    index = path / _HF_INDEX
    if index.is_file():
        listed = set(parse_json(index.read_text(), str(index), what="index").get("weight_map", {})
                     .values())  # fmt: skip
        absent = sorted(name for name in listed if not (path / name).is_file())
        if absent:
            raise SpecError(
                f"Hugging Face safetensors {str(path)!r}: {absent[0]} ({len(absent)} of "
                f"{len(listed)} files {_HF_INDEX} names) is not there; copy the model's every "
                "file"
            )
    files: dict[str, Path] = {}
    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(file, framework="pt") as handle:
                files |= dict.fromkeys(handle.keys(), file)
        except Exception as error:  # safetensors raises its own SafetensorError
            raise SpecError(
                f"Hugging Face safetensors {str(file)!r} cannot be read ({error}): the file is "
                "truncated or not safetensors; copy it again"
            ) from error
    return files


def _dcp_save(state: dict[str, Any], writer: FileSystemWriter) -> None:
    with _quiet_when_alone():
        dcp.save(state, storage_writer=writer, no_dist=not dist.is_initialized())


def _dcp_load(
    state: dict[str, Any], reader: FileSystemReader, *, one_process: bool = False
) -> None:
    """DCP's load; ``one_process`` reads on this rank alone (no collective)."""
    with _quiet_when_alone():
        dcp.load(state, storage_reader=reader, no_dist=one_process or not dist.is_initialized())


@contextlib.contextmanager
def _quiet_when_alone() -> Iterator[None]:
    """Without DCP's warning that it runs as one process (it always says so)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# ---- export


def export_hf(
    checkpoint: str | Path,
    directory: str | Path,
    *,
    rename: Callable[[str], str] | None = None,
    config: dict[str, Any] | None = None,
    max_shard_bytes: int = 2**30,
) -> Path:
    """Write the model of a :func:`save` checkpoint as a Hugging Face safetensors directory
    (full tensors, in one process, whatever plan saved it), with ``config`` as
    ``config.json``.

    Tensors are read from the checkpoint a shard file at a time (at most
    ``max_shard_bytes`` of them, or one tensor if larger), so memory stays bounded by one
    shard; ``rename(fqn)`` gives each tensor's name (unchanged when ``None``); a grouped
    experts weight is written one tensor per expert, as Hugging Face checkpoints keep
    them (:func:`_hf_tensors`). The directory appears whole or not at all (written beside
    it, then renamed).
    """
    from safetensors.torch import save_file

    path = checkpoint_path(checkpoint)
    out = Path(directory)
    if out.exists():
        raise SpecError(f"export directory {str(out)!r} exists: give a new directory")
    staging = out.with_name(out.name + _PARTIAL)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    rename = rename or (lambda fqn: fqn)
    shards = _export_shards(FileSystemReader(path).read_metadata(), max_shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for number, keys in enumerate(shards, start=1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = _hf_tensors(_read_whole(path, keys), rename)
        save_file(tensors, staging / name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, name)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (staging / "model.safetensors.index.json").write_text(dumps_json(index, what="the index"))
    if config is not None:
        (staging / "config.json").write_text(dumps_json(config, what="the config"))
    staging.rename(out)
    log.info("export: %d tensors, %d bytes in %d files to %s", len(weight_map), total,
             len(shards), out)  # fmt: skip
    return out


def _hf_tensors(
    tensors: dict[str, torch.Tensor], rename: Callable[[str], str]
) -> dict[str, torch.Tensor]:
    """``tensors`` under their Hugging Face names; each grouped experts weight split into
    its per-expert tensors under the first of
    :func:`~planner.models.hf_layout.per_expert_layouts` (Mixtral's ``w1/w3/w2`` under
    ``block_sparse_moe``, ``gate_proj/up_proj/down_proj`` under ``mlp``)."""
    named: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        name = rename(key)
        layouts = per_expert_layouts(name)
        if not layouts:
            named[name] = tensor
            continue
        layout = layouts[0]
        for part, rows in zip(layout.parts, tensor.chunk(len(layout.parts), dim=1), strict=True):
            named |= {layout.name(e, part): rows[e].clone() for e in range(tensor.shape[0])}
    return named


def _export_shards(metadata: Metadata, max_bytes: int) -> list[list[str]]:
    """The model's FQNs in file order, cut into shards of at most ``max_bytes``."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, entry in metadata.state_dict_metadata.items():
        if not key.startswith("model.") or not isinstance(entry, TensorStorageMetadata):
            continue
        nbytes = entry.size.numel() * entry.properties.dtype.itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key.removeprefix("model."))
        size += nbytes
    return shards


def _read_whole(path: Path, fqns: list[str]) -> dict[str, torch.Tensor]:
    """The whole tensors ``fqns`` of the model in checkpoint ``path`` (one process)."""
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    state: dict[str, torch.Tensor] = {}
    for fqn in fqns:
        entry = saved[f"model.{fqn}"]
        assert isinstance(entry, TensorStorageMetadata)
        state[fqn] = torch.empty(entry.size, dtype=entry.properties.dtype)
    _dcp_load({"model": state}, FileSystemReader(path), one_process=True)
    return state
