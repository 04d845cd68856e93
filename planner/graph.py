"""The operator graph: what :mod:`planner.tracing` produces and the cost model reads.

Plain frozen dataclasses with no torch objects, so the cost model and the solvers can
be tested without torch. A model is a sequence of *segments* in execution order
(embedding, block 0, block 1, ..., head); segments with the same structure share one
*segment type*, so a 96-layer GPT holds one block type whose operators are stored
once. Units: FLOPs are floating-point operations (a multiply-add is 2), sizes are
bytes, shapes are per micro-batch as traced.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from enum import StrEnum

from planner.dtypes import FP32_BYTES

__all__ = [
    "CROSS_ENTROPY_BYTES", "OpKind", "OpRole", "OpNode", "SegmentType", "Segment", "OpGraph",
]  # fmt: skip

# Eager F.cross_entropy of fp32 logits, (read, written) bytes per logit in the forward:
# log_softmax reads them and writes its fp32 output (kept for backward), nll_loss reads
# that back. Traced and formula graphs alike price the loss with it (the cast of
# lower-precision logits to fp32 is an operator of its own).
CROSS_ENTROPY_BYTES = (2 * FP32_BYTES, FP32_BYTES)


class OpKind(StrEnum):
    MATMUL = "matmul"  # linear layers, bmm, einsum-like contractions
    CONV = "conv"
    ATTENTION = "attention"  # fused scaled-dot-product attention (QK^T, softmax, PV)
    SOFTMAX = "softmax"
    NORM = "norm"  # layer norm, rms norm and their pieces
    ELEMENTWISE = "elementwise"  # activations, adds, multiplies, casts
    EMBEDDING = "embedding"
    LOSS = "loss"
    REDUCTION = "reduction"  # sum, mean, pooling
    VIEW = "view"  # reshape, transpose, slicing: no FLOPs, no traffic
    OTHER = "other"


class OpRole(StrEnum):
    """What an operator does in a mixture-of-experts layer or a latent attention ("" elsewhere)."""

    NONE = ""
    ROUTER = "router"  # scores tokens against experts and picks top_k
    EXPERTS = "experts"  # routed experts: grouped GEMMs over [experts, ...] weights
    SHARED_EXPERTS = "shared_experts"  # experts every token passes through
    # latent attention's up-projections with their norms, rotary and joined queries/keys:
    # what Megatron-Core's mla_up_proj recompute runs again (formula graphs)
    LATENT_UP = "latent_up"


@dataclass(frozen=True)
class OpNode:
    """One operator of one micro-batch's forward pass.

    ``gemm`` is ``(batch, m, n, k)`` for matmuls and attention (per head group, the
    product counted in FLOPs). ``saved_bytes`` is what autograd keeps for backward.
    ``inputs`` names producer nodes in the same segment type (edges).
    """

    name: str
    kind: OpKind
    target: str  # the aten/torch op or module class, for people and for matching traces
    module: str  # FQN relative to the segment root ("attention.wq"); "" for the root
    inputs: tuple[str, ...]
    input_shapes: tuple[tuple[int, ...], ...]
    output_shape: tuple[int, ...]
    dtype: str
    flops_fwd: float
    flops_bwd: float
    bytes_read: float
    bytes_written: float
    param_count: int = 0
    param_bytes: float = 0.0
    saved_bytes: float = 0.0
    gemm: tuple[int, int, int, int] | None = None
    batched: bool = True  # grows with the batch (False: derived from constants, as positions)
    role: OpRole = OpRole.NONE

    @property
    def input_bytes(self) -> float:
        """Bytes of the activations it reads (its parameters aside)."""
        return max(self.bytes_read - self.param_bytes, 0.0)

    @property
    def bias_count(self) -> int:
        """Parameters of a linear beyond its ``n x k`` weight (its bias); 0 for others."""
        if self.gemm is None or not self.param_count:
            return 0
        _, _, out_features, in_features = self.gemm
        return max(self.param_count - out_features * in_features, 0)


@dataclass(frozen=True)
class SegmentType:
    """The operators shared by every segment of one structure."""

    type_id: str  # structural hash
    kind: str  # "embedding", "block" or "head" (or "other" for user models)
    nodes: tuple[OpNode, ...]
    num_experts: int = 0  # routed experts of its MoE layer (0: none)
    top_k: int = 0  # experts each token is routed to
    hidden_size: int = 0  # width of the tokens its all-to-all moves (MoE layers)

    @property
    def flops_fwd(self) -> float:
        return sum(n.flops_fwd for n in self.nodes)

    @property
    def flops_bwd(self) -> float:
        return sum(n.flops_bwd for n in self.nodes)

    @property
    def param_count(self) -> int:
        return sum(n.param_count for n in self.nodes)

    @property
    def param_bytes(self) -> float:
        return sum(n.param_bytes for n in self.nodes)

    @property
    def saved_bytes(self) -> float:
        return sum(n.saved_bytes for n in self.nodes)

    @property
    def attention_count(self) -> int:
        """Fused attention calls (``F.scaled_dot_product_attention``) per forward."""
        return sum(n.kind is OpKind.ATTENTION for n in self.nodes)

    @property
    def param_tensor_count(self) -> int:
        """Parameter tensors: each operator's weight, and its bias."""
        return sum(1 + (n.bias_count > 0) for n in self.nodes if n.param_count)


