"""Context parallelism: the sequence split over the ``cp`` mesh axis, all-gather attention.

Load-balanced layout (Llama 3's, torchtitan's "head-tail"): every sequence is cut into
``2 cp`` equal chunks and cp rank ``i`` holds chunks ``i`` and ``2 cp - 1 - i``, so under
a causal mask every rank does the same attention work. :func:`sequence_slice` cuts a
rank's shard, :func:`shard_positions` gives its tokens' global positions and
:func:`causal_mask` the mask of its queries over all keys; all three derive from
:func:`shard_chunks`.

Any model whose attention is ``F.scaled_dot_product_attention`` (zoo, Hugging Face, a
user's module) runs on its shard:

- the model's ``forward`` (an instance attribute, so FQNs do not change) is called with
  ``position_ids``: the global positions of the local tokens (the model must take them,
  :func:`planner.modules.context_parallel_blocker`);
- while it runs, a ``TorchFunctionMode`` turns each SDPA call into: keys and values
  (batch, heads, seq, dim) all-gathered over the cp group with an autograd-aware gather
  (all-gather forward, reduce-scatter of the gradients backward) and put in sequence
  order; then, for causal attention (``is_causal=True``, or a mask the model derived
  from the positions: a causal mask over its local tokens, or Hugging Face's
  packed-sequence mask, as it reads non-contiguous positions), one SDPA per local chunk
  over the keys up to its end with a lower-right causal mask (a rank computes
  ``(2 cp + 1) / (4 cp)`` of the whole sequence's scores: its share of the causal half,
  plus the masked halves of its two diagonal blocks), or one SDPA over all keys for
  full attention; any other mask raises;
- every block's ``forward`` (:func:`planner.modules.find_blocks`, wrapped in place)
  enters the mode too when the model's forward is not running: activation recompute,
  applied later to the same blocks, replays them in backward;
- a forward that made no SDPA call raises (attention written by hand would silently
  see only its own shard).

The gathered keys and values stay saved for backward until it runs (the cost model's
``CpAttention.ALL_GATHER``). The collectives are plain c10d
``all_gather_into_tensor``/``reduce_scatter_tensor`` (gloo and NCCL); functional
collectives' ``all_gather_single_autograd`` gave the same numbers but now and then
aborted a gloo process at exit (torch 2.13). Parameters are replicated over cp; their
gradients are averaged over the data axes and cp together
(:func:`strategies.mesh.shard_mesh`, :func:`strategies.mesh.replicate_mesh`), and the
loss (a mean over local tokens, equal counts per rank) over all ranks, so a run matches
one process. torch's experimental ``context_parallel`` (ring attention) targets CUDA
SDPA kernels and is not used.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from planner.errors import SpecError
from planner.models import is_hf_model
from planner.modules import context_parallel_blocker, find_blocks, sdpa_blocker
from planner.parallel_dims import ParallelDims
from planner.spec import Axis, Plan
from strategies.mesh import axis_rank

__all__ = ["apply", "sequence_slice", "shard_chunks", "shard_positions", "causal_mask"]

log = logging.getLogger(__name__)


def shard_chunks(index: int, count: int) -> tuple[int, int]:
    """The two of ``2 count`` sequence chunks that cp rank ``index`` of ``count`` holds."""
    return index, 2 * count - 1 - index


def sequence_slice(tensor: torch.Tensor, index: int, count: int) -> torch.Tensor:
    """Cp rank ``index``'s shard of ``tensor`` (batch, seq, ...) on the sequence dim: its two
    chunks of ``2 count``, in order."""
    problem = ParallelDims(cp=count).sequence_blocker(tensor.shape[1])
    if problem is not None:
        raise SpecError(problem)
    chunks = tensor.chunk(2 * count, dim=1)
    return torch.cat([chunks[c] for c in shard_chunks(index, count)], dim=1)


def shard_positions(
    local_len: int, index: int, count: int, device: torch.device | None = None
) -> torch.Tensor:
    """Global positions (``local_len``,) of the tokens in cp rank ``index``'s shard."""
    if local_len % 2:
        raise SpecError(
            f"local sequence length {local_len} under cp({count}) is odd: a cp shard is two "
            "equal chunks; feed each rank its strategies.context_parallel.sequence_slice"
        )
    size = local_len // 2
    return torch.cat(
        [torch.arange(c * size, (c + 1) * size, device=device) for c in shard_chunks(index, count)]
    )


