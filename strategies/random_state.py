"""Dropout under tensor parallelism: every tp rank must draw the same masks.

Tensor-parallel ranks hold the same replicated activations (the residual stream, a
row-parallel layer's reduced output) and compute the same dropout on them, each from
its own random state. Seeded alike (``torch.manual_seed`` with one seed on every rank)
they draw the same masks, as Megatron-LM's default generator does; seeded differently
(``seed + rank``, a common habit for data order) or not at all (torch seeds each
process at random) they would drop different elements, and the tp ranks' copies of the
replicated weights would drift apart without an error. :func:`check_same_random_state`
compares the ranks' states before each training forward of a model with dropout and
refuses the step instead.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
from torch import nn

from planner.errors import SpecError

__all__ = ["has_dropout", "check_same_random_state"]

# Hugging Face attention's self.attention_dropout; MoE routers' jitter noise (PhiMoE's
# router_jitter_noise, Mixtral's option), drawn in training like dropout
_DROPOUT_WORDS = ("dropout", "pdrop", "jitter_noise")


def has_dropout(model: nn.Module) -> bool:
    """Whether ``model`` draws random numbers in training: a dropout module with ``p > 0``,
    or a module holding a dropout probability above 0 that it hands to attention (Hugging
    Face's ``self.attention_dropout``, from its config) or a router's jitter noise above 0
    (config fields no module reads, such as GPT-2's ``summary_first_dropout``, do not
    count)."""
    return any(_drops(module) for module in model.modules())


def _drops(module: nn.Module) -> bool:
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return module.p > 0
    return any(
        isinstance(value, float) and value > 0 and any(w in name for w in _DROPOUT_WORDS)
        for name, value in vars(module).items()
    )


def _digest(device: torch.device) -> int:
    """A checksum of this rank's random state on ``device`` (where dropout draws)."""
    state = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
    return zlib.crc32(state.numpy().tobytes())


def check_same_random_state(group: dist.ProcessGroup, device: torch.device, tp: int) -> None:
    """Raise unless every rank of the tensor-parallel ``group`` has the same random state."""
    digests: list[int | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, _digest(device), group=group)
    if len(set(digests)) > 1:
        raise SpecError(
            f"the model has dropout and the tp = {tp} ranks' random states differ: they would "
            "drop different elements of the activations they share and train their copies "
            "of the weights apart; seed every rank alike (torch.manual_seed(seed), the same "
            "seed on every rank) and give data order a torch.Generator of its own"
        )
