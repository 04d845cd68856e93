"""Activation checkpointing (recompute) of the repeated blocks, as the plan says.

``full`` recomputes a whole block in backward and keeps only its input; ``selective``
keeps the outputs of matrix products and recomputes the rest (the attention core,
norms, activations), after Korthikanti et al. 2022. ``recompute_blocks = k`` limits
either mode to the first ``k`` blocks of each pipeline chunk. The block's ``forward``
is wrapped in place, so module names (FQNs) do not change.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from planner.modules import find_blocks
from planner.spec import Plan, RecomputeMode

__all__ = ["apply", "recompute_block"]

log = logging.getLogger(__name__)

_SAVED_OPS = frozenset(
    {
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten.linear.default,
    }
)


def apply(model: nn.Module, mesh: object, plan: Plan, *, pp_rank: int = 0) -> nn.Module:
    """Wrap the blocks of ``model`` (a whole model or one pipeline chunk) for recompute."""
    mode = plan.strategy.recompute_for_stage(pp_rank)
    if mode is RecomputeMode.NONE:
        return model
    blocks = find_blocks(model)
    limit = plan.strategy.recompute_blocks
    chosen = blocks if limit is None else blocks[:limit]
    for _, block in chosen:
        recompute_block(block, mode)
    log.info("recompute: %s on %d of %d blocks", mode.value, len(chosen), len(blocks))
    return model


def recompute_block(block: nn.Module, mode: RecomputeMode) -> None:
    """Make ``block.forward`` recompute its activations in backward (``full`` or ``selective``)."""
    forward = block.forward
    context_fn = _selective_contexts if mode is RecomputeMode.SELECTIVE else None
    block.forward = functools.partial(_checkpointed, forward, context_fn)


def _checkpointed(
    forward: Callable[..., Any], context_fn: Callable[[], Any] | None, *args: Any, **kwargs: Any
) -> Any:
    if context_fn is None:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def _save_matmuls(
    ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any
) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(_save_matmuls)
