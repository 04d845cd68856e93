"""Tensor and sequence parallelism: the plan's per-module layout, applied as written.

``plan.tp_layout`` maps module FQNs (or ``*`` patterns) to a
:class:`~planner.spec.ModuleTP`; this module does exactly what each entry says, with
no guess from module names (the planner derived every entry from the sharding ILP and
rehearsed it on the model's code):

- ``params``: each listed parameter becomes a DTensor with that placement on the
  ``tp`` axis (``Shard(0)``, ``Shard(1)``, ``Replicate()``); unlisted ones stay plain.
  Parameters shared by several modules (tied weights) stay one parameter.
- ``input``: the module's first argument, a local tensor placed as ``input[0]`` (or a
  DTensor handed on by the module before), is redistributed to ``input[1]``; a module
  with DTensor parameters computes on the DTensor, any other on its local tensor.
- ``output``: the result, placed ``output[0]``, is redistributed to ``output[1]`` and
  handed on as a local tensor, or as a DTensor when ``output_dtensor`` (then the
  consumers' partial gradients are summed before one collective; ``Shard(-1)`` logits
  go to the loss under :func:`~torch.distributed.tensor.parallel.loss_parallel`).

The gradient of a replicated DTensor parameter computed on a shard (a sequence-parallel
norm's weight) comes out as partial sums; it is all-reduced once per backward, right
after it accumulates, so optimizers and clipping see whole gradients.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)

from planner.errors import SpecError
from planner.fqn import expand_patterns
from planner.spec import ModuleTP, Plan, shard_dim

__all__ = ["apply"]

log = logging.getLogger(__name__)


def _torch_placement(text: str) -> Placement:
    """``"Shard(1)"`` -> ``Shard(1)``, ``"Replicate()"``, ``"Partial()"``."""
    if text == "Replicate()":
        return Replicate()
    if text == "Partial()":
        return Partial()
    dim = shard_dim(text)
    assert dim is not None, text
    return Shard(dim)


def apply(model: nn.Module, mesh: DeviceMesh | None, plan: Plan) -> nn.Module:
    """Lay ``model``'s modules out over the ``tp`` axis as ``plan.tp_layout`` says (in place)."""
    if plan.strategy.tp == 1 or mesh is None:
        return model
    tp_mesh = mesh["tp"]
    # keyed by the FQNs of ``model`` (a pipeline chunk holds some of the plan's)
    layout = expand_patterns(plan.tp_layout, (name for name, _ in model.named_modules() if name))
    shared: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # original (kept alive), DTensor
    for fqn, module_layout in layout.items():
        module = model.get_submodule(fqn)
        _distribute_parameters(module, fqn, module_layout, tp_mesh, shared)
        _convert_boundaries(module, module_layout, tp_mesh)
    _retie(model, shared)
    reduced = _reduce_partial_gradients(model)
    log.info(
        "tensor parallel: tp=%d, %d modules laid out (%d sharded)%s%s, %d replicated "
        "parameters reduce partial gradients",
        plan.strategy.tp,
        len(layout),
        sum(1 for m in layout.values() if m.shards_parameters),
        ", sequence parallel" if plan.strategy.sequence_parallel else "",
        ", loss parallel" if plan.loss_parallel else "",
        reduced,
    )
    return model


def _distribute_parameters(
    module: nn.Module,
    fqn: str,
    layout: ModuleTP,
    mesh: DeviceMesh,
    shared: dict[int, tuple[nn.Parameter, nn.Parameter]],
) -> None:
    for name, text in layout.params.items():
        param = module._parameters.get(name)
        if param is None:
            raise SpecError(
                f"plan.tp_layout[{fqn!r}] places parameter {name!r}, which "
                f"{type(module).__name__} {fqn!r} does not have"
            )
        placement = _torch_placement(text)
        if id(param) in shared:
            done = shared[id(param)][1]
            assert isinstance(done, DTensor)
            if tuple(done.placements) != (placement,):
                raise SpecError(
                    f"{fqn}.{name} is a tied parameter placed {done.placements[0]} by another "
                    f"module and {placement} here: place both alike"
                )
            module.register_parameter(name, done)
            continue
        dtensor = distribute_tensor(param.detach(), mesh, [placement])
        local = nn.Parameter(dtensor, requires_grad=param.requires_grad)
        shared[id(param)] = (param, local)
        module.register_parameter(name, local)