def causal_mask(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """(queries, keys) boolean mask from global positions: a query sees keys at or before it."""
    return keys[None, :] <= queries[:, None]


class _GatherSequence(torch.autograd.Function):
    """All-gather on ``dim`` over ``group``; backward reduce-scatters the gradient on ``dim``.

    Backward sums every rank's gradient for this rank's shard: each rank's loss depends
    on every shard's keys and values.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        local = x.movedim(dim, 0).contiguous()
        gathered = local.new_empty((local.shape[0] * dist.get_world_size(group), *local.shape[1:]))
        dist.all_gather_into_tensor(gathered, local, group=group)
        return gathered.movedim(0, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        full = grad.movedim(ctx.dim, 0).contiguous()
        local = full.new_empty((full.shape[0] // dist.get_world_size(ctx.group), *full.shape[1:]))
        dist.reduce_scatter_tensor(local, full, group=ctx.group)
        return local.movedim(0, ctx.dim), None, None


@dataclass(frozen=True)
class _Shard:
    """This rank holds shard ``index`` of ``count`` of every sequence; ``group`` is the cp
    group; ``kv_repeats`` the query heads per key/value head the model may repeat keys to."""

    index: int
    count: int
    group: dist.ProcessGroup
    kv_repeats: int = 1
    _masks: dict[tuple[int, int, torch.device], torch.Tensor] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        return shard_positions(local_len, self.index, self.count, device)

    def in_sequence_order(self, gathered: torch.Tensor) -> torch.Tensor:
        """``gathered`` (..., seq, dim), every rank's two chunks in rank order, as the
        sequence's chunks in order (one copy)."""
        by_rank = gathered.unflatten(-2, (self.count, 2, -1))  # (..., rank, half, chunk, dim)
        heads, tails = by_rank[..., :, 0, :, :], by_rank[..., :, 1, :, :].flip(-3)
        return torch.cat([heads, tails], dim=-3).flatten(-3, -2)

    def prefix_mask(self, queries: int, keys: int, device: torch.device) -> torch.Tensor:
        """The lower-right causal mask (``queries``, ``keys``) of a chunk's queries, the last
        ``queries`` of the ``keys`` positions; one tensor per shape, shared by all layers."""
        shape = (queries, keys, device)
        if shape not in self._masks:
            ones = torch.ones(queries, keys, dtype=torch.bool, device=device)
            self._masks[shape] = ones.tril(keys - queries)
        return self._masks[shape]

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        gathered = _GatherSequence.apply(x, dim % x.dim(), self.group)
        assert isinstance(gathered, torch.Tensor)
        return gathered

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        """SDPA (same arguments) of the local queries over the whole sequence's keys."""
        local = query.shape[-2]
        if key.shape[-2] != local:
            raise SpecError(
                f"under cp({self.count}) attention got {local} queries but {key.shape[-2]} keys: "
                "context parallel shards self-attention only (no cross-attention or KV cache)"
            )
        queries = self.positions(local, query.device)
        causal = _reads_as_causal(attn_mask, is_causal, queries, self.count)
        if self.kv_repeats > 1 and not enable_gqa and key.shape[-3] == query.shape[-3]:
            # repeated by the model on this rank only (Hugging Face does when it has a
            # mask): gather what every rank gathers, the keys and values of each kv head
            key, value = key[..., :: self.kv_repeats, :, :], value[..., :: self.kv_repeats, :, :]
            enable_gqa = True
        key, value = self.gather(key, -2), self.gather(value, -2)
        attend = functools.partial(
            F.scaled_dot_product_attention, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa
        )
        if not causal:
            return attend(query, key, value)
        key, value = self.in_sequence_order(key), self.in_sequence_order(value)
        size = local // 2
        outputs = []
        for half, chunk in enumerate(shard_chunks(self.index, self.count)):
            end = (chunk + 1) * size  # this chunk's queries see the keys up to its end
            queries = query[..., half * size : (half + 1) * size, :]
            mask = self.prefix_mask(size, end, query.device)
            outputs.append(attend(queries, key[..., :end, :], value[..., :end, :], attn_mask=mask))
        return torch.cat(outputs, dim=-2)


def _reads_as_causal(
    attn_mask: torch.Tensor | None, is_causal: bool, positions: torch.Tensor, cp: int
) -> bool:
    """Whether an SDPA call asks for causal attention (``False``: full attention); raise on a
    mask that is not one a model derives from ``positions`` for causal attention."""
    if attn_mask is None:
        return is_causal
    allowed = attn_mask if attn_mask.dtype == torch.bool else attn_mask == 0
    if not is_causal and any(
        allowed.shape[-2:] == mask.shape and bool((allowed == mask).all())
        for mask in _causal_masks(positions)
    ):
        return True
    raise SpecError(
        f"under cp({cp}) attention got an explicit attn_mask of shape {tuple(attn_mask.shape)} "
        "that is not the causal mask of this rank's positions: context parallel supports "
        "causal and full attention only (no padding or custom masks); drop the mask or use "
        "cp = 1"
    )


def _causal_masks(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The local masks a causal model derives from ``positions``: causal over the local tokens,
    and Hugging Face's packed-sequence one (a jump in positions starts a new sequence)."""
    causal = causal_mask(positions, positions)
    steps = torch.diff(positions, prepend=positions[:1] - 1)
    segment = (steps != 1).cumsum(0)
    return causal, causal & (segment[None, :] == segment[:, None])


class _AttentionMode(TorchFunctionMode):
    """Runs the SDPA calls of the model's forward (and of blocks replayed) on the shard."""

    def __init__(self, shard: _Shard) -> None:
        super().__init__()
        self.shard = shard
        self.calls = 0  # SDPA calls in the current model forward

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self.calls += 1
        return self.shard.attention(*args, **kwargs)

    @contextmanager
    def entered(self) -> Iterator[None]:
        """The mode on this thread's stack: entered here unless already there (the model's
        forward calling a block; recompute replays a block outside it)."""
        if any(mode is self for mode in _get_current_function_mode_stack()):
            yield
        else:
            with self:
                yield


def apply(model: nn.Module, mesh: DeviceMesh | None, plan: Plan) -> nn.Module:
    """Make ``model`` run on this rank's sequence shard with global positions (in place)."""
    cp = plan.strategy.cp
    if cp == 1 or mesh is None:
        return model
    problem = context_parallel_blocker(model)
    if problem is not None:
        raise SpecError(
            f"strategy.cp = {cp} but {type(model).__name__} cannot run context parallel: {problem}"
        )
    group = mesh.get_group(Axis.CP.value)
    mode = _AttentionMode(_Shard(axis_rank(mesh, Axis.CP), cp, group, _kv_repeats(model)))
    blocks = find_blocks(model)
    for _, block in blocks:
        block.forward = functools.partial(_block_forward, block.forward, mode)
    model.forward = functools.partial(_model_forward, model.forward, mode)
    log.info(
        "context parallel: cp=%d, this rank holds sequence chunks %s of %d, %d blocks",
        cp, shard_chunks(mode.shard.index, cp), 2 * cp, len(blocks),
    )  # fmt: skip
    return model


def _kv_repeats(model: nn.Module) -> int:
    """Query heads per key/value head of a Hugging Face model (1 for other models).

    Hugging Face repeats keys and values before SDPA when its mask is not ``None`` and
    passes ``enable_gqa`` otherwise; cp ranks get different masks (non-contiguous
    positions read as packed sequences), so :meth:`_Shard.attention` undoes the repeat.
    """
    config = model.config if is_hf_model(model) else None
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return heads // kv_heads if isinstance(heads, int) and isinstance(kv_heads, int) else 1


def _block_forward(
    forward: Callable[..., Any], mode: _AttentionMode, *args: Any, **kwargs: Any
) -> Any:
    with mode.entered():
        return forward(*args, **kwargs)


def _model_forward(
    forward: Callable[..., Any], mode: _AttentionMode, *args: Any, **kwargs: Any
) -> Any:
    """``forward`` with the global positions of the local tokens; every SDPA runs sharded."""
    cp = mode.shard.count
    if kwargs.get("position_ids") is not None:
        raise SpecError(
            f"under cp({cp}) the model was called with position_ids: context parallel passes "
            "the global positions of this rank's shard itself; call it without position_ids"
        )
    _drop_full_attention_mask(kwargs, cp)
    tokens = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
        raise SpecError(
            f"under cp({cp}) the model's first argument (or input_ids) must be a tensor "
            "(batch, local seq, ...) to derive positions from; got "
            f"{type(tokens).__name__}"
        )
    positions = mode.shard.positions(tokens.shape[1], tokens.device)
    kwargs["position_ids"] = positions.expand(tokens.shape[0], -1)
    mode.calls = 0
    with mode.entered():
        output = forward(*args, **kwargs)
    problem = sdpa_blocker(mode.calls)
    if problem is not None:
        raise SpecError(f"under cp({cp}) {problem}")
    return output


def _drop_full_attention_mask(kwargs: dict[str, Any], cp: int) -> None:
    """Drop an all-ones ``attention_mask`` (a tokenizer's, no padding); refuse any other."""
    mask = kwargs.get("attention_mask")
    if mask is None:
        return
    if not bool((mask != 0).all()):
        raise SpecError(
            f"under cp({cp}) the model was called with an attention_mask that masks tokens "
            "(padding): context parallel supports unpadded causal or full attention only; "
            "pack the sequences without padding or use cp = 1"
        )
    del kwargs["attention_mask"]
