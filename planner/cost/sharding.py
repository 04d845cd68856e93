"""How tensor parallelism splits each operator (Megatron layout), as a small rule.

:func:`tp_shard` decides from a node's module path and kind alone, so a sharding
search can later supply its own per-operator decisions in the same form:

- ``SPLIT``: inside the attention or MLP sublayer (between the column-parallel and the
  row-parallel linear), plus the vocabulary-parallel embedding, output projection and
  loss: work, parameters and kept activations divide by ``tp``.
- ``SEQUENCE``: norms, residual adds, dropout and position embeddings: replicated on
  every tensor-parallel rank, or split along the sequence when sequence parallelism
  is on (parameters stay replicated).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from planner.graph import OpKind, OpNode

__all__ = ["TPShard", "tp_shard", "ShardKey", "work_divisor", "param_divisor", "split_runs"]

_SUBLAYERS = ("attention", "feed_forward")
_VOCAB_PARALLEL = ("tok_embeddings", "output", "loss")


class TPShard(StrEnum):
    SPLIT = "split"
    SEQUENCE = "sequence"


def tp_shard(node: OpNode) -> TPShard:
    """The tensor-parallel rule for ``node`` (module path relative to its segment)."""
    root = node.module.split(".", 1)[0]
    if root in _SUBLAYERS or root in _VOCAB_PARALLEL or node.kind is OpKind.LOSS:
        return TPShard.SPLIT
    return TPShard.SEQUENCE


@dataclass(frozen=True)
class ShardKey:
    """What changes a segment's per-GPU cost: the split degrees and the micro-batch."""

    tp: int
    cp: int
    sequence_parallel: bool
    micro_batch_size: int

    @property
    def token_scale(self) -> float:
        """Tokens per GPU per micro-batch relative to the traced batch-1 graph."""
        return self.micro_batch_size / self.cp


def work_divisor(shard: TPShard, key: ShardKey) -> int:
    """How many tensor-parallel ranks share the work (and kept activations) of a node."""
    if shard is TPShard.SPLIT or key.sequence_parallel:
        return key.tp
    return 1


def param_divisor(shard: TPShard, key: ShardKey) -> int:
    """How many tensor-parallel ranks share a node's parameters."""
    return key.tp if shard is TPShard.SPLIT else 1


def split_runs(nodes: Sequence[OpNode]) -> list[list[int]]:
    """Index runs of consecutive ``SPLIT`` nodes: one per tensor-parallel sublayer."""
    runs: list[list[int]] = []
    current: list[int] = []
    for index, node in enumerate(nodes):
        if tp_shard(node) is TPShard.SPLIT:
            current.append(index)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs
