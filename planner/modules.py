"""What the runtime needs to know about an ``nn.Module``: its blocks, ties, layout fit.

:func:`find_blocks` is the one rule for what a block is (the tracer's segments, the
runtime's pipeline stages, FSDP units and recompute wrappers all ask it);
:func:`check_model_against_plan` checks a module against a plan before any collective.
Module paths (FQNs) in layouts may use ``*`` for one path component, as in
``layers.*.attention.wq``; :func:`expand_layout` turns such keys into concrete FQNs.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any, cast

from torch import nn

from planner.errors import PlanMismatchError, SpecError
from planner.fqn import match_fqns
from planner.frameworks import PLANNER, Target, blockless_chunk_refusal
from planner.models import fingerprint, is_hf_model
from planner.models.moe import is_experts, runs_as_transformers
from planner.spec import ModuleTP, Plan, shard_dim
from planner.torch_dtypes import TORCH_DTYPES, dtype_name
from planner.validate import check_experts, check_heads, check_replication

log = logging.getLogger(__name__)

__all__ = [
    "find_blocks",
    "shares_parameters",
    "shared_parameters",
    "pipeline_blocker",
    "context_parallel_blocker",
    "sdpa_blocker",
    "expand_layout",
    "check_model_against_plan",
    "check_parameter_dtype",
    "module_experts",
]

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def find_blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated blocks: the children of the outermost ``ModuleList``, ``ModuleDict``
    or ``Sequential`` that holds two or more modules of one class, each made of modules
    (a list of bare layers, such as ``nn.Linear``, is a model's layers, not its blocks:
    a block's layers are what tensor parallelism lays out).

    A pipeline chunk's container (:mod:`planner.staging`) says ``holds_blocks``, however
    few blocks it keeps. Returns ``(fqn, block)`` pairs in order; empty when the model
    has no such container.
    """

    def visit(prefix: str, node: nn.Module) -> list[tuple[str, nn.Module]]:
        if isinstance(node, _CONTAINERS) and _holds_blocks(node):
            return [(prefix + name, child) for name, child in node.named_children()]
        for name, child in node.named_children():
            found = visit(f"{prefix}{name}.", child)
            if found:
                return found
        return []

    return visit("", module)


def _holds_blocks(container: nn.Module) -> bool:
    if getattr(container, "holds_blocks", False):
        return True
    children = list(container.children())
    return (
        len(children) >= 2
        and len({type(child) for child in children}) == 1
        and any(True for _ in children[0].children())
    )


def shared_parameters(module: nn.Module) -> list[list[str]]:
    """The names of each parameter that two or more of ``module``'s submodules hold (tied
    weights), one list per parameter."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [held for held in names.values() if len(held) > 1]


def shares_parameters(module: nn.Module) -> bool:
    """Whether two of ``module``'s submodules hold the same parameter (tied weights)."""
    return bool(shared_parameters(module))


def pipeline_blocker(module: nn.Module) -> str | None:
    """Why the runtime cannot split ``module`` into pipeline stages by its structure, or
    ``None``: it needs repeated blocks, and no tied weights (shared parameters would span
    the first and the last stage). :func:`planner.staging.stage_problem` then checks
    that its forward runs as stages."""
    if not find_blocks(module):
        return "the model has no repeated blocks to split into stages"
    if (problem := router_loss_pipeline_blocker(module)) is not None:
        return problem
    if shared := shared_parameters(module):
        first, second, *more = shared[0]
        held = f"{first!r} and {second!r}" + (f" (and {len(more)} more)" if more else "")
        return (
            f"it has tied weights: {held} are one parameter, which pipeline stages would "
            "hold apart; untie them (a zoo spec: tied_embeddings = false; a Hugging Face "
            "config: tie_word_embeddings = false; a module of your own: give each module a "
            "weight of its own) or use pp = 1"
        )
    return None


def router_loss_pipeline_blocker(module: nn.Module) -> str | None:
    """Why pipeline stages would train ``module`` without its routers' load-balancing
    loss (a Hugging Face MoE config's ``output_router_logits``), or ``None``."""
    config = getattr(module, "config", None)
    if not getattr(config, "output_router_logits", False):
        return None
    coefficient = getattr(config, "router_aux_loss_coef", None)
    return (
        f"model.config.output_router_logits = True (router_aux_loss_coef = {coefficient}): "
        "a pipeline's last stage hands on its logits alone, not the routers' load-balancing "
        "loss; set config.output_router_logits = False to train without it, or use pp = 1"
    )


