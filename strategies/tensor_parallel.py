"""Tensor and sequence parallelism from the plan's per-module layouts (DTensor).

Any ``{fqn: style}`` dict is accepted, not only the zoo's names:

- ``colwise`` Linear: weight sharded on the output features. Its output stays sharded
  when a ``rowwise`` Linear is a sibling (the Megatron pair); otherwise (an output head)
  it is gathered to a full tensor, or with loss parallel left as a vocabulary-sharded
  DTensor for :func:`~torch.distributed.tensor.parallel.loss_parallel`.
- ``rowwise`` Linear: weight sharded on the input features, output all-reduced
  (reduce-scattered on the sequence dim under sequence parallel).
- ``vocab_parallel`` (or ``rowwise``) Embedding: sharded on the vocabulary, output
  all-reduced; ``colwise`` Embedding: sharded on the embedding dim, output gathered.
- ``sequence_parallel``: norms and other per-token modules run on a sequence shard.
  Without ``strategy.sequence_parallel`` (the residual stream replicated) such a
  module slices its input, runs on the shard and all-gathers its output.
- ``replicate``: left as is (identical on every tensor-parallel rank).

Tied weights (a parameter shared by modules, e.g. ``tok_embeddings.weight is
output.weight``) stay tied: each module's style shards its own reference, then every
reference is pointed back at one DTensor parameter. A vocabulary-parallel embedding
and a column-parallel head both shard the weight on the vocabulary (``Shard(0)``), so
they share it exactly; :func:`planner.validate.check_model_against_plan` refuses
layouts that shard a tied weight differently.

Under sequence parallel the residual stream is a local tensor sharded on the sequence
dim (dim 1). It enters that form at the parent of the first sequence-parallel module
(the first block) of the chunk that takes the model's input; a module holding a
colwise/rowwise pair (attention, MLP) all-gathers its input and the rowwise output is
reduce-scattered back; the gathered ``colwise`` head all-gathers its input.
"""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from planner.errors import SpecError
from planner.spec import Plan, TPStyle
from planner.validate import match_fqns

__all__ = ["apply", "concrete_layout", "tied_parameters"]

log = logging.getLogger(__name__)


def concrete_layout(model: nn.Module, layout: dict[str, TPStyle]) -> dict[str, TPStyle]:
    """Layout keyed by the FQNs of ``model`` (a pipeline chunk may hold only some modules)."""
    names = [name for name, _ in model.named_modules()]
    concrete: dict[str, TPStyle] = {}
    for pattern, style in layout.items():
        for fqn in match_fqns(pattern, names):
            concrete[fqn] = TPStyle(style)
    return concrete


def apply(
    model: nn.Module,
    mesh: DeviceMesh | None,
    plan: Plan,
    *,
    loss_parallel: bool = False,
    holds_input: bool = True,
) -> nn.Module:
    """Shard ``model``'s modules over the ``tp`` axis as ``plan.tp_layout`` says (in place).

    With ``loss_parallel`` the output head keeps its logits sharded on the vocabulary
    (a DTensor); compute the loss under :func:`torch.distributed.tensor.parallel.loss_parallel`.
    ``holds_input`` says the model (chunk) receives the model's input, so under sequence
    parallel it is where the residual stream gets sliced (false for later pipeline chunks).
    """
    if plan.strategy.tp == 1 or mesh is None:
        return model
    layout = concrete_layout(model, plan.tp_layout)
    sequence_parallel = plan.strategy.sequence_parallel
    styles = _styles(model, layout, sequence_parallel, loss_parallel)
    if sequence_parallel:
        if holds_input:
            styles.update(_sequence_parallel_entry(model, layout))
        styles.update(_gather_before_pairs(layout))
    in_block = [] if sequence_parallel else _sequence_parallel_modules(layout)
    tp_mesh = mesh["tp"]
    tied = tied_parameters(model)
    if in_block:
        parallelize_module(model, tp_mesh, dict.fromkeys(in_block, _SLICE_SEQUENCE))
    parallelize_module(model, tp_mesh, styles)
    if in_block:
        parallelize_module(model, tp_mesh, dict.fromkeys(in_block, _GATHER_SEQUENCE))
    for names in tied:
        _retie(model, names)
    log.info(
        "tensor parallel: tp=%d, %d modules sharded%s%s%s",
        plan.strategy.tp,
        len(styles),
        f", {len(tied)} tied parameters kept tied" if tied else "",
        ", sequence parallel" if sequence_parallel else "",
        ", loss parallel" if loss_parallel else "",
    )
    return model