@dataclass(frozen=True)
class Segment:
    """One occurrence of a segment type at module path ``fqn`` (e.g. ``layers.3``).

    ``modules`` lists the top-level module FQNs it covers, the unit a pipeline stage
    split names.
    """

    fqn: str
    type_id: str
    modules: tuple[str, ...]


@dataclass(frozen=True)
class OpGraph:
    """A traced model: segments in execution order and their shared types."""

    model_name: str
    batch_size: int
    seq_len: int
    dtype: str
    tracer: str  # "fx", "export" or "draft_export": which front end produced the graph
    segments: tuple[Segment, ...]
    types: dict[str, SegmentType] = field(hash=False)
    # whether the model's own attention calls are causal (None: they do not say, e.g. a
    # mask; a formula graph's causality is its spec's)
    attention_causal: bool | None = None
    # the share of its attention calls that hand the kernel a mask tensor (which then
    # computes every block: no causal skipping), as sliding windows and masks of a
    # model's own do (Gemma 3: its sliding layers once the sequence outgrows the window)
    masked_attention_share: float = 0.0

    def segment_type(self, segment: Segment) -> SegmentType:
        return self.types[segment.type_id]

    def module_root(self, segment: Segment) -> str:
        """The FQN its operators' module paths are relative to: a block's own
        (``layers.3``); the model's (``""``) for the runs before and after the blocks,
        whose ``fqn`` is a label."""
        return segment.fqn if self.types[segment.type_id].kind == "block" else ""

    @property
    def blocks(self) -> tuple[Segment, ...]:
        return tuple(s for s in self.segments if self.types[s.type_id].kind == "block")

    @property
    def digest(self) -> str:
        """A short hash of what the cost model prices: every operator's kind, op, role,
        output shape, FLOPs and parameters, and which operators it reads, in execution
        order. Equal for the same model traced at the same shape; a config edit that keeps
        the parameter shapes (experts per token, heads of another width, the activation)
        or a code edit that rewires them (queries and keys swapped) changes it, and so does
        the attention's own causality and masking."""
        share = self.masked_attention_share
        masked = "" if share == 0 else "masked;" if share == 1 else f"masked={share!r};"
        digest = hashlib.sha256(f"causal={self.attention_causal};{masked}".encode())
        for segment in self.segments:
            for n in self.types[segment.type_id].nodes:
                digest.update(
                    f"{n.kind.value}|{n.target}|{n.role.value}|{n.output_shape}|"
                    f"{n.flops_fwd!r}|{n.flops_bwd!r}|{n.param_count}|{n.inputs};".encode()
                )
        return digest.hexdigest()[:16]

    def total(self, attribute: str) -> float:
        """Sum of a numeric :class:`SegmentType` property over every segment."""
        return sum(getattr(self.types[s.type_id], attribute) for s in self.segments)

    @property
    def flops_fwd(self) -> float:
        return self.total("flops_fwd")

    @property
    def flops_bwd(self) -> float:
        return self.total("flops_bwd")

    @property
    def param_count(self) -> int:
        return int(self.total("param_count"))

    @property
    def param_tensor_count(self) -> int:
        return int(self.total("param_tensor_count"))

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (0: a dense model)."""
        return max((t.num_experts for t in self.types.values()), default=0)