def check_model_against_plan(
    plan: Plan, module: nn.Module, target: Target = PLANNER
) -> dict[str, ModuleTP]:
    """Raise if ``module`` is not the model ``plan`` was made for, or cannot take its layout.

    Checks the fingerprint, the layout keys (and that tp divides every sharded
    dimension), the heads of zoo models, and the stage FQN lists (a chunk without a
    block only where ``target``, the framework that runs the plan, runs one). Returns
    the layout expanded to concrete module FQNs.
    """
    found = fingerprint(module)
    if found != plan.model_fingerprint:
        raise PlanMismatchError(
            f"plan.model_fingerprint = {plan.model_fingerprint!r} (model {plan.model_name!r}) "
            f"but the model given has fingerprint {found!r}: this plan was made for another "
            "model; make a plan for this model"
        )
    tp = plan.strategy.tp
    if plan.model is not None and tp > 1:
        check_heads(plan)
    expanded = expand_layout(module, plan.tp_layout) if tp > 1 else {}
    _check_tp_divides(expanded, module, tp)
    if plan.strategy.pp > 1:
        _check_stages(plan, module, target)
    if plan.strategy.cp > 1:
        _check_context_parallel_model(plan, module)
    _check_tied(plan, module, expanded)
    check_replication(plan, tied=shares_parameters(module))
    if plan.strategy.dp > 1:
        _warn_batch_statistics(plan, module)
    if plan.strategy.ep > 1:
        check_experts(plan, module_experts(module))
    return expanded


def _warn_batch_statistics(plan: Plan, module: nn.Module) -> None:
    """Say that batch norms normalise over each rank's micro-batch (as under DDP), so
    the losses differ from one process's on the whole batch."""
    norms = [
        name for name, m in module.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm)
    ]  # fmt: skip
    if norms:
        more = f" and {len(norms) - 1} more" if len(norms) > 1 else ""
        log.warning(
            "batch norm %r%s normalises over each rank's micro-batch of %d samples (as "
            "under DDP), not over the %d of a step: the losses differ from one process's; "
            "to match it, convert them (torch.nn.SyncBatchNorm.convert_sync_batchnorm, on "
            "GPUs) or use GroupNorm or LayerNorm",
            norms[0], more, plan.strategy.micro_batch_size, plan.training.global_batch_size,
        )  # fmt: skip


def check_parameter_dtype(plan: Plan, module: nn.Module) -> None:
    """Raise if ``module``'s floating-point parameters are not in the dtype the plan keeps
    them in (``plan.training.param_dtype``; this runtime computes in ``training.dtype``
    under FSDP2's mixed precision or autocast): a bf16 model given to an fp32-parameter
    plan would train in pure bf16, its optimizer states too, unlike what was priced."""
    expected = TORCH_DTYPES[plan.training.param_dtype]
    wrong = [
        (name, param.dtype)
        for name, param in module.named_parameters()
        if param.is_floating_point() and param.dtype != expected
    ]
    if not wrong:
        return
    name, dtype = wrong[0]
    others = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
    torch_name = str(expected).removeprefix("torch.")
    raise SpecError(
        f"parameter {name!r}{others} is {dtype_name(dtype)}, but plan.training.param_dtype = "
        f"{plan.training.param_dtype.value!r}: this runtime keeps {dtype_name(expected)} "
        f"parameters and optimizer states and computes in {plan.training.dtype.value}; call "
        f"model.to(torch.{torch_name}) before planner.parallelize (a Hugging Face model takes "
        f"its config's torch_dtype: build it with dtype=torch.{torch_name})"
    )


def expert_parallel_blocker(module: nn.Module) -> str | None:
    """Why expert parallelism cannot run ``module``'s experts, or ``None``: it runs
    transformers' experts forward in place of theirs
    (:func:`~planner.models.moe.runs_as_transformers`), so an experts module of one's
    own would train as another model."""
    for name, child in module.named_modules():
        if is_experts(child) and not runs_as_transformers(child):
            return (
                f"{name!r} ({type(child).__name__}) is an experts module of your own: expert "
                "parallelism runs transformers' experts forward (each expert's SwiGLU output "
                "weighted by its routing weight) in place of yours, which may compute "
                "otherwise; use ep = 1, or subclass planner.models.moe.Experts without "
                "overriding its forward"
            )
    return None


def module_experts(module: nn.Module) -> int:
    """Routed experts per MoE layer of ``module`` (its grouped-weight experts modules,
    zoo or transformers); 0 for a dense model. Raises if its MoE layers differ."""
    counts = {
        int(cast(nn.Parameter, m.gate_up_proj).shape[0]) for m in module.modules() if is_experts(m)
    }
    if len(counts) > 1:
        raise SpecError(
            f"the model's MoE layers have {sorted(counts)} experts: expert parallelism needs "
            "one expert count; use ep = 1"
        )
    return counts.pop() if counts else 0