def tied_parameters(model: nn.Module) -> list[list[str]]:
    """Names of each parameter that several modules share (tied weights), one list per parameter."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _retie(model: nn.Module, names: list[str]) -> None:
    """Point every name in ``names`` at the (sharded) parameter the first name now holds."""
    shared = model.get_parameter(names[0])
    for name in names[1:]:
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        if _placements(getattr(module, attr)) != _placements(shared):
            raise SpecError(
                f"tied parameters {names[0]!r} and {name!r} were sharded differently by "
                f"plan.tp_layout ({_placements(shared)} vs {_placements(getattr(module, attr))}): "
                "give both modules layouts that shard the same dimension, or replicate both"
            )
        module.register_parameter(attr, shared)


def _placements(param: nn.Parameter) -> tuple[object, ...]:
    return tuple(param.placements) if isinstance(param, DTensor) else ("unsharded",)


def _styles(
    model: nn.Module, layout: dict[str, TPStyle], sp: bool, loss_parallel: bool
) -> dict[str, ParallelStyle]:
    modules = dict(model.named_modules())
    return {
        fqn: _style(fqn, modules[fqn], style, layout, sp, loss_parallel)
        for fqn, style in layout.items()
        if style is not TPStyle.REPLICATE
    }


def _style(
    fqn: str,
    module: nn.Module,
    style: TPStyle,
    layout: dict[str, TPStyle],
    sp: bool,
    loss_parallel: bool,
) -> ParallelStyle:
    seq_or_full = Shard(1) if sp else Replicate()
    if isinstance(module, nn.Embedding):
        return _embedding_style(style)
    if style is TPStyle.COLWISE:
        if _has_rowwise_sibling(fqn, layout):
            return ColwiseParallel()
        if loss_parallel:
            return ColwiseParallel(
                input_layouts=seq_or_full, output_layouts=Shard(-1), use_local_output=False
            )
        return ColwiseParallel(input_layouts=seq_or_full, output_layouts=Replicate())
    if style is TPStyle.ROWWISE:
        return RowwiseParallel(output_layouts=seq_or_full)
    if style is TPStyle.SEQUENCE_PARALLEL:
        return SequenceParallel(use_local_output=sp)
    raise AssertionError(f"unhandled layout {style!r} for {fqn!r}")


def _sequence_parallel_modules(layout: dict[str, TPStyle]) -> list[str]:
    return [fqn for fqn, style in layout.items() if style is TPStyle.SEQUENCE_PARALLEL]


# A sequence-parallel module inside a replicated stream: slice its input on the sequence
# dim, run it on the shard, all-gather its output.
_SLICE_SEQUENCE = PrepareModuleInput(
    input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=False
)
_GATHER_SEQUENCE = PrepareModuleOutput(
    output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=True
)


def _embedding_style(style: TPStyle) -> ParallelStyle:
    if style is TPStyle.COLWISE:
        return ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())


def _has_rowwise_sibling(fqn: str, layout: dict[str, TPStyle]) -> bool:
    parent = fqn.rpartition(".")[0]
    return any(
        style is TPStyle.ROWWISE and other.rpartition(".")[0] == parent
        for other, style in layout.items()
    )


def _gather_before_pairs(layout: dict[str, TPStyle]) -> dict[str, ParallelStyle]:
    """Under SP, a module holding a colwise/rowwise pair gathers its sequence-sharded input."""
    parents = {
        fqn.rpartition(".")[0]
        for fqn, style in layout.items()
        if style is TPStyle.COLWISE and _has_rowwise_sibling(fqn, layout)
    }
    gather = PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
    )
    return {parent: gather for parent in sorted(parents)}


def _sequence_parallel_entry(
    model: nn.Module, layout: dict[str, TPStyle]
) -> dict[str, ParallelStyle]:
    """Slice the full residual stream to a sequence shard where it enters the SP region."""
    first_sp = next(
        (fqn for fqn, _ in model.named_modules() if layout.get(fqn) is TPStyle.SEQUENCE_PARALLEL),
        None,
    )
    if first_sp is None:
        return {}
    entry = first_sp.rpartition(".")[0]
    return {
        entry: PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
    }
