"""How tensor parallelism splits each operator (Megatron layout), as a small rule.

:func:`tp_shard` decides from a node's module path (relative to its segment: a
block's nodes read ``self_attn.q_proj``, the embedding and head segments' read
``model.embed_tokens``, ``lm_head``) and kind alone, so a sharding search can later
supply its own per-operator decisions in the same form:

- ``SPLIT``: inside the attention or MLP sublayer of a block (between the
  column-parallel and the row-parallel linear), plus the vocabulary-parallel
  embedding, output projection and loss: work, parameters and kept activations divide
  by ``tp``. A sublayer is the block child named in :data:`SUBLAYERS`; the vocabulary
  modules are the leaves named in :data:`VOCAB_PARALLEL`.
- ``SEQUENCE``: norms, residual adds, dropout and position embeddings: replicated on
  every tensor-parallel rank, or split along the sequence when sequence parallelism
  is on (parameters stay replicated). So is a mixture-of-experts sublayer's router and
  experts (children in :data:`MOE_PARTS`): the runtime's TP shards ``nn.Linear`` and
  ``nn.Embedding`` only, so 3-D expert weights stay whole on every rank (expert
  parallelism is not supported).

Module names per family (block children; vocabulary leaves):

=============================  ==============================  ===========================
family                         sublayers                       vocabulary-parallel
=============================  ==============================  ===========================
zoo transformer                ``attention``, ``feed_forward``  ``tok_embeddings``, ``output``
Llama, Mistral, Qwen2          ``self_attn``, ``mlp``            ``embed_tokens``, ``lm_head``
Mixtral                        ``self_attn`` (``mlp``: MoE)      ``embed_tokens``, ``lm_head``
GPT-2                          ``attn``, ``mlp``                 ``wte``, ``lm_head``
GPT-NeoX                       ``attention``, ``mlp``            ``embed_in``, ``embed_out``/``lm_head``
=============================  ==============================  ===========================
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from planner.graph import OpKind, OpNode

__all__ = [
    "TPShard",
    "tp_shard",
    "ShardKey",
    "work_divisor",
    "param_divisor",
    "split_runs",
    "SUBLAYERS",
    "VOCAB_PARALLEL",
    "MOE_PARTS",
]

SUBLAYERS = frozenset({"attention", "feed_forward", "self_attn", "attn", "mlp"})
"""Block children holding a column-parallel/row-parallel linear pair."""
VOCAB_PARALLEL = frozenset(
    {"tok_embeddings", "output", "loss", "embed_tokens", "wte", "embed_in", "lm_head",
     "embed_out"}
)  # fmt: skip
"""Leaf modules split on the vocabulary: token embeddings, output heads, the loss."""
MOE_PARTS = frozenset({"experts", "gate", "router"})
"""Children of a sublayer that make it a mixture of experts (kept whole under TP)."""
# Kinds that run on the full hidden vector of each token even inside a sublayer.
_PER_TOKEN_KINDS = frozenset({OpKind.NORM})
# Kinds doing tensor-core work: a run of split nodes without any is no TP sublayer.
_SUBLAYER_WORK = frozenset({OpKind.MATMUL, OpKind.ATTENTION, OpKind.EMBEDDING, OpKind.LOSS})


class TPShard(StrEnum):
    SPLIT = "split"
    SEQUENCE = "sequence"


def tp_shard(node: OpNode) -> TPShard:
    """The tensor-parallel rule for ``node`` (module path relative to its segment)."""
    parts = node.module.split(".") if node.module else []
    if node.kind is OpKind.LOSS or (parts and parts[-1] in VOCAB_PARALLEL):
        return TPShard.SPLIT
    if _in_sublayer(parts) and node.kind not in _PER_TOKEN_KINDS:
        return TPShard.SPLIT
    return TPShard.SEQUENCE


def _in_sublayer(parts: list[str]) -> bool:
    """Whether a block-relative path lies in an attention/MLP sublayer that TP splits."""
    if not parts or parts[0] not in SUBLAYERS:
        return False
    return len(parts) < 2 or parts[1] not in MOE_PARTS


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
    """Index runs of consecutive ``SPLIT`` nodes: one per tensor-parallel sublayer.

    Views at either end of a run are left out, so its first node reads the sublayer's
    input and its last writes its output (GPT-2's ``Conv1D`` reshapes around its
    matmul). A run without tensor-core work (only the views of a mixture-of-experts
    sublayer around its replicated router and experts) splits nothing and needs no
    collective, so it is left out too.
    """
    runs: list[list[int]] = [[]]
    for index, node in enumerate(nodes):
        if tp_shard(node) is TPShard.SPLIT:
            runs[-1].append(index)
        elif runs[-1]:
            runs.append([])
    trimmed = [_without_end_views(run, nodes) for run in runs]
    return [run for run in trimmed if any(nodes[i].kind in _SUBLAYER_WORK for i in run)]


def _without_end_views(run: list[int], nodes: Sequence[OpNode]) -> list[int]:
    moving = [position for position, i in enumerate(run) if nodes[i].kind is not OpKind.VIEW]
    return run[moving[0] : moving[-1] + 1] if moving else []