def _retie(model: nn.Module, shared: dict[int, tuple[nn.Parameter, nn.Parameter]]) -> None:
    """Point every module still holding an original tied parameter at its DTensor."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in shared and shared[id(param)][0] is param:
                module.register_parameter(name, shared[id(param)][1])


def _convert_boundaries(module: nn.Module, layout: ModuleTP, mesh: DeviceMesh) -> None:
    computes_on_dtensor = bool(layout.params)
    input_pair = layout.input or (("Replicate()", "Replicate()") if computes_on_dtensor else None)
    if input_pair is not None:
        arrives, runs = (_torch_placement(p) for p in input_pair)

        def prepare(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            if not args or not isinstance(args[0], torch.Tensor):
                raise SpecError(
                    f"{type(_module).__name__}: the layout redistributes the first argument, "
                    "which is not a tensor"
                )
            if not isinstance(args[0], DTensor) and arrives == runs and not computes_on_dtensor:
                return args  # nothing to move: no DTensor round trip (its to_local is a view)
            x = _as_dtensor(args[0], mesh, arrives)
            if tuple(x.placements) != (runs,):
                x = x.redistribute(placements=[runs])
            return (x if computes_on_dtensor else x.to_local(), *args[1:])

        module.register_forward_pre_hook(prepare)
    if layout.output is None and not computes_on_dtensor:
        return
    produced = _torch_placement(layout.output[0]) if layout.output else None
    handed = _torch_placement(layout.output[1]) if layout.output else None
    keep = layout.output_dtensor

    def finish(_module: nn.Module, _args: tuple[Any, ...], output: Any) -> Any:
        if not isinstance(output, torch.Tensor):
            raise SpecError(
                f"{type(_module).__name__}: the layout redistributes the output, which is not "
                "a tensor"
            )
        if (
            not isinstance(output, DTensor)
            and not keep
            and (handed is None or _same(produced or Replicate(), handed))
        ):
            # nothing to move: handed on as it is, since to_local() of a round trip is a
            # view the model's own in-place ops (Falcon's ``mlp_output += ...``) may not touch
            return output
        y = _as_dtensor(output, mesh, produced or Replicate())
        if handed is not None and not _same(y.placements[0], handed):
            y = y.redistribute(placements=[handed])
        return y if keep else y.to_local()

    module.register_forward_hook(finish)


def _same(placement: Placement, wanted: Placement) -> bool:
    """Equal placements; any partial sum (a vocabulary-parallel embedding's masked one)
    counts as ``Partial()``: it is handed on as the local partial tensor it is."""
    return placement == wanted or (placement.is_partial() and wanted.is_partial())


def _as_dtensor(x: torch.Tensor, mesh: DeviceMesh, placement: Placement) -> DTensor:
    if isinstance(x, DTensor):
        return x
    return DTensor.from_local(x, mesh, [placement], run_check=False)


def _reduce_partial_gradients(model: nn.Module) -> int:
    """All-reduce partial-sum gradients of replicated DTensor parameters as they accumulate."""
    count = 0
    for param in {id(p): p for p in model.parameters()}.values():
        if not isinstance(param, DTensor) or not all(p.is_replicate() for p in param.placements):
            continue
        param.register_post_accumulate_grad_hook(_replicate_grad)
        count += 1
    return count


def _replicate_grad(param: torch.Tensor) -> None:
    grad = param.grad
    if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
        param.grad = grad.redistribute(placements=[Replicate()] * len(grad.placements))
