"""Activation checkpointing (recompute) of the repeated blocks, as the plan says.

``full`` recomputes a whole block in backward and keeps only its input; ``selective``
keeps the outputs of matrix products and recomputes the rest (the attention core,
norms, activations), after Korthikanti et al. 2022. ``recompute_blocks = k`` limits
either mode to the first ``k`` blocks of each pipeline chunk. The block's ``forward``
is wrapped in place, so module names (FQNs) do not change.

Backward replays a block's forward, so the replay must see what the first run saw. A
Hugging Face KV cache handed to a block breaks that: the first run appends the keys and
values, the replay appends them again and reads twice as many (selective recompute
then fails on an op the first run never ran; full recompute doubles the user's cache),
and the cache keeps every block's keys and values alive, which recompute meant to free.
So a checkpointed block gets no cache while gradients are recorded, as Hugging Face's
own gradient checkpointing does; without gradients it runs as is, cache included.
"""

from __future__ import annotations

import functools
import logging
import sys
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

# Matrix products; _grouped_mm (torch >= 2.8) runs transformers' mixture-of-experts.
_SAVED_OPS = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("mm", "addmm", "bmm", "linear", "_grouped_mm")
    if hasattr(torch.ops.aten, name)
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
    if not torch.is_grad_enabled():  # no backward replays it: run as is, cache included
        return forward(*args, **kwargs)
    args = tuple(_without_cache(value) for value in args)
    kwargs = {key: _without_cache(value) for key, value in kwargs.items()}
    if context_fn is None:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def _without_cache(value: Any) -> Any:
    """``None`` for a Hugging Face KV cache (``transformers.cache_utils.Cache``, looked
    up only once transformers is loaded), else ``value``."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    return None if cache_utils is not None and isinstance(value, cache_utils.Cache) else value


def _save_matmuls(
    ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any
) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(_save_matmuls)