def expand_layout(module: nn.Module, layout: Mapping[str, ModuleTP]) -> dict[str, ModuleTP]:
    """Concrete ``{fqn: layout}`` for ``module``; raise naming any key that matches nothing
    or places a parameter the module does not have."""
    modules = dict(module.named_modules())
    expanded: dict[str, ModuleTP] = {}
    for pattern, entry in layout.items():
        matches = match_fqns(pattern, modules)
        if not matches:
            raise SpecError(
                f"plan.tp_layout[{pattern!r}] ({entry.style.value}) names no module of "
                f"{type(module).__name__}; known modules include {_sample(modules)}. Fix the key"
            )
        for fqn in matches:
            own = dict(modules[fqn].named_parameters(recurse=False))
            missing = [name for name in entry.params if name not in own]
            if missing:
                raise SpecError(
                    f"plan.tp_layout[{pattern!r}] places {', '.join(map(repr, missing))}, but "
                    f"{fqn!r} ({type(modules[fqn]).__name__}) holds {sorted(own) or 'no parameters'}"
                )
            expanded[fqn] = entry
    return expanded


def _sample(modules: dict[str, nn.Module], limit: int = 8) -> str:
    names = [name for name in modules if name]
    shown = ", ".join(names[:limit])
    return shown + (f" ... ({len(names)} in all)" if len(names) > limit else "")


def _check_tp_divides(expanded: dict[str, ModuleTP], module: nn.Module, tp: int) -> None:
    """Every sharded parameter dim has a size tp divides."""
    for fqn, entry in expanded.items():
        own = dict(module.get_submodule(fqn).named_parameters(recurse=False))
        for name, placement in entry.params.items():
            dim = shard_dim(placement)
            if dim is None:
                continue
            size = own[name].shape[dim]
            if size % tp:
                raise SpecError(
                    f"plan.tp_layout[{fqn!r}] shards {name} on dim {dim} of size {size}, not "
                    f"divisible by tp({tp}); choose a tp that divides it or replicate this module"
                )


def _check_context_parallel_model(plan: Plan, module: nn.Module) -> None:
    problem = context_parallel_blocker(module)
    if problem is not None:
        raise SpecError(
            f"strategy.cp = {plan.strategy.cp} but {type(module).__name__} cannot run context "
            f"parallel: {problem}"
        )


def context_parallel_blocker(module: nn.Module, sdpa_calls: int | None = None) -> str | None:
    """Why the runtime cannot shard ``module``'s sequences over cp ranks, or ``None``.

    Context parallel (:mod:`strategies.context_parallel`) gathers keys and values at
    ``F.scaled_dot_product_attention`` calls (``sdpa_calls`` per forward, when a trace
    counted them: :func:`sdpa_blocker`) and calls the model with ``position_ids``, the
    global positions of the local tokens; a Hugging Face model must use its ``sdpa``
    attention, without an ALiBi bias or a binding sliding window.
    """
    if is_hf_model(module):
        return _hf_attention_blocker(module, sdpa_calls)
    if sdpa_calls is not None and (problem := sdpa_blocker(sdpa_calls)) is not None:
        return problem
    parameters = _forward_parameters(module)
    if "position_ids" not in parameters:
        return (
            f"its forward takes no position_ids (forward({', '.join(parameters)})), so positions "
            "would restart on every cp rank; add a position_ids argument (the global "
            "positions of the tokens, (batch, seq)) or use cp = 1"
        )
    return None


def declared_causality(module: nn.Module) -> bool | None:
    """Whether ``module``'s attention is causal as its modules declare it: the ``is_causal``
    attribute every Hugging Face attention module carries (a decoder's ``True``, an
    encoder's ``config.is_decoder``, ``False``), when all that carry one agree; ``None``
    otherwise."""
    declared = (getattr(m, "is_causal", None) for m in module.modules())
    flags = {flag for flag in declared if isinstance(flag, bool)}
    return flags.pop() if len(flags) == 1 else None


def _hf_attention_blocker(module: nn.Module, sdpa_calls: int | None) -> str | None:
    """Why context parallel cannot run a Hugging Face model's attention, or ``None``."""
    config: Any = module.config
    attention = getattr(config, "_attn_implementation", None)
    if attention != "sdpa":
        if not getattr(type(module), "_supports_sdpa", True):
            return (
                f"its attention implementation is {attention!r}: {config.model_type} has no "
                "SDPA attention in this transformers release, and context parallel gathers "
                "keys at scaled_dot_product_attention; use cp = 1"
            )
        return (
            f"its attention implementation is {attention!r}; context parallel gathers keys "
            "at scaled_dot_product_attention: load it with attn_implementation='sdpa' or use cp = 1"
        )
    if sdpa_calls is not None and (problem := sdpa_blocker(sdpa_calls)) is not None:
        return problem
    if declared_causality(module) is False:
        return (
            "its attention is bidirectional (its attention modules' is_causal is False: an "
            "encoder) under a mask Hugging Face builds, and context parallel masks causally "
            "only; use cp = 1"
        )
    if getattr(config, "alibi", False):
        return (
            "its attention adds an ALiBi bias (config.alibi) as an explicit mask, and "
            "context parallel masks causally only; use cp = 1"
        )
    window = getattr(config, "sliding_window", None)
    longest = getattr(config, "max_position_embeddings", None)
    layer_types = getattr(config, "layer_types", None)
    sliding = layer_types is None or "sliding_attention" in layer_types
    if isinstance(window, int) and sliding and (longest is None or window < longest):
        return (
            f"its attention has a sliding window of {window} tokens, shorter than its "
            f"{longest} positions, and context parallel masks causally only; use cp = 1"
        )
    return None


def sdpa_blocker(sdpa_calls: int) -> str | None:
    """Why context parallel cannot run a forward that calls
    ``F.scaled_dot_product_attention`` ``sdpa_calls`` times (traced, or counted at run
    time), or ``None``."""
    if sdpa_calls > 0:
        return None
    return (
        "its forward makes no scaled_dot_product_attention call: context parallel gathers "
        "keys and values only there, and attention written otherwise (nn.MultiheadAttention, "
        "a softmax of q @ k^T) would see this rank's shard alone; use "
        "F.scaled_dot_product_attention (Hugging Face: attn_implementation='sdpa') or cp = 1"
    )


def _forward_parameters(module: nn.Module) -> list[str]:
    """Names of the parameters of ``module.forward`` (``["..."]`` when inspect cannot read it)."""
    try:
        return list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return ["..."]


def _check_tied(plan: Plan, module: nn.Module, expanded: dict[str, ModuleTP]) -> None:
    """Modules sharing a parameter must place it alike under TP and sit in one pipeline chunk."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        owner, _, attr = name.rpartition(".")
        owners.setdefault(id(param), []).append((owner, attr))
    for group in (names for names in owners.values() if len(names) > 1):
        tied = [owner for owner, _ in group]
        placements = {
            owner: expanded[owner].params.get(attr, "plain") if owner in expanded else "plain"
            for owner, attr in group
        }
        if len(set(placements.values())) > 1:
            given = ", ".join(f"{m!r} {p}" for m, p in placements.items())
            raise SpecError(
                f"{' and '.join(tied)} share a parameter (tied weights), but plan.tp_layout "
                f"places it differently ({given}): place it alike (an embedding sharded on "
                "the vocabulary, Shard(0), with a column-parallel head), or replicate both"
            )
        chunks = {_chunk_of(plan, m) for m in tied} if plan.strategy.pp > 1 else set()
        if len(chunks) > 1:
            raise SpecError(
                f"{' and '.join(tied)} share a parameter (tied weights) but sit in pipeline "
                f"chunks {sorted(chunks)}: the runtime does not all-reduce tied gradients "
                "across pipeline stages; put them in one chunk or untie them "
                "(tied_embeddings = false)"
            )


def _chunk_of(plan: Plan, fqn: str) -> int:
    for index, chunk in enumerate(plan.stages):
        if any(fqn == kept or fqn.startswith(kept + ".") for kept in chunk):
            return index
    return -1


def _check_stages(plan: Plan, module: nn.Module, target: Target) -> None:
    known = {name for name, _ in module.named_modules() if name}
    for index, chunk in enumerate(plan.stages):
        if not chunk:
            raise SpecError(f"plan.stages[{index}] is empty: every chunk needs a module")
        missing = [fqn for fqn in chunk if fqn not in known]
        if missing:
            raise SpecError(
                f"plan.stages[{index}] names {', '.join(map(repr, missing))}, not modules of "
                f"{type(module).__name__}; fix the FQNs (e.g. 'layers.0')"
            )
    refusal = blockless_chunk_refusal(target)
    if refusal is None:
        return
    blocks = [fqn for fqn, _ in find_blocks(module)]
    for index, chunk in enumerate(plan.stages):
        if not any(
            block == fqn or block.startswith(fqn + ".") for block in blocks for fqn in chunk
        ):
            raise SpecError(
                f"plan.stages[{index}] = {list(chunk)} holds none of {type(module).__name__}'s "
                f"{len(blocks)} blocks: {refusal.why}; {refusal.fix}"
            )
